"""The whole runtime through the cuda backend (CUDA graphs), end to end, on an NVIDIA GPU:

  python scripts/gpu_check.py [--device cuda] [--backends eager,inductor,cuda] [--skip-latency] [--json OUT]

1. Every proposer is lossless: on a tiny random float64 Llama (`--tiny-dtype fp32` if float64 ever fails
   on a GPU; float32 can then differ from eager at near-ties of two logits, which is not a bug), greedy
   generation of 5 prompts of different lengths with batch buckets (1, 2, 4) gives, for autoregressive and
   every proposer (draft_model chain and tree, layer_skip, eagle chain and topk tree, medusa static tree,
   mlp_speculator, ngram; random heads and a random 1-layer draft), exactly the token ids of eager
   autoregressive greedy on the same device, and the same drafts and acceptances as the proposer on eager.
2. Zero captures after start-up: graphs built on first use are all captured during a first (warm-up)
   generation; a second, identical generation captures none. From an artifact directory (`specair compile`
   path: compile, then load) every graph is captured at start-up and the first generation captures none.
3. No cache copy: in those generations no graph copies a KV cache (k_cache / v_cache) into a static
   buffer (the runtime binds every bucket's caches, and the one-row scratch caches to the prompt-prefill
   graphs, before any capture).
4. Per-token latency on the default model (SmolLM2-135M-Instruct, fp32; the tiny model if it cannot be
   loaded, said so): decode ms per generated token, tok/s and speedup vs eager autoregressive for each of
   `--backends`, autoregressive and the shipped EAGLE head, greedy, batch 1, warm-up first; τ (mean accepted
   length) for EAGLE. A markdown table to paste into a README. Inductor compiles only the graphs one
   generation needs, and rows starting after `--budget` seconds are skipped, so a GPU run stays ~5 min.

Per-graph capture/load/compare checks live in `pytest tests/test_device_backends.py -k cuda`.

Without a GPU, `python scripts/gpu_check.py --device cpu --backends eager --skip-latency` runs checks 1
on eager and prints "skipped: no GPU" for the cuda ones; add `cuda-sim` to --backends to run checks 1-3
through the cuda backend's own static-buffer code (bindings, `inputs_to_copy`, runner) with replays
emulated on the CPU. Written and run on a machine without a GPU: the cuda path itself is unverified.
Exit status 1 if any check failed, 2 if the device is missing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

import torch

from specair.compile.artifacts import GraphSet, compile_artifacts, load_artifacts, read_manifest
from specair.compile.backends import get_backend
from specair.compile.backends.cuda import CudaGraphBackend, CudaGraphRunner, input_names, inputs_to_copy
from specair.compile.catalog import Catalog
from specair.models.checkpoint import random_checkpoint
from specair.models.config import ModelConfig
from specair.models.llama import build_model, truncated
from specair.runtime import build
from specair.runtime.llm import LLM
from specair.runtime.params import SamplingParams

V = 256
PROMPTS = [list(range(3, 40, 2)), [5, 6, 7], list(range(10, 50)), [9] * 5 + [11, 12], list(range(60, 20, -1))]
BUDGETS = [40, 12, 33, 25, 18]  # rows join and leave at different steps: buckets 1, 2 and 4 all run
CONFIGS = {
    "autoregressive": None,
    "draft_model chain": {"method": "draft_model", "model": "-", "num_speculative_tokens": 3},
    "draft_model kary:2x2": {"method": "draft_model", "model": "-", "num_speculative_tokens": 2, "tree": "kary:2x2"},
    "layer_skip": {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 4},
    "eagle chain": {"method": "eagle", "num_speculative_tokens": 3},
    "eagle topk:2x6": {"method": "eagle", "num_speculative_tokens": 3, "tree": "topk:2x6"},
    "medusa tree": {"method": "medusa", "num_speculative_tokens": 3, "tree": [[0], [1], [0, 0], [1, 0], [0, 0, 0]]},
    "mlp_speculator": {"method": "mlp_speculator", "num_speculative_tokens": 3},
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
}
CACHES = {"k_cache", "v_cache"}
STATIC = ("cuda", "cuda-sim")  # static-buffer backends: checks 2 and 3 apply
CHECKS: list[dict] = []


def record(check: str, config: str, backend: str, ok: bool | None, detail: str = "") -> None:
    """ok None: informational or skipped."""
    CHECKS.append({"check": check, "config": config, "backend": backend, "ok": ok, "detail": detail})
    mark = {True: "PASS", False: "FAIL", None: "  - "}[ok]
    print(f"  {mark} {check:18s} {config:22s} {backend:9s} {detail}", flush=True)


# ---- models, engines and instrumentation ---------------------------------------------------------------


def tiny_model(seed: int, layers: int, dtype: torch.dtype, device: str):
    c = ModelConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_layers=layers, num_heads=4,
                    num_kv_heads=2, head_dim=16, max_position_embeddings=512)
    return build_model(c, random_checkpoint(c, seed), dtype).to(device)


def random_heads(target, spec):
    """Untrained heads with random weights (as tests/test_engine.py): junk proposals, same output."""
    from specair.models.eagle import EagleHead
    from specair.models.medusa import MedusaHeads
    from specair.models.mlp_speculator import MLPSpeculator

    torch.manual_seed(0)
    k = spec["num_speculative_tokens"]
    heads = {"eagle": lambda: EagleHead(target), "medusa": lambda: MedusaHeads(target, k, 1),
             "mlp_speculator": lambda: MLPSpeculator(target, k)}[spec["method"]]()
    with torch.no_grad():
        for p in getattr(heads, "own_parameters", heads.parameters)():  # never the target's shared LM head
            p.normal_(0, 0.05)
    return heads.requires_grad_(False).to(target.tok_embeddings.weight.device)


def draft_for(spec, target, other):
    method = spec and spec["method"]
    if method == "draft_model":
        return other
    if method == "layer_skip":
        return truncated(target, spec["num_layers"])
    return random_heads(target, spec) if method in ("eagle", "medusa", "mlp_speculator") else None


class SimRunner(CudaGraphRunner):
    """A 'captured graph' whose replay reruns the module on its static buffers (cuda-sim)."""

    def __init__(self, graph, static) -> None:
        super().__init__(graph.key, input_names(graph), None, static, (), True)
        self.module = graph.module

    def __call__(self, *inputs):
        copy = inputs_to_copy(self.key, self.names, self.static_inputs, inputs, self.static_inputs[0].device.type)
        with torch.inference_mode():
            for i in copy:
                self.static_inputs[i].copy_(inputs[i])
            out = tuple(o.clone() for o in self.module(*self.static_inputs))
        self.last_copied = tuple(copy)
        return out


class CudaSim(CudaGraphBackend):
    """The cuda backend's bindings and copy rule with replays emulated on any device (no GPU needed)."""

    name = "cuda-sim"

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = device

    @classmethod
    def check_available(cls) -> None:
        pass

    def _capture(self, graph):
        return SimRunner(graph, self.bindings.static_inputs(graph, self.device, self.name))


