"""AOTInductor backend: one .pt2 per graph and bucket, equal to eager; packages carry no weights and take
the live model's parameters at load (shared, not copied); loading neither traces nor compiles; a loaded
package keeps no state between calls.

Compile time dominates (a g++ build per graph, ~15-25 s on 2 cores), so the graphs are compiled once per
module and every test reuses them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from helpers import save_tiny

from specair.compile.backends.base import BackendUnavailable
from specair.compile.graph_def import GraphDef, GraphModule
from specair.graphs.acceptance import accept_exact
from specair.graphs.draft import draft_chain, draft_static_tree
from specair.graphs.steps import decode_step, prefill_chunk
from specair.graphs.tree import get_template
from specair.graphs.verify import tree_verify
from specair.models.checkpoint import load_checkpoint
from specair.models.llama import build_model

try:
    from specair.compile.backends.aoti import AotiBackend

    AotiBackend.check_available()
except (ImportError, BackendUnavailable) as e:  # pragma: no cover - depends on the host
    pytest.skip(f"aoti backend unavailable: {e}", allow_module_level=True)

SLOTS, CTX, K = 96, 64, 3
V = 256


def models(ckpt_dir: Path):
    """Target and draft from the tiny checkpoints in ckpt_dir (written by the fixture)."""
    out = []
    for name in ("target", "draft"):
        ckpt = load_checkpoint(ckpt_dir / name, progress=False)
        out.append(build_model(ckpt.config, ckpt.state_dict).eval())
    return tuple(out)


def caches(model, B: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    k, v = model.empty_cache(B, SLOTS)
    return k.normal_(generator=g), v.normal_(generator=g)


def sampling(B: int):
    t = torch.tensor([0.8, 0.0])[:B].contiguous()
    return t, torch.tensor([20, 0])[:B].contiguous(), torch.tensor([0.9, 1.0])[:B].contiguous()


def _draft_chain(draft, catch_tokens, n_catch, draft_len, k_cache, v_cache, temperature, top_k, top_p, uniforms,
                 k, ctx):
    return draft_chain(draft, catch_tokens, n_catch, draft_len, k_cache, v_cache, k, temperature, top_k, top_p,
                       uniforms, ctx)


def build_graphs(target, draft) -> dict[str, GraphDef]:
    """The graphs under test, with deterministic example inputs (the subprocess rebuilds the same ones)."""
    g = torch.Generator().manual_seed(0)
    tpl = get_template("kary:2x2", K)
    tree = get_template("mc_sim_7b_63", 4)
    buf = tpl.buffers()
    T = tpl.num_nodes
    graphs: list[GraphDef] = []

    def add(key, fn, mods, static, inputs, names, outs):
        graphs.append(GraphDef(key, GraphModule(fn, mods, static), tuple(inputs), names, outs))

    kv = ("k_cache", "v_cache")
    k1, v1 = caches(target, 1, 1)
    add("prefill.b1.c64", prefill_chunk, {"target": target}, {"ctx": CTX},
        (torch.randint(0, V, (1, 8), generator=g), torch.tensor([5]), torch.tensor([6]), k1, v1),
        ("tokens", "cache_len", "n_valid", *kv), ("logits", "hidden", "new_k", "new_v"))
    add("decode.b1.c64", decode_step, {"target": target}, {"ctx": CTX},
        (torch.randint(0, V, (1,), generator=g), torch.tensor([17]), k1, v1, *sampling(1),
         torch.rand(1, generator=g)),
        ("tokens", "cache_len", *kv, "temperature", "top_k", "top_p", "uniform"),
        ("next", "logits", "new_k", "new_v"))
    k2, v2 = caches(target, 2, 2)
    add("verify.b2.c64", tree_verify, {"target": target}, {"ctx": CTX},
        (torch.randint(0, V, (2, T), generator=g), buf.depth, buf.ancestor_mask.unsqueeze(0),
         torch.tensor([12, 40]), k2, v2),
        ("tree_tokens", "depth", "tree_mask", "root_pos", *kv), ("logits", "hidden", "new_k", "new_v"))
    dk, dv = caches(draft, 1, 3)
    add("draft_chain.b1.c64", _draft_chain, {"draft": draft}, {"k": K, "ctx": CTX},
        (torch.randint(0, V, (1, K + 1), generator=g), torch.tensor([2]), torch.tensor([10]), dk, dv,
         *sampling(1), torch.rand(1, K, generator=g)),
        ("catch_tokens", "n_catch", "draft_len", *kv, "temperature", "top_k", "top_p", "uniforms"),
        ("tree_tokens", "catch_k", "catch_v"))
    # A 63-node template: Inductor turns its index buffers into package constants (not model weights).
    add("draft_tree.b1.c64", draft_static_tree, {"draft": draft}, {"template": tree, "ctx": CTX},
        (torch.randint(0, V, (1, tree.max_depth + 1), generator=g), torch.tensor([3]), torch.tensor([20]), dk, dv),
        ("catch_tokens", "n_catch", "draft_len", *kv), ("tree_tokens", "catch_k", "catch_v"))
    add("accept_exact.b1", accept_exact, {}, {},
        (torch.randint(0, V, (1, K + 1), generator=g), torch.randn(1, K + 1, V, generator=g),
         get_template(None, K).buffers().paths.unsqueeze(0), torch.rand(1, K + 1, generator=g), *sampling(1)),
        ("tree_tokens", "target_logits", "paths", "uniforms", "temperature", "top_k", "top_p"),
        ("num_accepted", "tokens", "node_ids"))
    return {gd.key: gd for gd in graphs}


def assert_same(got, want, atol=1e-4):
    assert len(got) == len(want)
    for x, y in zip(got, want):
        assert x.shape == y.shape and x.dtype == y.dtype
        if x.is_floating_point():
            assert torch.allclose(x, y, atol=atol, rtol=1e-4), (x - y).abs().max()
        else:
            assert torch.equal(x, y)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Checkpoints, models, graphs and the artifact dir with every graph compiled (once per module)."""
    root = tmp_path_factory.mktemp("aoti")
    save_tiny("llama", root / "target", seed=0)
    save_tiny("llama", root / "draft", seed=1, num_hidden_layers=1)
    target, draft = models(root)
    graphs = build_graphs(target, draft)
    art = root / "art"
    backend = AotiBackend()
    fns, times = {}, {}
    for key, gd in graphs.items():
        t = time.perf_counter()
        fns[key] = backend.compile(gd, art)
        times[key] = time.perf_counter() - t
    print("\naoti compile seconds:", json.dumps({k: round(v, 1) for k, v in times.items()}))
    return dict(root=root, art=art, target=target, draft=draft, graphs=graphs, fns=fns, backend=backend)


