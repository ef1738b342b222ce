"""CUDA-graph backend checks on an NVIDIA GPU: `python scripts/gpu_check.py` (then `pytest
tests/test_device_backends.py -k cuda`). For every graph type on a tiny random Llama: capture (compile),
re-capture (load), compare with eager on fresh inputs (1e-4), check that the bound KV caches are never
copied, time eager vs replay. One line per graph and a summary; exit 1 if anything failed."""

from __future__ import annotations

import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from specair.compile.backends.cuda import CudaGraphBackend
from specair.compile.graph_def import GraphDef, GraphModule
from specair.graphs.acceptance import accept_greedy, accept_rejection, accept_typical
from specair.graphs.draft import draft_chain, draft_static_tree, draft_topk_tree
from specair.graphs.steps import decode_step, prefill_chunk
from specair.graphs.tree import buffers_from_parents, get_template
from specair.graphs.verify import expanded_verify, leaf_paths, tree_verify
from specair.models.config import ModelConfig
from specair.models.llama import build_model

B, SLOTS, CTX, V, DEV = 2, 192, 128, 256, "cuda"
TPL = get_template("kary:2x2", 3)
KNOWN: set[str] = set()  # graphs known to hold host tensors inside (none now)


def tiny_model():
    c = ModelConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=16, max_position_embeddings=512)
    g = torch.Generator().manual_seed(0)
    r = lambda *s, b=0.0: b + 0.2 * torch.randn(*s, generator=g)  # noqa: E731
    H, I, q, kv = 64, 128, 64, 32
    sd = {"model.embed_tokens.weight": r(V, H), "model.norm.weight": r(H, b=1), "lm_head.weight": r(V, H)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        sd |= {p + "input_layernorm.weight": r(H, b=1), p + "post_attention_layernorm.weight": r(H, b=1),
               p + "self_attn.q_proj.weight": r(q, H), p + "self_attn.k_proj.weight": r(kv, H),
               p + "self_attn.v_proj.weight": r(kv, H), p + "self_attn.o_proj.weight": r(H, q),
               p + "mlp.gate_proj.weight": r(I, H), p + "mlp.up_proj.weight": r(I, H), p + "mlp.down_proj.weight": r(H, I)}
    return build_model(c, sd).to(DEV)


def chain(d, ct, nc, dl, kc, vc, t, tk, tp, u, *, k, ctx):
    return draft_chain(d, ct, nc, dl, kc, vc, k, t, tk, tp, u, ctx)


def expanded(m, tok, root, kc, vc, *, ctx, paths):
    return expanded_verify(m, tok, *paths, root, kc, vc, ctx)


def cases(m, kv):
    """name -> (fn, models, static, input names, inputs(seed)); KV caches are the bound tensors `kv`."""
    buf, T, D, W = TPL.buffers(), TPL.num_nodes, TPL.max_depth, TPL.max_width
    cuda_buf = type(buf)(*[x.cuda() if isinstance(x, torch.Tensor) else tuple(y.cuda() for y in x) for x in buf])
    gen = lambda s: torch.Generator().manual_seed(s)  # noqa: E731
    ints = lambda s, *shape: torch.randint(0, V, shape, generator=gen(s))  # noqa: E731
    samp = [torch.tensor([0.0, 0.8]), torch.tensor([0, 20]), torch.tensor([1.0, 0.9])]
    ex = lambda x: x.expand(B, *x.shape).contiguous()  # noqa: E731
    lg = lambda s: 3 * torch.randn(B, T, V, generator=gen(s))  # noqa: E731
    t, d, KV = {"target": m}, {"draft": m}, ("k_cache", "v_cache")
    S = ("temperature", "top_k", "top_p")
    return {
        "prefill": (prefill_chunk, t, {"ctx": CTX}, ("tokens", "cache_len", "n_valid", *KV),
                    lambda s: [ints(s, B, 16), torch.tensor([5, 40 + s]), torch.tensor([16, 9]), *kv]),
        "decode": (decode_step, t, {"ctx": CTX, "variant": "filtered"}, ("tokens", "cache_len", *KV, *S, "u"),
                   lambda s: [ints(s, B), torch.tensor([5, 40 + s]), *kv, *samp,
                              torch.rand(B, generator=gen(s), dtype=torch.float64)]),
        "draft_chain": (chain, d, {"k": 3, "ctx": CTX}, ("catch", "n_catch", "draft_len", *KV, *S, "u"),
                        lambda s: [ints(s, B, 4), torch.tensor([2, 4]), torch.tensor([10, 50 + s]), *kv, *samp,
                                   torch.rand(B, 3, generator=gen(s), dtype=torch.float64)]),
        "draft_static_tree": (draft_static_tree, d, {"template": TPL, "ctx": CTX, "buffers": cuda_buf},
                              ("catch", "n_catch", "draft_len", *KV),
                              lambda s: [ints(s, B, D + 1), torch.tensor([2, D + 1]), torch.tensor([10, 50 + s]), *kv]),
        "draft_topk_tree": (draft_topk_tree, d, {"depth": 3, "topk": 2, "num_nodes": 6, "ctx": CTX},
                            ("catch", "n_catch", "draft_len", *KV),
                            lambda s: [ints(s, B, 4), torch.tensor([1, 4]), torch.tensor([9, 30 + s]), *kv]),
        "tree_verify": (tree_verify, t, {"ctx": CTX}, ("tokens", "depth", "mask", "root", *KV),
                        lambda s: [ints(s, B, T), ex(buf.depth), ex(buf.ancestor_mask), torch.tensor([12, 60 + s]), *kv]),
        "expanded_verify": (expanded, t, {"ctx": CTX, "paths": tuple(x.cuda() for x in leaf_paths(buf.paths, buf.children))},
                            ("tokens", "root", *KV), lambda s: [ints(s, B, T), torch.tensor([12, 60 + s]), *kv]),
        "tree_buffers": (buffers_from_parents, {}, {"max_depth": D, "max_width": W}, ("parents",),
                         lambda s: [torch.tensor([TPL.parents] * B)]),
        "accept_greedy": (accept_greedy, {}, {}, ("tokens", "logits", "paths"),
                          lambda s: [ints(s, B, T), lg(s), ex(buf.paths)]),
        "accept_typical": (accept_typical, {}, {}, ("tokens", "logits", "paths", *S),
                           lambda s: [ints(s, B, T), lg(s), ex(buf.paths), *samp]),
        "accept_rejection": (accept_rejection, {}, {"max_depth": D}, ("tokens", "logits", "q", "children", "u", *S),
                             lambda s: [ints(s, B, T), lg(s), torch.randn(B, T, V, generator=gen(s)).softmax(-1),
                                        ex(buf.children), torch.rand(B, T + 1, generator=gen(s), dtype=torch.float64),
                                        *samp]),
    }


def diff(a, b):
    """Max abs difference over float outputs; inf if any integer output or shape differs."""
    worst = 0.0
    for x, y in zip(a, b):
        if x.shape != y.shape or x.dtype != y.dtype or (not x.is_floating_point() and not torch.equal(x, y)):
            return float("inf")
        if x.is_floating_point():
            worst = max(worst, (x.double() - y.double()).abs().max().item() if x.numel() else 0.0)
    return worst


def timed(fn, args, n=50):
    fn(*args)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    [fn(*args) for _ in range(n)]
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def check(name, m, kv, out_dir):
    fn, models, static, names, inputs = cases(m, kv)[name]
    g = GraphDef(f"{name}.b{B}.c{CTX}", GraphModule(fn, models, static), tuple(x.to(DEV) for x in inputs(0)),
                 names, ())
    notes = []
    for step in ("compile", "load"):
        be = CudaGraphBackend()
        [be.bind_static(n, c) for n, c in zip(("k_cache", "v_cache"), kv)]
        run = be.compile(g, out_dir) if step == "compile" else be.load(g, out_dir)
        for s in (1, 2):
            [c.normal_() for c in kv]  # new cache contents in place: the graphs read the bound memory
            new = tuple(x.to(DEV) for x in inputs(s))
            err = diff(run(*new), g.eager(*new))
            copied = [names[i] for i in run.last_copied if names[i] in ("k_cache", "v_cache")]
            if err > 1e-4 or copied:
                return False, f"{step} seed {s}: max diff {err:.2e}, copied caches {copied}"
        notes.append(f"{step} ok")
    eager_us, replay_us = timed(g.eager, new), timed(run, new)
    return True, f"{', '.join(notes)}; eager {eager_us:8.1f} us, replay {replay_us:8.1f} us"


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False)")
        return 2
    print(f"gpu_check: torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
    m = tiny_model()
    kv = m.empty_cache(B, SLOTS, device=DEV)
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in cases(m, kv):
            try:
                ok, msg = check(name, m, kv, Path(tmp))
            except Exception as e:  # report and go on with the next graph
                ok, msg = False, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                traceback.print_exc(limit=2, file=sys.stderr)
            known = " (known: CPU index tensors in the graph)" if not ok and name in KNOWN else ""
            print(f"  {'PASS' if ok else 'FAIL'} {name:18s} {msg}{known}")
            if not ok:
                failed.append(name)
    total = len(cases(m, kv))
    print(f"gpu_check: {total - len(failed)}/{total} passed" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