def backend(name: str, device: str, stats: dict | None = None):
    """A backend instance; with `stats`, counting captures (compile/load calls) and cache copies per graph."""
    be = CudaSim(device) if name == "cuda-sim" else get_backend(name)
    if stats is None:
        return be

    def counted(build_fn):
        def wrapped(graph, art_dir):
            stats["captures"] += 1
            runner = build_fn(graph, art_dir)

            def run(*inputs):
                out = runner(*inputs)
                if CACHES & {runner.names[i] for i in getattr(runner, "last_copied", ())}:
                    stats["copies"][graph.key] += 1
                return out
            return run
        return wrapped

    be.compile, be.load = counted(be.compile), counted(be.load)
    return be


def new_stats() -> dict:
    return {"captures": 0, "copies": Counter()}


def make_plan(target, spec, buckets=(1, 2, 4), max_context=128, chunk=16):
    return build._plan(target, build.parse_spec(spec), max_context,
                       next(k for k, v in build.DTYPES.items() if v == target.dtype),
                       batch_buckets=buckets, prefill_chunk=chunk, variants=("greedy", "plain", "filtered"))


def make_engine(target, draft, spec, be, *, tokenizer=None, buckets=(1, 2, 4), max_context=128, chunk=16,
                artifacts: Path | None = None):
    """As build.engine_from_models (graphs built on first use, quietly), or from an artifact directory."""
    plan = make_plan(target, spec, buckets, max_context, chunk)
    if artifacts is None:
        graphs_for = lambda cat: GraphSet(cat, be, None, True, note=lambda m: None)  # noqa: E731
    else:
        graphs_for = lambda cat: load_artifacts(cat, be, artifacts, read_manifest(artifacts), {}, "-")  # noqa: E731
    return build.make_engine(target, tokenizer, draft, graphs_for, plan, 64)


def generate(engine, prompts=PROMPTS, budgets=BUDGETS):
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in budgets]
    return LLM.from_engine(engine).generate(prompts, params)


def drafts(results):
    return [(r.extra.get("spec", {}).get("num_drafts"), r.extra.get("spec", {}).get("num_accepted_tokens"))
            for r in results]


# ---- checks 1-3 ----------------------------------------------------------------------------------


def copy_checks(name, bname, stats, when):
    copies = dict(stats["copies"])
    record("no cache copy", name, bname, not copies,
           f"{when}: " + (f"caches copied by {copies}" if copies else "no cache copied"))