def test_compiled_graphs_match_eager(built):
    for key, gd in built["graphs"].items():
        assert (built["art"] / f"{key}.pt2").is_file()
        assert_same(built["fns"][key](*gd.example_inputs), gd.eager(*gd.example_inputs))


def test_packages_hold_no_weights_and_share_the_live_parameters(built):
    art, graphs, target = built["art"], built["graphs"], built["target"]
    weight_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
    # The packages carry code, not a copy of the weights: no weight entries in the archive.
    import zipfile

    for key in graphs:
        names = zipfile.ZipFile(art / f"{key}.pt2").namelist()
        assert not any("weights" in n or n.endswith(".blob") for n in names), names
    # The model-free graph needs nothing from the model; the tree draft owns its index constants.
    assert all(not f.startswith("models.") for f in built["fns"]["accept_exact.b1"].constant_fqns())
    tree_fqns = built["fns"]["draft_tree.b1.c64"].constant_fqns()
    assert any(not f.startswith("models.") for f in tree_fqns) and "models.draft.output.weight" in tree_fqns

    # Two graphs loaded from disk share the model's parameters: an in-place update reaches both.
    backend = built["backend"]
    pre, dec = graphs["prefill.b1.c64"], graphs["decode.b1.c64"]
    fa, fb = backend.load(pre, art), backend.load(dec, art)
    assert set(fa.constant_fqns()) >= {n for n, _ in pre.module.named_parameters()}
    before = fa(*pre.example_inputs)[0], fb(*dec.example_inputs)[1]
    w = target.output.weight
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            w.mul_(2.0)
        after = fa(*pre.example_inputs)[0], fb(*dec.example_inputs)[1]
        for b, a in zip(before, after):
            assert torch.allclose(a, 2 * b, atol=1e-4)  # logits are linear in the head
        assert_same(fa(*pre.example_inputs), pre.eager(*pre.example_inputs))
        assert_same(fb(*dec.example_inputs), dec.eager(*dec.example_inputs))
    finally:
        with torch.no_grad():
            w.copy_(saved)
    assert_same(fa(*pre.example_inputs), pre.eager(*pre.example_inputs))
    print(f"\nweights {weight_bytes} bytes; packages:",
          {k: (art / f"{k}.pt2").stat().st_size for k in graphs})


