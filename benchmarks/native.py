"""The native runner beside the Python engine, on the same artifacts, side by side in one run.

Each round starts both as fresh processes, back to back (alternating which goes first): `specair-run
--artifacts A --prompt-ids IDS.jsonl` and `specair generate --artifacts A --prompts MESSAGES.jsonl` (the
same chat prompts, so the same ids),
both streaming text. Process start to first token is the time from spawning the process to the first
byte of generated text on its stdout; decode tokens/s is what each prints for each prompt (tokens after
the first over the time after it), pooled over the prompts. Greedy outputs are compared too.

    python benchmarks/native.py --artifacts ART --runner build/specair-run --num-prompts 4 --max-tokens 64 \
        --threads 2 --rounds 3 --out docs/bench/native
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SUMMARY = re.compile(r"(\d+) generated, ([\d.]+) tok/s decode")
ROOT = Path(__file__).resolve().parents[1]


def timed(cmd: list[str]) -> dict:
    """Run a command; seconds from spawn to its first stdout byte and to its exit, its stdout and the
    (generated tokens, decode tok/s) of each prompt from its stderr summaries."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = p.stdout.read(1)
    t_first = time.perf_counter() - t0
    rest, err = p.communicate()
    total = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"{cmd[0]} failed ({p.returncode}): {err.decode()[-2000:]}")
    prompts = [(int(n), float(r)) for n, r in SUMMARY.findall(err.decode())]
    return {"first_token_s": t_first, "total_s": total, "text": (first + rest).decode(errors="replace"),
            "prompts": prompts}


def pooled_rate(prompts: list[tuple[int, float]]) -> float:
    """Decode tokens/s over all prompts: tokens after the first over the summed decode time."""
    tokens = sum(n - 1 for n, r in prompts if r > 0)
    secs = sum((n - 1) / r for n, r in prompts if r > 0)
    return tokens / secs if secs else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifacts", required=True, help="a `specair compile --backend aoti` directory")
    ap.add_argument("--runner", default=str(ROOT / "build" / "specair-run"))
    ap.add_argument("--prompts", default=str(ROOT / "benchmarks" / "prompts.jsonl"))
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", help="directory for results.json and results.md")
    args = ap.parse_args()

    from specair.models.checkpoint import load_checkpoint

    tok = load_checkpoint(None, progress=False).tokenizer
    records = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    records = records[:args.num_prompts]
    tmp = Path(tempfile.mkdtemp(prefix="specair-native-bench-"))
    ids_file, msgs_file = tmp / "ids.jsonl", tmp / "messages.jsonl"
    ids_file.write_text("".join(json.dumps({"prompt_ids": tok.encode_chat(r["messages"])}) + "\n" for r in records))
    msgs_file.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in records))

    common = ["--artifacts", args.artifacts, "--max-tokens", str(args.max_tokens), "--threads", str(args.threads)]
    cmds = {"specair-run": [args.runner, "--prompt-ids", str(ids_file), *common],
            "specair generate": [sys.executable, "-m", "specair.runtime.cli", "generate", "--prompts", str(msgs_file),
                                 *common]}
    runs: dict[str, list[dict]] = {k: [] for k in cmds}
    for r in range(args.rounds):
        for name, cmd in sorted(cmds.items(), reverse=r % 2 == 1):  # alternate who goes first
            res = timed(cmd)
            runs[name].append(res)
            print(f"round {r + 1}/{args.rounds} {name}: first token {res['first_token_s']:.2f} s after start, "
                  f"decode {pooled_rate(res['prompts']):.1f} tok/s, total {res['total_s']:.1f} s", file=sys.stderr)

    summary = {}
    for name, rs in runs.items():
        summary[name] = {"first_token_s": statistics.median(x["first_token_s"] for x in rs),
                         "decode_tokens_per_s": statistics.median(pooled_rate(x["prompts"]) for x in rs),
                         "total_s": statistics.median(x["total_s"] for x in rs)}
    same = all(a["text"] == b["text"] for a, b in zip(runs["specair-run"], runs["specair generate"]))
    plan = json.loads((Path(args.artifacts) / "manifest.json").read_text())["plan"]
    # Rounds pair the two runtimes back to back, so the median of per-round ratios cancels slow drifts.
    ratio = statistics.median(pooled_rate(a["prompts"]) / pooled_rate(b["prompts"])
                              for a, b in zip(runs["specair-run"], runs["specair generate"]))
    result = {"artifacts": args.artifacts, "plan": plan,
              "num_prompts": len(records), "max_tokens": args.max_tokens, "threads": args.threads,
              "rounds": args.rounds, "summary": summary, "same_text": same,
              "decode_ratio": ratio,
              "command": " ".join(sys.argv), "runs": runs}
    lines = ["| runtime | process start → first token (s) | decode tok/s | whole run (s) |", "|---|---|---|---|"]
    for name, s in summary.items():
        lines.append(f"| {name} | {s['first_token_s']:.2f} | {s['decode_tokens_per_s']:.1f} | {s['total_s']:.1f} |")
    lines.append(f"\nMedians of {args.rounds} rounds, {len(records)} prompts × {args.max_tokens} tokens, "
                 f"{args.threads} threads; decode ratio native/Python (median of per-round ratios) "
                 f"{result['decode_ratio']:.2f}; "
                 f"same greedy text: {same}.")
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(result, indent=2))
        (out / "results.md").write_text("\n".join(lines) + f"\n\n`{result['command']}`\n")


if __name__ == "__main__":
    main()