def check_static(name, spec, target, draft, bname, device, ref, eager_drafts, tmp: Path):
    stats = new_stats()
    engine = make_engine(target, draft, spec, backend(bname, device, stats))
    first = generate(engine)
    warm = stats["captures"]
    stats.update(new_stats())
    second = generate(engine)
    ok = [r.token_ids for r in first] == ref and [r.token_ids for r in second] == ref
    record("lossless", name, bname, ok and set(engine.bucket_steps) == {1, 2, 4},
           f"{len(ref)} prompts, buckets ran {sorted(engine.bucket_steps)}" + ("" if ok else ": TOKENS DIFFER"))
    if spec is not None:
        same = drafts(first) == eager_drafts and drafts(second) == eager_drafts
        hint = " (a cache copied into a static buffer another row uses?)" if stats["copies"] else ""
        record("drafts as eager", name, bname, same, "" if same else f"(drafts, accepted) per prompt: eager "
               f"{eager_drafts}, warm-up {drafts(first)}, second {drafts(second)}{hint}")
    record("0 captures later", name, bname, stats["captures"] == 0,
           f"lazy: {warm} at warm-up, {stats['captures']} in the second generation")
    copy_checks(name, bname, stats, "lazy")
    # The `specair compile` path: every graph captured at compile and again at load (start-up), none after.
    art = tmp / f"{bname}-{name.replace(' ', '_').replace(':', '_')}"
    plan = make_plan(target, spec)
    catalog = Catalog(target, plan, build.make_proposer(plan, target, draft))
    compile_artifacts(catalog, backend(bname, device), art, {}, progress=False)
    stats = new_stats()
    engine = make_engine(target, draft, spec, backend(bname, device, stats), artifacts=art)
    at_start = stats["captures"]
    stats.update(new_stats())
    res = generate(engine)
    record("0 captures later", name, bname, stats["captures"] == 0 and [r.token_ids for r in res] == ref,
           f"artifacts: {at_start} at start-up, {stats['captures']} in the first generation" +
           ("" if [r.token_ids for r in res] == ref else ", TOKENS DIFFER"))
    copy_checks(name, bname, stats, "artifacts")


