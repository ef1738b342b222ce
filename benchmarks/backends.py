"""Per-graph latency of each compile backend against eager on the same model, interleaved in one run.

For every graph of a small plan (prefill chunk, decode, draft loop, verify at several tree sizes,
acceptance), each backend compiles it (timed), a fresh process loads the artifact directory (timed:
cold start), and then all backends run the graph round-robin on the same inputs; the report gives
the median latency and the ratio to eager.

    python benchmarks/backends.py [--model PATH] [--backends inductor,aoti,onnx] [--ctx 512] [--reps 20]

Inductor's compile time depends on its on-disk cache: point TORCHINDUCTOR_CACHE_DIR at an empty
directory to measure a cold compile.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specair.compile.backends import BackendUnavailable, get_backend
from specair.compile.catalog import Catalog
from specair.compile.plan import Plan
from specair.compile.graph_def import GraphKey
from specair.compile.spec_config import SpeculativeConfig
from specair.models.checkpoint import load_checkpoint
from specair.models.llama import build_model, truncated
from specair.runtime.build import make_proposer

TREES = {"chain k=3": None, "kary:3x2": "kary:3x2", "mc_sim_7b_63": "mc_sim_7b_63"}


def catalogs(model, ctx: int) -> dict[str, Catalog]:
    out = {}
    for name, tree in TREES.items():
        k = 4 if tree == "mc_sim_7b_63" else 3
        spec = SpeculativeConfig.parse({"method": "layer_skip", "num_layers": 12, "num_speculative_tokens": k,
                                        "tree": tree})
        plan = Plan(max_context=ctx, batch_buckets=(1,), variants=("greedy", "filtered"), speculative=spec)
        out[name] = Catalog(model, plan, make_proposer(plan, model, truncated(model, 12)))
    return out


def selected_keys(cats: dict[str, Catalog], ctx: int) -> list[tuple[str, GraphKey]]:
    """(tree, key) pairs: prefill, decode and the chain draft once; verify-and-accept per tree (greedy and
    exact sampling)."""
    keys = [("chain k=3", GraphKey("prefill", 1, ctx)), ("chain k=3", GraphKey("decode", 1, ctx, variant="greedy")),
            ("chain k=3", GraphKey("draft", 1, ctx, variant="plain"))]
    for name, cat in cats.items():
        keys.append((name, cat.verify_key(1, ctx, "greedy")))
        keys.append((name, cat.verify_key(1, ctx, "filtered")))
    return keys


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--backends", default="inductor,aoti,onnx")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="bench-out/backends")
    ap.add_argument("--json")
    ap.add_argument("--load-only", nargs=2, metavar=("BACKEND", "DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    ckpt = load_checkpoint(args.model)
    model = build_model(ckpt.config, ckpt.state_dict)
    cats = catalogs(model, args.ctx)
    keys = selected_keys(cats, args.ctx)
    if args.load_only:  # child process: time a cold load of every graph
        be = get_backend(args.load_only[0])
        t = time.perf_counter()
        be.begin(Path(args.load_only[1]), loading=True)
        for tree, key in keys:
            be.load(cats[tree].graph(key), Path(args.load_only[1]) / tree.replace(" ", "_"))
        print(json.dumps({"load_s": time.perf_counter() - t}))
        return

    backends = {"eager": get_backend("eager")}
    for name in args.backends.split(","):
        try:
            backends[name] = get_backend(name)
        except BackendUnavailable as e:
            print(f"skipping {name}: {e}", file=sys.stderr)
    fns: dict[str, dict[str, object]] = {b: {} for b in backends}
    compile_s: dict[str, float] = {}
    load_s: dict[str, float] = {}
    for bname, be in backends.items():
        root = Path(args.out) / bname
        t = time.perf_counter()
        for tree, key in tqdm(keys, desc=f"compile {bname}", file=sys.stderr):
            d = root / tree.replace(" ", "_")
            d.mkdir(parents=True, exist_ok=True)
            fns[bname][f"{tree}|{key}"] = be.compile(cats[tree].graph(key), d)
        be.end(root)
        compile_s[bname] = time.perf_counter() - t
        if bname != "eager":
            r = subprocess.run([sys.executable, __file__, "--ctx", str(args.ctx), "--load-only", bname, str(root)]
                               + (["--model", args.model] if args.model else []), capture_output=True, text=True)
            load_s[bname] = json.loads(r.stdout.strip().splitlines()[-1])["load_s"] if r.returncode == 0 else None
    times: dict[str, dict[str, list[float]]] = {b: {} for b in backends}
    with torch.inference_mode():
        for tree, key in tqdm(keys, desc="timing", file=sys.stderr):
            inputs = cats[tree].graph(key).example_inputs
            name = f"{tree}|{key}"
            for _ in range(2):
                for b in backends:
                    fns[b][name](*inputs)
            for _ in range(args.reps):
                for b in backends:  # round-robin: machine noise hits every backend alike
                    t = time.perf_counter()
                    fns[b][name](*inputs)
                    times[b].setdefault(name, []).append(time.perf_counter() - t)
    report = {"ctx": args.ctx, "torch": torch.__version__, "threads": torch.get_num_threads(),
              "compile_s": compile_s, "cold_load_s": load_s, "graphs": {}}
    print(f"{'graph':<52}" + "".join(f"{b:>16}" for b in backends))
    for tree, key in keys:
        name = f"{tree}|{key}"
        med = {b: statistics.median(times[b][name]) * 1e3 for b in backends}
        report["graphs"][name] = {b: {"ms": med[b], "vs_eager": med["eager"] / med[b]} for b in backends}
        label = key.name if tree == "chain k=3" or key.kind != "verify" else f"{key} ({tree})"
        print(f"{label:<52}" + "".join(f"{med[b]:9.2f} ms {med['eager'] / med[b]:4.2f}x"[:16].rjust(16)
                                         for b in backends))
    print("compile s: " + ", ".join(f"{b} {s:.1f}" for b, s in compile_s.items()))
    print("cold load s: " + ", ".join(f"{b} {s:.1f}" if s is not None else f"{b} failed" for b, s in load_s.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
