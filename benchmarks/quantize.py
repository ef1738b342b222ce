"""Weight-only quantization of the onnx backend (fp32, int4, int8) against eager, on one model.

For each onnx configuration it compiles a greedy plan (batch 1, context buckets up to --ctx) into
bench-out/quantize/<config>, then reports:

- sizes: the artifact directory and its shared weights file; compile time;
- cold load in a fresh process: seconds to create every graph's session, and the resident memory they
  add over the loaded torch model, before and after one call of each;
- per-graph latency (decode step, 128-token prefill chunk), all configurations round-robin on the same
  inputs, median ms;
- end to end: greedy generation over --prompts chat prompts of the shipped set, --max-tokens each,
  configurations interleaved prompt by prompt: decode tok/s (median over prompts) and agreement with
  the fp32 target (eager): outputs identical, and the mean share of each output before it first differs;
- teacher-forced agreement: on eager's greedy continuations, the share of positions where the
  configuration's decode step picks the same next token as fp32 (no compounding of divergences).

    python benchmarks/quantize.py [--model PATH] [--ctx 512] [--prompts 8] [--max-tokens 64] [--reps 20]
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

from specair.compile.backends import get_backend
from specair.compile.catalog import Catalog
from specair.compile.graph_def import GraphKey
from specair.compile.plan import Plan
from specair.models.checkpoint import load_checkpoint
from specair.models.llama import build_model
from specair.runtime.build import engine_from_models, open_engine
from specair.runtime.llm import LLM
from specair.runtime.params import SamplingParams

PROMPTS = Path(__file__).parent / "prompts.jsonl"


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def plan_for(model, ctx: int) -> Plan:
    return Plan(max_context=ctx, batch_buckets=(1,), variants=("greedy",))


def cold_load(args, quant: str, art: Path) -> dict:
    """Child process: load every graph of the artifact directory, memory after each session."""
    ckpt = load_checkpoint(args.model, progress=False)
    model = build_model(ckpt.config, ckpt.state_dict)
    cat = Catalog(model, plan_for(model, args.ctx))
    be = get_backend("onnx", args.threads, quantize=quant)
    graphs = {key: cat.graph(key) for key in cat.keys()}
    base, t = rss_mb(), time.perf_counter()
    be.begin(art, loading=True)
    fns = {key: be.load(g, art) for key, g in graphs.items()}
    load_s, loaded = time.perf_counter() - t, rss_mb() - base
    with torch.inference_mode():
        for key, g in graphs.items():  # a first call sizes each session's buffers
            fns[key](*g.example_inputs)
    return {"load_s": round(load_s, 2), "graphs": [k.name for k in graphs], "rss_added_mb_sessions": round(loaded),
            "rss_added_mb_after_a_call_each": round(rss_mb() - base)}


def teacher_forced(run, cat: Catalog, ids: list[int], cont: list[int], ctx: int) -> int:
    """How many of cont[1:] the decode step predicts after the fp32 prefix (run(key, **inputs) calls a graph,
    a GraphSet; the K/V are committed by hand)."""
    k, v = cat.target.empty_cache(1, cat.plan.slots)  # its own (the catalog's example caches are shared)
    chunk = cat.plan.prefill_chunk
    for start in range(0, len(ids), chunk):
        part = ids[start:start + chunk]
        toks = torch.zeros(1, chunk, dtype=torch.long)
        toks[0, :len(part)] = torch.tensor(part)
        out = run(GraphKey("prefill", 1, ctx), tokens=toks, cache_len=torch.tensor([start]),
                  n_valid=torch.tensor([len(part)]), k_cache=k, v_cache=v)
        nk, nv = out["new_k"], out["new_v"]
        k[..., start:start + chunk, :], v[..., start:start + chunk, :] = nk, nv
    pos, hits = len(ids), 0
    key = GraphKey("decode", 1, ctx, variant="greedy")
    samp = {"temperature": torch.zeros(1), "top_k": torch.zeros(1, dtype=torch.long), "top_p": torch.ones(1),
            "uniform": torch.zeros(1)}
    for tok, nxt in zip(cont[:-1], cont[1:], strict=True):
        out = run(key, tokens=torch.tensor([tok]), cache_len=torch.tensor([pos]), k_cache=k, v_cache=v, **samp)
        k[..., pos:pos + 1, :], v[..., pos:pos + 1, :] = out["new_k"], out["new_v"]
        hits += int(out["next_tokens"].item() == nxt)
        pos += 1
    return hits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--quant", default="none,int4,int8", help="onnx configurations")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, help="torch and onnxruntime threads (default: theirs)")
    ap.add_argument("--out", default="bench-out/quantize")
    ap.add_argument("--json")
    ap.add_argument("--reuse", action="store_true", help="use artifacts already compiled under --out")
    ap.add_argument("--cold-load", nargs=2, metavar=("QUANT", "DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cold_load:
        print(json.dumps(cold_load(args, *args.cold_load)))
        return
    quants = [q for q in args.quant.split(",") if q]
    out = Path(args.out)
    report: dict = {"ctx": args.ctx, "threads": torch.get_num_threads(), "torch": torch.__version__, "configs": {}}

    # 1. compile (or reuse), sizes, cold load in a fresh process
    ckpt = load_checkpoint(args.model, progress=False)
    model = build_model(ckpt.config, ckpt.state_dict)
    tokenizer = ckpt.tokenizer
    for q in quants:
        art = out / f"onnx-{q}"
        if not (args.reuse and (art / "manifest.json").exists()):
            cmd = [sys.executable, "-m", "specair.runtime.cli", "compile", "--backend", "onnx", "--quantize", q,
                   "--out", str(art), "--buckets", "1", "--variants", "greedy", "--max-context", str(args.ctx)]
            cmd += ["--model", args.model] if args.model else []
            t = time.perf_counter()
            subprocess.run(cmd, check=True)
            report["configs"].setdefault(q, {})["compile_s"] = round(time.perf_counter() - t, 1)
        files = {p.name: p.stat().st_size for p in art.iterdir()}
        rep = report["configs"].setdefault(q, {})
        rep["weights_file_mb"] = round(files.get("onnx_weights.bin", 0) / 2**20, 1)
        rep["graph_files_mb"] = round(sum(s for n, s in files.items() if n.endswith(".onnx")) / 2**20, 1)
        r = subprocess.run([sys.executable, __file__, "--ctx", str(args.ctx), "--cold-load", q, str(art)]
                           + (["--threads", str(args.threads)] if args.threads else [])
                           + (["--model", args.model] if args.model else []), capture_output=True, text=True,
                           check=True)
        rep.update(json.loads(r.stdout.strip().splitlines()[-1]))
        print(q, json.dumps(rep), file=sys.stderr, flush=True)

    # 2. engines: eager over the model in memory, onnx ones from their artifacts (nothing compiled here)
    llms = {"eager": LLM.from_engine(engine_from_models(model, tokenizer, max_context=args.ctx,
                                                        variants=("greedy",)))}
    for q in quants:
        llms[f"onnx-{q}"] = LLM.from_engine(open_engine(args.model, artifacts=str(out / f"onnx-{q}"),
                                                        threads=args.threads))
    names = list(llms)

    # 3. per-graph latency, round-robin
    cats = {n: Catalog(llm.engine.target, plan_for(model, args.ctx)) for n, llm in llms.items()}
    fns = {n: llm.engine.graphs for n, llm in llms.items()}
    keys = [GraphKey("decode", 1, args.ctx, variant="greedy"), GraphKey("prefill", 1, args.ctx)]
    lat: dict[str, dict[str, list[float]]] = {n: {k: [] for k in keys} for n in names}
    with torch.inference_mode():
        for key in keys:
            graph = cats["eager"].graph(key)
            inputs = dict(zip(graph.input_names, graph.example_inputs))
            for _ in range(2):
                for n in names:
                    fns[n](key, **inputs)
            for _ in range(args.reps):
                for n in names:
                    t = time.perf_counter()
                    fns[n](key, **inputs)
                    lat[n][key].append(time.perf_counter() - t)
    for n in names:
        report["configs"].setdefault(n.removeprefix("onnx-") if n != "eager" else "eager", {})["latency_ms"] = {
            k.name: round(statistics.median(v) * 1e3, 2) for k, v in lat[n].items()}
    print(json.dumps({n: report["configs"][n.removeprefix("onnx-")]["latency_ms"] for n in names}), file=sys.stderr)

    # 4. end to end, interleaved prompt by prompt
    prompts = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()][:args.prompts]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    results: dict[str, list] = {n: [] for n in names}
    llms["eager"].chat(prompts[0]["messages"], SamplingParams(max_tokens=4))  # warm-up
    for p in prompts:
        for n in names:
            results[n].append(llms[n].chat(p["messages"], params)[0])
    ref = [r.token_ids for r in results["eager"]]
    with torch.inference_mode():
        for n in names:
            outs = [r.token_ids for r in results[n]]
            prefix = [next((i for i, (a, b) in enumerate(zip(o, e, strict=False)) if a != b), len(e)) / len(e)
                      for o, e in zip(outs, ref, strict=True)]
            hits = sum(teacher_forced(fns[n], cats[n],
                                      llms[n].encode_chat(p["messages"]), e, args.ctx)
                       for p, e in zip(prompts, ref, strict=True))
            rep = report["configs"].setdefault(n.removeprefix("onnx-") if n != "eager" else "eager", {})
            rep["decode_tok_s"] = round(statistics.median(r.decode_tokens_per_s for r in results[n]), 2)
            rep["identical_outputs"] = f"{sum(o == e for o, e in zip(outs, ref, strict=True))}/{len(ref)}"
            rep["mean_prefix_agreement"] = round(statistics.mean(prefix), 3)
            rep["teacher_forced_top1"] = round(hits / sum(len(e) - 1 for e in ref), 4)
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