def run_lossless(args, tmp: Path) -> None:
    dtype = build.DTYPES[args.tiny_dtype]
    target = tiny_model(0, 2, dtype, args.device)
    other = tiny_model(1, 1, dtype, args.device)
    ref = [r.token_ids for r in generate(make_engine(target, None, None, backend("eager", args.device)))]
    static = [b for b in args.backends if b in STATIC]
    for name, spec in CONFIGS.items():
        try:
            draft = draft_for(spec, target, other)
            eager = generate(make_engine(target, draft, spec, backend("eager", args.device)))
            if spec is not None:
                record("lossless", name, "eager", [r.token_ids for r in eager] == ref, f"vs eager autoregressive "
                       f"({args.tiny_dtype}, {args.device})")
            for b in static:
                if b == "cuda" and not args.gpu:
                    continue
                check_static(name, spec, target, draft, b, args.device, ref, drafts(eager), tmp)
        except Exception as e:  # report and go on with the next proposer
            traceback.print_exc(limit=3, file=sys.stderr)
            record("lossless", name, "-", False, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
    if "cuda" not in static or not args.gpu:
        why = "skipped: no GPU" if not args.gpu else "skipped: cuda not in --backends"
        for check in ("lossless", "drafts as eager", "0 captures later", "no cache copy"):
            record(check, "(all)", "cuda", None, why)


# ---- 4. latency -----------------------------------------------------------------------------------


def run_latency(args, t_start: float) -> list[dict]:
    spec = build.parse_spec({"method": "eagle"})
    try:
        models = build.load_models(None, "fp32", spec, device=args.device)
        target, tok, head, model = models.target, models.tokenizer, models.draft, "SmolLM2-135M-Instruct fp32"
        spec_json = {"method": "eagle"}
    except Exception as e:
        print(f"gpu_check: the default model could not be loaded ({type(e).__name__}: {e}); the tiny random model "
              f"instead (timings only, τ meaningless)", flush=True)
        target, tok, model = tiny_model(0, 2, torch.float32, args.device), None, "tiny random Llama fp32 (fallback)"
        spec_json = {"method": "eagle", "num_speculative_tokens": 4, "tree": "topk:4x8"}
        head = random_heads(target, spec_json)
    texts = ["Give me three tips for staying focused.", "Explain what a hash table is."][:args.prompts]
    if tok is not None:
        prompts = [tok.encode_chat([{"role": "user", "content": t}]) for t in texts]
    else:
        prompts = [list(range(5, 25)), list(range(40, 10, -2))][:args.prompts]
    budgets = [args.tokens] * len(prompts)
    ctx = max(len(p) for p in prompts) + args.tokens + 1
    rows = []
    for bname in [b for b in ("eager", "cuda", "inductor") if b in args.backends]:  # inductor (slowest) last
        for method, s, d in (("autoregressive", None, None), ("eagle", spec_json, head)):
            row = {"backend": bname, "method": method}
            rows.append(row)
            if bname == "cuda" and not args.gpu:
                row["skipped"] = "no GPU"
            elif time.perf_counter() - t_start > args.budget:
                row["skipped"] = f"time budget ({args.budget:.0f} s) spent"
            else:
                try:
                    eng = make_engine(target, d, s, backend(bname, args.device), tokenizer=tok, buckets=(1,),
                                      max_context=ctx, chunk=128)
                    t0 = time.perf_counter()
                    generate(eng, prompts, budgets)  # warm-up: every graph built (compiled, captured) here
                    row["warmup_s"] = time.perf_counter() - t0
                    res = generate(eng, prompts, budgets)
                    row["ms_per_token"] = sum(1e3 / r.decode_tokens_per_s for r in res) / len(res)
                    if s is not None:
                        st = [r.extra["spec"] for r in res]
                        row["tau"] = (sum(x["num_accepted_tokens"] + x["num_drafts"] for x in st)
                                      / max(sum(x["num_drafts"] for x in st), 1))
                except Exception as e:
                    traceback.print_exc(limit=3, file=sys.stderr)
                    row["skipped"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
            print(f"  latency {bname:9s} {method:15s} " + (f"skipped: {row['skipped']}" if "skipped" in row else
                  f"{row['ms_per_token']:7.2f} ms/token (warm-up {row['warmup_s']:.1f} s)"), flush=True)
    base = next((r["ms_per_token"] for r in rows if r["backend"] == "eager" and r["method"] == "autoregressive"
                 and "ms_per_token" in r), None)
    dev = torch.cuda.get_device_name() if args.gpu else args.device
    print(f"\nDecode latency, {model} on {dev}: greedy, batch 1, {len(prompts)} prompts x {args.tokens} tokens, "
          f"after a warm-up generation (torch {torch.__version__}).\n")
    print("| backend | method | ms / token | tok/s | speedup vs eager autoregressive | τ |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        method = "EAGLE (shipped head)" if r["method"] == "eagle" else "autoregressive"
        if "ms_per_token" not in r:
            print(f"| {r['backend']} | {method} | skipped: {r['skipped']} | | | |")
            continue
        speed = f"{base / r['ms_per_token']:.2f}x" if base else "-"
        tau = f"{r['tau']:.2f}" if "tau" in r else "-"
        ms = r["ms_per_token"]
        print(f"| {r['backend']} | {method} | {ms:.2f} | {1e3 / ms:.1f} | {speed} | {tau} |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backends", default="eager,inductor,cuda",
                    help="of eager, inductor, cuda (latency) and cuda-sim (checks 2-3 emulated, no GPU)")
    ap.add_argument("--skip-latency", action="store_true")
    ap.add_argument("--json", metavar="OUT", help="write checks and latency rows as JSON")
    ap.add_argument("--tiny-dtype", default="fp64", choices=("fp64", "fp32"))
    ap.add_argument("--tokens", type=int, default=64, help="latency: tokens per prompt")
    ap.add_argument("--prompts", type=int, default=2, help="latency: prompts (1 or 2)")
    ap.add_argument("--budget", type=float, default=180, help="latency rows starting later than this (s) are skipped")
    args = ap.parse_args()
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    t_start = time.perf_counter()
    args.gpu = torch.device(args.device).type == "cuda"
    if args.gpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False); for a CPU smoke test: "
              "--device cpu --backends eager[,cuda-sim] --skip-latency")
        return 2
    where = torch.cuda.get_device_name() if args.gpu else args.device
    print(f"gpu_check: torch {torch.__version__}, CUDA {torch.version.cuda}, {where}; backends {args.backends}")
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        run_lossless(args, Path(tmp))
    latency = [] if args.skip_latency else run_latency(args, t_start)
    failed = [c for c in CHECKS if c["ok"] is False]
    passed = sum(c["ok"] is True for c in CHECKS)
    print("\n| check | config | backend | result | detail |\n|---|---|---|---|---|")
    for c in CHECKS:
        res = {True: "pass", False: "**FAIL**", None: "-"}[c["ok"]]
        print(f"| {c['check']} | {c['config']} | {c['backend']} | {res} | {c['detail']} |")
    print(f"\ngpu_check: {passed} passed, {len(failed)} failed, {len(CHECKS) - passed - len(failed)} skipped/info "
          f"in {time.perf_counter() - t_start:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": where, "torch": torch.__version__, "checks": CHECKS,
                                               "latency": latency}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