def test_no_state_leaks_between_calls(built):
    """Graphs are pure: a second call with a changed cache sees only its own inputs (cf. the AOTI
    small-mutated-buffer bug, pytorch#165444, which needs state inside the package)."""
    # key -> an output that depends on the cache (logits, the drafted tokens)
    for key, dep in (("decode.b1.c64", 1), ("verify.b2.c64", 0), ("draft_chain.b1.c64", 0)):
        gd, fn = built["graphs"][key], built["fns"][key]
        first = tuple(t.clone() for t in gd.example_inputs)
        second = list(t.clone() for t in gd.example_inputs)
        ki = gd.input_names.index("k_cache")
        second[ki] = second[ki] + 0.5
        second[ki + 1] = second[ki + 1].flip(3).contiguous()
        outs = []
        for inputs in (first, second, first):
            snapshot = tuple(t.clone() for t in inputs)
            outs.append(fn(*inputs))
            assert_same(inputs, snapshot)  # inputs untouched
        # Checked after all calls: a later call neither changes nor reuses an earlier call's outputs.
        for inputs, out in zip((first, second, first), outs):
            assert_same(out, gd.eager(*inputs))
        assert not torch.allclose(outs[0][dep], outs[1][dep])


def test_rejects_inputs_outside_the_compiled_shapes(built):
    gd, fn = built["graphs"]["prefill.b1.c64"], built["fns"]["prefill.b1.c64"]
    tokens, *rest = gd.example_inputs
    with pytest.raises(ValueError, match="compiled for"):
        fn(tokens[:, :4], *rest)
    k, v = torch.cat([rest[2]] * 2, 1), torch.cat([rest[3]] * 2, 1)
    with pytest.raises(ValueError, match="compiled for"):  # right shape, wrong strides (a view of a batch-2 cache)
        fn(tokens, rest[0], rest[1], k[:, :1], v[:, :1])
    with pytest.raises(ValueError, match="takes 5 inputs"):
        fn(tokens)


def test_load_refuses_a_different_model_and_missing_files(built, tmp_path):
    import copy

    gd = built["graphs"]["prefill.b1.c64"]
    other = copy.deepcopy(built["target"])
    other.output.weight = torch.nn.Parameter(torch.zeros(V, 32))
    wrong = GraphDef(gd.key, GraphModule(prefill_chunk, {"target": other}, {"ctx": CTX}), gd.example_inputs,
                     gd.input_names, gd.output_names)
    with pytest.raises(ValueError, match="models.target.output.weight"):
        built["backend"].load(wrong, built["art"])
    with pytest.raises(FileNotFoundError, match="prefill.b1.c64.pt2"):
        built["backend"].load(gd, tmp_path)


def test_check_available_names_the_missing_compiler(monkeypatch):
    import specair.compile.backends.aoti as aoti

    monkeypatch.setattr(aoti.shutil, "which", lambda name: None)
    with pytest.raises(BackendUnavailable, match="C\\+\\+ compiler"):
        AotiBackend.check_available()
    assert set(AotiBackend().versions()) >= {"torch", "aoti_cpu"}


def test_loads_in_a_fresh_process_without_tracing_or_compiling(built):
    """A new process builds the model and graphs, with torch.export, every AOTI compile entry point and
    the C++ build itself patched to raise, loads every package and checks it against eager."""
    tests_dir = Path(__file__).resolve().parent
    script = textwrap.dedent(f"""
        import json, sys, time
        from pathlib import Path
        t0 = time.perf_counter()
        import torch, torch._inductor, torch._inductor.cpp_builder as cb
        build = cb.CppBuilder.build
        def forbidden(*a, **k):
            raise AssertionError("traced or compiled at load")
        torch.export.export = forbidden
        torch._inductor.aoti_compile_and_package = forbidden
        torch._inductor.aot_compile = forbidden
        torch.compile = forbidden
        cb.CppBuilder.build = forbidden
        sys.path.insert(0, {str(tests_dir)!r})
        import test_aoti_backend as t
        from specair.compile.backends.aoti import AotiBackend
        t_import = time.perf_counter() - t0
        target, draft = t.models(Path({str(built["root"])!r}))
        graphs = t.build_graphs(target, draft)
        backend, art, loads = AotiBackend(), Path({str(built["art"])!r}), {{}}
        for key, gd in graphs.items():
            s = time.perf_counter()
            fn = backend.load(gd, art)
            loads[key] = round(time.perf_counter() - s, 4)
            t.assert_same(fn(*gd.example_inputs), gd.eager(*gd.example_inputs))
            t.assert_same(fn(*gd.example_inputs), gd.eager(*gd.example_inputs))
        cb.CppBuilder.build = build  # the stock loader, for comparison: it may build its ISA probes
        s = time.perf_counter()
        torch._inductor.aoti_load_package(str(art / "prefill.b1.c64.pt2"))
        print(json.dumps({{"import_s": round(t_import, 2), "load_s": loads,
                          "aoti_load_package_s": round(time.perf_counter() - s, 3)}}))
    """)
    env = {**os.environ, "AOTI_RUNTIME_CHECK_INPUTS": "1"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print("\naoti fresh-process load:", report)
    assert set(report["load_s"]) == set(built["graphs"])
