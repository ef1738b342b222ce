"""The onnx backend: every graph exported (legacy exporter, opset 13, static shapes) and run by onnxruntime
equals eager; weights are stored once per artifact directory and shared, zero-copy, by every session;
inputs (the KV caches above all) are bound by pointer, never copied; loading needs no exporter; and
`check_onnx` tells whether Ascend ATC will take a file."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import save_tiny

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from specair.compile import kernels
from specair.compile.backends import get_backend
from specair.compile.backends.base import BackendUnavailable
from specair.compile.backends.onnx import (
    WEIGHTS_FILE,
    WEIGHTS_INDEX,
    HugePageArena,
    OnnxArtifactError,
    OnnxBackend,
    OnnxExportError,
    export_self_contained,
)
from specair.compile.graph_def import GraphDef, GraphModule
from specair.compile.onnx_ops import check_onnx, main_check_onnx
from specair.graphs.acceptance import accept_exact, accept_greedy, accept_typical
from specair.graphs.draft import draft_chain, draft_static_tree, draft_topk_tree
from specair.graphs.steps import decode_step, prefill_chunk
from specair.graphs.tree import buffers_from_parents, get_template
from specair.graphs.verify import tree_verify, verify_and_accept
from specair.models.checkpoint import load_checkpoint
from specair.models.llama import Transformer, build_model, truncated

SLOTS, V = 192, 256
TREE = get_template("kary:2x2", 2)
K_CHAIN = 2
MODEL_KINDS = ["prefill", "decode", "verify", "verify_and_accept", "draft_chain", "draft_static_tree", "draft_topk_tree"]
ACCEPT_KINDS = ["accept_greedy", "accept_typical", "accept_exact", "buffers_from_parents"]


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_onnx")
    save_tiny("llama", path)
    return path


@pytest.fixture(scope="module")
def model(ckpt_dir):
    ckpt = load_checkpoint(ckpt_dir, progress=False)
    return build_model(ckpt.config, ckpt.state_dict)


@pytest.fixture(scope="module")
def backend():
    return OnnxBackend(threads=1)


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    return tmp_path_factory.mktemp("onnx_art")


def _draft_chain(draft, catch, n_catch, draft_len, k_cache, v_cache, temperature, top_k, top_p, uniforms, *, ctx):
    return draft_chain(draft, catch, n_catch, draft_len, k_cache, v_cache, K_CHAIN, temperature, top_k, top_p,
                       uniforms, ctx=ctx)


def _inputs(kind: str, B: int, model: Transformer | None, seed: int) -> tuple[torch.Tensor, ...]:
    """Fixed-shape inputs for one graph kind and batch, with values drawn from seed."""
    g = torch.Generator().manual_seed(seed)
    rows = lambda *vals: torch.tensor(vals[:B])  # per-row values, first B rows
    samp = (torch.tensor([0.0, 0.8])[:B], torch.tensor([0, 20])[:B], torch.tensor([1.0, 0.9])[:B])
    if model is not None:
        k, v = model.empty_cache(B, SLOTS)
        k.normal_(generator=g)
        v.normal_(generator=g)
    tok = lambda *shape: torch.randint(0, V, shape, generator=g)
    buf, T = TREE.buffers(), TREE.num_nodes
    if kind == "prefill":
        return tok(B, 16), rows(5, 40), rows(16, 9), k, v
    if kind == "decode":
        return tok(B), rows(5, 40), k, v, *samp, torch.rand(B, generator=g)
    if kind == "verify":
        return tok(B, T), buf.depth, buf.ancestor_mask.unsqueeze(0), rows(12, 60), k, v
    if kind == "verify_and_accept":  # what the runtime dispatches: deterministic tree, exact sampling
        return tok(B, T), rows(12, 60), k, v, torch.rand(B, TREE.max_depth + 1, generator=g), *samp
    if kind == "draft_chain":
        return tok(B, K_CHAIN + 1), rows(2, K_CHAIN + 1), rows(10, 50), k, v, *samp, torch.rand(B, K_CHAIN, generator=g)
    if kind == "draft_static_tree":
        return tok(B, TREE.max_depth + 1), rows(2, 3), rows(10, 50), k, v
    if kind == "draft_topk_tree":
        return tok(B, 3), rows(1, 3), rows(9, 30), k, v
    logits = torch.randn(B, T, V, generator=g)
    paths = buf.paths.expand(B, -1, -1).contiguous()
    if kind == "accept_greedy":
        return tok(B, T), logits, paths
    if kind == "accept_typical":
        return tok(B, T), logits, paths, *samp
    if kind == "accept_exact":
        return tok(B, T), logits, paths, torch.rand(B, TREE.max_depth + 1, generator=g), *samp
    if kind == "buffers_from_parents":
        parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 3], [-1, 0, 1, 2, 0, 0, 4]])[:B]
        return (parents,)
    raise AssertionError(kind)


def make_graph(kind: str, B: int, ctx: int | None, model: Transformer | None, seed: int = 0) -> GraphDef:
    fns = {
        "prefill": (prefill_chunk, "target", {"ctx": ctx}),
        "decode": (decode_step, "target", {"ctx": ctx}),
        "verify": (tree_verify, "target", {"ctx": ctx}),
        "draft_chain": (_draft_chain, "draft", {"ctx": ctx}),
        "draft_static_tree": (draft_static_tree, "draft", {"ctx": ctx, "template": TREE}),
        "draft_topk_tree": (draft_topk_tree, "draft", {"ctx": ctx, "depth": 3, "topk": 2, "num_nodes": 6}),
        "accept_greedy": (accept_greedy, None, {}),
        "accept_typical": (accept_typical, None, {}),
        "accept_exact": (accept_exact, None, {}),
        "buffers_from_parents": (buffers_from_parents, None, {"max_depth": 3, "max_width": 3}),
    }
    if kind == "verify_and_accept":
        static = {"ctx": ctx, "acceptance": "exact", "max_depth": TREE.max_depth, "max_width": TREE.max_width,
                  "tree": TREE.buffers()}
        names = ("tree_tokens", "root_pos", "k_cache", "v_cache", "uniforms", "temperature", "top_k", "top_p")
        module = GraphModule(verify_and_accept, {"target": model}, static, names)
        inputs = _inputs(kind, B, model, seed)
        return GraphDef(f"{kind}.b{B}.c{ctx}", module, inputs, names, tuple(f"out{i}" for i in range(6)))
    fn, role, static = fns[kind]
    module = GraphModule(fn, {role: model} if role else {}, static)
    inputs = _inputs(kind, B, model if role else None, seed)
    n_out = len(module(*inputs))
    key = f"{kind}.b{B}" + (f".c{ctx}" if ctx else "")
    # The caches carry the catalogue's names: the onnx backend fuses attention over inputs named k_cache.
    caches = iter(["k_cache", "v_cache"])
    names = tuple(next(caches) if role and t.dim() == 5 else f"in{i}" for i, t in enumerate(inputs))
    return GraphDef(key, module, inputs, names, tuple(f"out{i}" for i in range(n_out)))


def assert_same(got, want, atol=1e-4):
    assert len(got) == len(want)
    for x, y in zip(got, want):
        assert x.dtype == y.dtype and x.shape == y.shape
        if y.is_floating_point():
            assert torch.allclose(x, y, atol=atol, rtol=1e-4), (x - y).abs().max()
        else:
            assert torch.equal(x, y)


def run_and_compare(f, graph: GraphDef, seeds=(0, 1)):
    """Call the compiled graph on two input sets of the planned shapes (new data, new pointers)."""
    for seed in seeds:
        inputs = graph.example_inputs if seed == 0 else _inputs(
            graph.key.split(".")[0], graph.example_inputs[0].shape[0], _model_of(graph), seed)
        before = tuple(t.clone() for t in inputs)
        assert_same(f(*inputs), graph.eager(*inputs))
        assert_unchanged(graph, inputs, before)


# Per graph kind, the input holding each row's committed cache length.
COMMITTED = {"prefill": 1, "decode": 1, "verify": 3, "verify_and_accept": 1, "draft_chain": 2, "draft_chain_skip": 2,
             "draft_static_tree": 2, "draft_topk_tree": 2}


def assert_unchanged(graph: GraphDef, inputs, before):
    """No input changed, except cache slots past each row's committed length (fused attention writes the
    step's K/V there in place; nothing reads them before the runtime commits)."""
    kind = graph.key.split(".")[0]
    for name, t, b in zip(graph.input_names, inputs, before):
        if name in ("k_cache", "v_cache"):
            for row, n in enumerate(inputs[COMMITTED[kind]].tolist()):
                assert torch.equal(t[:, row, :, :n], b[:, row, :, :n]), f"{name} row {row} changed below {n}"
        else:
            assert torch.equal(t, b), f"input {name} was written"


def _model_of(graph: GraphDef):
    return next(iter(graph.module.models.values()), None)


# --------------------------------------------------------------------------------- graph == eager


@pytest.mark.parametrize("ctx", [64, 128])
@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_model_graphs_match_eager(model, backend, art, kind, B, ctx):
    graph = make_graph(kind, B, ctx, model)
    f = backend.compile(graph, art)
    onnx.checker.check_model(str(backend.path(graph, art)))
    run_and_compare(f, graph)


@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("kind", ACCEPT_KINDS)
def test_acceptance_graphs_match_eager(backend, art, kind, B):
    graph = make_graph(kind, B, None, None)
    f = backend.compile(graph, art)
    onnx.checker.check_model(str(backend.path(graph, art)))
    run_and_compare(f, graph)


def test_unused_inputs_are_dropped_and_still_accepted(model, backend, art):
    """decode with the greedy variant never reads the sampling inputs: the exporter drops them."""
    graph = make_graph("decode", 2, 64, model)
    graph = GraphDef("decode_greedy.b2.c64", GraphModule(decode_step, {"target": model},
                                                          {"ctx": 64, "variant": "greedy"}),
                     graph.example_inputs, graph.input_names, graph.output_names)
    f = backend.compile(graph, art)
    assert [name for _, name, *_ in f._inputs] == ["in0", "in1", "k_cache", "v_cache"]
    assert_same(f(*graph.example_inputs), graph.eager(*graph.example_inputs))


@pytest.mark.skipif(not kernels.enabled(), reason="specair's kernels do not build here")
def test_filtered_sampling_is_one_kernel_node_not_a_sort(model, backend, art):
    """With specair's kernels, top-k/top-p is captured as FilteredProbs: no graph sorts the vocabulary per row
    (the rows of test_model_graphs_match_eager's B=2 decode use both filters and match eager)."""
    graph = make_graph("decode", 2, 64, model)
    backend.compile(graph, art)
    ops = [(n.domain, n.op_type) for n in onnx.load(str(backend.path(graph, art)), load_external_data=False).graph.node]
    assert (kernels.DOMAIN, kernels.FILTER) in ops and ("", "TopK") not in ops

# ------------------------------------------------------------------------------- weights: once, shared


def test_weights_are_stored_once_per_artifact_dir(model, tmp_path):
    be = OnnxBackend(threads=1)
    be.compile(make_graph("prefill", 1, 64, model), tmp_path)
    size = (tmp_path / WEIGHTS_FILE).stat().st_size
    params = sum(t.numel() * t.element_size() for t in model.parameters())
    assert params <= size < params + 64 * 1024 + 2 * model.rope_cos.numel() * 4  # params + RoPE tables + padding
    be.compile(make_graph("verify", 2, 128, model), tmp_path)
    # A layer-skip draft shares the target's tensors under new names: aliases, no new bytes.
    draft = truncated(model, 1)
    g = make_graph("draft_chain", 1, 64, model)
    g = GraphDef("draft_chain_skip.b1.c64", GraphModule(_draft_chain, {"draft": draft}, {"ctx": 64}),
                 g.example_inputs, g.input_names, g.output_names)
    f = be.compile(g, tmp_path)
    run_and_compare(f, g, seeds=(0,))
    assert (tmp_path / WEIGHTS_FILE).stat().st_size == size
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.norm.weight.add_(1.0)
    with pytest.raises(OnnxArtifactError, match="one model pair"):
        be.compile(make_graph("prefill", 2, 64, other), tmp_path)
    index = json.loads((tmp_path / WEIGHTS_INDEX).read_text())["tensors"]
    assert index["models.draft.layers.0.attention.wqkv.weight"] == index["models.target.layers.0.attention.wqkv.weight"]
    for path in tmp_path.glob("*.onnx"):
        m = onnx.load(str(path), load_external_data=False)
        assert not [t.name for t in m.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL
                    and len(t.raw_data) > 1024], path  # no weights inside any graph file
        externals = [t for t in m.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
        locations = {e.value for t in externals for e in t.external_data if e.key == "location"}
        assert externals and locations == {WEIGHTS_FILE}
        # No weight is transposed at run time: Linear layers became Gemm(transB=1) on the stored weight.
        names = {t.name for t in externals}
        assert not [n for n in m.graph.node if n.op_type == "Transpose" and n.input[0] in names]
        onnx.checker.check_model(str(path))


def test_sessions_share_the_live_torch_weights(model, tmp_path):
    """Two sessions get the model's own parameter memory (no copy): an in-place change to a weight is
    seen by both without reloading."""
    m = copy.deepcopy(model)
    be = OnnxBackend(threads=1)
    g1, g2 = make_graph("verify", 1, 64, m), make_graph("decode", 1, 64, m)
    f1, f2 = be.compile(g1, tmp_path), be.compile(g2, tmp_path)
    w = m.layers[0].feed_forward.w2.weight
    shared = [v for (name, *_), v in be._shared.items() if name == "models.target.layers.0.feed_forward.w2.weight"]
    assert len(shared) == 1 and shared[0][2].data_ptr() == w.data_ptr()
    with torch.no_grad():
        w.mul_(3.0)
        m.norm.weight.add_(0.5)
    for f, g in ((f1, g1), (f2, g2)):
        assert_same(f(*g.example_inputs), g.eager(*g.example_inputs))


def test_load_without_torch_weights_reads_the_shared_file(model, tmp_path):
    be = OnnxBackend(threads=1)
    graph = make_graph("verify", 2, 64, model)
    be.compile(graph, tmp_path)
    with torch.device("meta"):
        ghost = Transformer(model.config)
    meta_graph = GraphDef(graph.key, GraphModule(tree_verify, {"target": ghost}, {"ctx": 64}),
                          graph.example_inputs, graph.input_names, graph.output_names)
    f = OnnxBackend(threads=1).load(meta_graph, tmp_path)
    assert_same(f(*graph.example_inputs), graph.eager(*graph.example_inputs))


@pytest.mark.parametrize("kind,B", [("decode", 1), ("decode", 2), ("prefill", 1), ("prefill", 2)])
def test_graphs_that_write_their_kv_in_place_return_none_for_it(model, backend, art, kind, B):
    """With the catalogue's output names, a fused graph whose new K/V the attention already wrote at
    slots cache_len.. returns None for them; the cache then holds eager's new K/V there. Graphs the fused
    op does not cover (several tokens in several rows) still return them."""
    g = make_graph(kind, B, 64, model)
    names = {"decode": ("next_tokens", "logits", "hidden", "new_k", "new_v"),
             "prefill": ("logits", "hidden", "new_k", "new_v")}[kind]
    graph = GraphDef(f"{kind}_named.b{B}.c64", g.module, g.example_inputs, g.input_names, names)
    f = backend.compile(graph, art)
    inputs = [t.clone() for t in graph.example_inputs]
    got, want = f(*inputs), graph.eager(*graph.example_inputs)
    k, v = inputs[graph.input_names.index("k_cache")], inputs[graph.input_names.index("v_cache")]
    written = kind == "decode" or B == 1
    for name, x, y in zip(names, got, want):
        if name in ("new_k", "new_v"):
            assert (x is None) == written
            if written:
                cache, T = (k if name == "new_k" else v), y.shape[3]
                for row, n in enumerate(inputs[1].tolist()):
                    assert torch.allclose(cache[:, row, :, n:n + T], y[:, row], atol=1e-4)
            else:
                assert_same((x,), (y,))
        else:
            assert_same((x,), (y,))


def test_attention_fuses_on_a_cache_of_the_models_whole_context(model, backend, art):
    """A cache of the model's whole context plus spare slots (a plan at the model's maximum context) still gets
    the fused kernel, whose RoPE table must cover the buffer and the step: no step copies the whole cache."""
    ctx = model.config.max_position_embeddings
    k, v = model.empty_cache(1, ctx + 128)
    k.normal_(generator=torch.Generator().manual_seed(0))
    inputs = (torch.tensor([7]), torch.tensor([ctx - 1]), k, v, torch.zeros(1), torch.zeros(1, dtype=torch.long),
              torch.ones(1), torch.rand(1))
    names = ("tokens", "cache_len", "k_cache", "v_cache", "temperature", "top_k", "top_p", "uniform")
    module = GraphModule(decode_step, {"target": model}, {"ctx": ctx}, names)
    graph = GraphDef(f"decode_whole.b1.c{ctx}", module, inputs, names,
                     ("next_tokens", "logits", "hidden", "new_k", "new_v"))
    want = graph.eager(*inputs)
    got = backend.compile(graph, art)(*[t.clone() for t in inputs])
    assert got[3] is None and got[4] is None  # written into the cache in place by GroupQueryAttention
    assert_same(got[:3], want[:3])


@pytest.mark.parametrize("B", [1, 2])
def test_chain_verify_writes_its_kv_in_place(model, backend, art, B):
    """A chain's verify returns every node's K/V at its own slot; fused (one row) it returns None for them
    and the cache holds them there. On the accepted prefix that is what the tree-masked verify returns."""
    chain = get_template("chain", 3).buffers()
    static = {"ctx": 64, "acceptance": "greedy", "max_depth": 3, "max_width": 1, "tree": chain}
    names = ("tree_tokens", "root_pos", "k_cache", "v_cache")
    outs = ("num_accepted", "tokens", "node_ids", "path_hidden", "path_k", "path_v")
    g = torch.Generator().manual_seed(3)
    k, v = model.empty_cache(B, SLOTS)
    k.normal_(generator=g)
    v.normal_(generator=g)
    root = torch.tensor([12, 40][:B])
    tokens = torch.randint(0, V, (B, 4), generator=g)
    # Make the drafts the target's own greedy choices, so acceptance runs past the root.
    for i in range(1, 4):
        logits = tree_verify(model, tokens, torch.arange(4), chain.ancestor_mask.unsqueeze(0), root, k, v, 64).logits
        tokens[:, i] = logits[:, i - 1].argmax(-1)
    tokens[-1, 3] = (tokens[-1, 3] + 1) % V  # the last row rejects its last draft
    graph = GraphDef(f"verify_chain.b{B}.c64", GraphModule(verify_and_accept, {"target": model}, {**static, "chain": True},
                                                            names), (tokens, root, k, v), names, outs)
    f = backend.compile(graph, art)
    inputs = [t.clone() for t in graph.example_inputs]
    got, want = f(*inputs), graph.eager(*graph.example_inputs)
    masked = GraphModule(verify_and_accept, {"target": model}, static, names)(*graph.example_inputs)
    n_acc = want[0]
    assert n_acc.tolist() == masked[0].tolist() and n_acc[0] >= 1 and n_acc[-1] == 2
    assert_same(got[:4], want[:4])
    for j in (4, 5):
        slots = inputs[2 + j - 4]
        for row, (r, n) in enumerate(zip(root.tolist(), n_acc.tolist())):
            keep = slice(0, n + 1)
            assert torch.allclose(want[j][:, row, :, keep], masked[j][:, row, :, keep], atol=1e-5)
            written = got[j][:, row] if got[j] is not None else slots[:, row, :, r:r + 4]
            assert torch.allclose(written[:, :, keep], want[j][:, row, :, keep], atol=1e-4)
        assert (got[j] is None) == (B == 1)


# ----------------------------------------------------------------------------------- IO binding


def test_caches_are_bound_by_pointer_not_copied(model, backend, art):
    graph = make_graph("decode", 2, 128, model)
    f = backend.compile(graph, art)
    inputs = list(graph.example_inputs)
    k, v = inputs[2], inputs[3]
    assert_same(f(*inputs), graph.eager(*inputs))
    bound = dict(zip([name for _, name, *_ in f._inputs], f._bound))
    assert bound["k_cache"] == k.data_ptr() and bound["v_cache"] == v.data_ptr()
    # Write into the caches in place and call again with the same tensors: the binding is reused (no
    # rebind, nothing copied at bind time) and ORT reads the new values straight from torch's memory.
    with torch.no_grad():
        k[..., :64, :].mul_(-1.5)
        v[..., :64, :].add_(1.0)
    out = f(*inputs)
    assert dict(zip([name for _, name, *_ in f._inputs], f._bound))["k_cache"] == k.data_ptr()
    assert_same(out, graph.eager(*inputs))
    # Outputs are fresh tensors per call: a later call never overwrites an earlier result.
    again = f(*inputs)
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(out, again))


def test_inputs_are_checked(model, backend, art):
    graph = make_graph("verify", 2, 64, model)
    f = backend.compile(graph, art)
    inputs = list(graph.example_inputs)
    k = inputs[4]
    bad = list(inputs)
    bad[4] = k.transpose(3, 4).contiguous().transpose(3, 4)  # right shape, not contiguous
    with pytest.raises(ValueError, match="not contiguous"):
        f(*bad)
    bad[4] = k[..., :100, :].contiguous()
    with pytest.raises(ValueError, match="outside the plan"):
        f(*bad)
    bad[4] = k.double()
    with pytest.raises(ValueError, match="compiled for torch.float32"):
        f(*bad)
    with pytest.raises(TypeError, match="takes 6 inputs"):
        f(*inputs[:5])


# --------------------------------------------------------------------------- load: files only


LOAD_SCRIPT = """
import sys, torch
def forbidden(*a, **k):
    raise AssertionError("exporting or tracing at load time")
torch.onnx.export = forbidden
torch.jit.trace = forbidden
torch.export.export = forbidden
from specair.compile.backends.onnx import OnnxBackend
from specair.compile.graph_def import GraphDef, GraphModule
from specair.graphs.steps import prefill_chunk
from specair.models.checkpoint import load_checkpoint
from specair.models.llama import build_model
ckpt = load_checkpoint({ckpt!r}, progress=False)
model = build_model(ckpt.config, ckpt.state_dict)
inputs, expected = torch.load({data!r})
graph = GraphDef({key!r}, GraphModule(prefill_chunk, {{"target": model}}, {{"ctx": 64}}), tuple(inputs),
                 {names!r}, tuple(f"out{{i}}" for i in range(len(expected))))
out = OnnxBackend(threads=1).load(graph, {art!r})(*inputs)
for a, b in zip(out, expected):
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()
print("loaded-ok")
"""


def test_load_in_a_fresh_process_needs_no_exporter(model, ckpt_dir, tmp_path):
    graph = make_graph("prefill", 2, 64, model)
    OnnxBackend(threads=1).compile(graph, tmp_path / "art")
    torch.save((list(graph.example_inputs), list(graph.eager(*graph.example_inputs))), tmp_path / "io.pt")
    script = LOAD_SCRIPT.format(ckpt=str(ckpt_dir), data=str(tmp_path / "io.pt"), key=graph.key,
                                art=str(tmp_path / "art"), names=graph.input_names)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loaded-ok" in proc.stdout


def _host_branch(x):
    return x * 2 if x.sum() > 0 else x - 1  # a data-dependent Python branch: not a static graph


def test_a_host_read_in_a_graph_is_an_export_error(tmp_path):
    x = torch.ones(3)
    graph = GraphDef("host", GraphModule(_host_branch, {}, {}), (x,), ("x",), ("y",))
    with pytest.raises(OnnxExportError, match="reads a tensor value on the host"):
        OnnxBackend().compile(graph, tmp_path)
    assert not (tmp_path / "host.onnx").exists()


def test_missing_artifact_is_a_clear_error(model, tmp_path):
    with pytest.raises(OnnxArtifactError, match="compile the plan"):
        OnnxBackend().load(make_graph("prefill", 1, 64, model), tmp_path)


# --------------------------------------------------------------------- self-contained, ATC check

SELF_CONTAINED = [*MODEL_KINDS, *ACCEPT_KINDS]


@pytest.mark.parametrize("kind", SELF_CONTAINED)
def test_self_contained_export_is_atc_ready(model, tmp_path, kind):
    graph = make_graph(kind, 1, 64 if kind in MODEL_KINDS else None, model if kind in MODEL_KINDS else None)
    f = OnnxBackend(threads=1, self_contained=True).compile(graph, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{graph.key}.onnx"]  # one file, weights inside
    onnx.checker.check_model(str(tmp_path / f"{graph.key}.onnx"))
    run_and_compare(f, graph, seeds=(0,))
    assert check_onnx(tmp_path / f"{graph.key}.onnx") == []


def _tiny_onnx(path, nodes, inputs, outputs, opset=13, initializers=()):
    from onnx import helper

    model = helper.make_model(helper.make_graph(nodes, "t", inputs, outputs, list(initializers)),
                              opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 7
    onnx.save(model, str(path))
    return path


def test_check_onnx_reports_problems(model, backend, art, tmp_path, capsys):
    from onnx import TensorProto, helper

    good = export_self_contained(make_graph("verify", 1, 64, model), tmp_path / "good.onnx")
    assert check_onnx(good) == []
    # Dynamic dims.
    dyn = _tiny_onnx(tmp_path / "dyn.onnx", [helper.make_node("Relu", ["x"], ["y"])],
                     [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                     [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])])
    assert any("dynamic dims" in p and "'x'" in p for p in check_onnx(dyn))
    # External data: the shared-weights export is for onnxruntime, not ATC.
    shared = backend.path(make_graph("verify", 1, 64, model), art)
    if not shared.exists():
        backend.compile(make_graph("verify", 1, 64, model), art)
    problems = check_onnx(shared)
    assert any("external data" in p for p in problems)
    # ... with onnxruntime's fused attention and rotary, which ATC does not take either (nothing else is flagged).
    attention = "specair.ort::CacheAttention" if backend.kernels else "com.microsoft::GroupQueryAttention"
    assert any(attention in p for p in problems)
    assert any("com.microsoft::RotaryEmbedding" in p for p in problems)
    # specair.ort's domain is flagged too, and its row-wise operators (RMSNorm, SwiGLU)
    assert len(problems) == 4 + 3 * backend.kernels, problems
    # An operator outside CANN's list, a contrib-domain op, float64 and an opset outside 9-13.
    odd = _tiny_onnx(tmp_path / "odd.onnx",
                     [helper.make_node("Unique", ["x"], ["u"]),
                      helper.make_node("Cast", ["x"], ["y"], to=TensorProto.DOUBLE),
                      helper.make_node("FusedMatMul", ["x", "x"], ["z"], domain="com.microsoft")],
                     [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])],
                     [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [4, 4]),
                      helper.make_tensor_value_info("u", TensorProto.FLOAT, [4]),
                      helper.make_tensor_value_info("z", TensorProto.FLOAT, [4, 4])], opset=17)
    problems = check_onnx(odd)
    assert any("operator Unique" in p for p in problems)
    assert any("com.microsoft::FusedMatMul" in p for p in problems)
    assert any("float64" in p for p in problems)
    assert any("opset 17" in p for p in problems)
    assert check_onnx(odd, opsets=(9, 18)) != [] and not any("opset" in p for p in check_onnx(odd, opsets=(9, 18)))
    # The CLI hook: exit code and one line per problem.
    capsys.readouterr()
    assert main_check_onnx([str(good)]) == 0
    assert capsys.readouterr().out == ""
    assert main_check_onnx([str(good), str(dyn), str(tmp_path / "nope.onnx")]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines and all(line.startswith((str(dyn), str(tmp_path / "nope.onnx"))) for line in lines)


# ------------------------------------------------------------------------------- availability


def test_check_available_names_the_missing_package(monkeypatch):
    OnnxBackend.check_available()
    assert get_backend("onnx", threads=1).name == "onnx"
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # makes `import onnxruntime` fail
    with pytest.raises(BackendUnavailable, match="onnxruntime"):
        OnnxBackend.check_available()
    with pytest.raises(BackendUnavailable, match="pip install onnxruntime"):
        get_backend("onnx")


def test_versions_name_the_onnx_stack():
    v = OnnxBackend().versions()
    assert v["onnx"] == onnx.__version__ and v["onnxruntime"] == ort.__version__
    assert "torch" in v


def test_a_new_build_replaces_the_weights_of_an_old_one(model, tmp_path):
    be = OnnxBackend(threads=1)
    be.compile(make_graph("prefill", 1, 64, model), tmp_path)
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.norm.weight.add_(1.0)
    be.begin(tmp_path, loading=False)  # what `specair compile` does before building into a directory
    graph = make_graph("prefill", 1, 64, other)
    run_and_compare(be.compile(graph, tmp_path), graph, seeds=(0,))
    with torch.device("meta"):  # from the file alone: the new weights
        ghost = Transformer(model.config)
    meta = GraphDef(graph.key, GraphModule(prefill_chunk, {"target": ghost}, {"ctx": 64}), graph.example_inputs,
                    graph.input_names, graph.output_names)
    assert_same(OnnxBackend(threads=1).load(meta, tmp_path)(*graph.example_inputs), graph.eager(*graph.example_inputs))


def _anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


def test_weights_read_into_huge_pages_hold_the_files_bytes(tmp_path):
    """The arena returns the stored bytes, 64-byte aligned, packed into a chunk that starts on a 2 MiB boundary,
    and (where the kernel grants huge pages on madvise) backed by them."""
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 255, 3 << 20, dtype=np.uint8), rng.standard_normal((100, 7)).astype(np.float32)
    path = tmp_path / "w.bin"
    path.write_bytes(b"x" * 64 + a.tobytes() + b.tobytes())
    arena = HugePageArena(chunk=8 << 20)
    ra = arena.read(path, 64, np.uint8, a.shape)
    rb = arena.read(path, 64 + a.nbytes, np.float32, b.shape)
    np.testing.assert_array_equal(ra, a)
    np.testing.assert_array_equal(rb, b)
    assert ra.ctypes.data % (2 << 20) == 0 and rb.ctypes.data % 64 == 0
    assert rb.ctypes.data - ra.ctypes.data == a.nbytes  # packed: one huge page is not spent per tensor
    with pytest.raises(OnnxArtifactError, match="ends before"):
        arena.read(path, 64, np.uint8, (a.nbytes + b.nbytes + 1,))
    thp = Path("/sys/kernel/mm/transparent_hugepage")
    settings = [(thp / f).read_text() if (thp / f).exists() else "" for f in ("enabled", "defrag")]
    if "[never]" in settings[0] or not any(f"[{d}]" in settings[1] for d in ("always", "madvise", "defer+madvise")):
        pytest.skip(f"this kernel does not grant huge pages on madvise (THP: {settings})")
    assert _anon_huge_kb(ra.ctypes.data) >= 2048


def test_qwen3_head_norms_fold_into_attention(tmp_path):
    """Qwen3's per-head q/k RMSNorm, between the projection and RoPE, runs inside specair's attention with
    RoPE (no Split, RotaryEmbedding or q/k RMSNorm node left), and a decode step still computes
    what eager PyTorch does."""
    if not kernels.enabled():
        pytest.skip("specair's kernels do not build here")
    save_tiny("qwen3", tmp_path / "m")
    ckpt = load_checkpoint(tmp_path / "m", progress=False)
    qwen3 = build_model(ckpt.config, ckpt.state_dict)
    assert qwen3.layers[0].attention.q_norm is not None
    ctx = 64
    k, v = qwen3.empty_cache(1, ctx)
    k.normal_(generator=torch.Generator().manual_seed(0))
    v.normal_(generator=torch.Generator().manual_seed(1))
    names = ("tokens", "cache_len", "k_cache", "v_cache", "temperature", "top_k", "top_p", "uniform")
    module = GraphModule(decode_step, {"target": qwen3}, {"ctx": ctx}, names)
    backend = OnnxBackend(threads=1)
    for pos in (0, 37):
        inputs = (torch.tensor([7 + pos]), torch.tensor([pos]), k, v, torch.zeros(1), torch.zeros(1, dtype=torch.long),
                  torch.ones(1), torch.rand(1))
        graph = GraphDef(f"decode.b1.c{ctx}", module, inputs, names, ("next_tokens", "logits", "hidden", "new_k", "new_v"))
        want = graph.eager(*inputs)
        got = backend.compile(graph, tmp_path / "art")(*[t.clone() for t in inputs])
        assert got[3] is None and got[4] is None  # written into the cache in place
        assert_same(got[:3], want[:3])
    proto = onnx.load(str(backend.path(graph, tmp_path / "art")), load_external_data=False)
    attention = [n for n in proto.graph.node if n.op_type == kernels.ATTENTION]
    ops = [n.op_type for n in proto.graph.node]
    assert len(attention) == len(qwen3.layers)
    assert all(len(n.input) == 13 and n.input[11].endswith("q_norm.weight")
               and n.input[12].endswith("k_norm.weight") for n in attention)
    assert "RotaryEmbedding" not in ops and "Split" not in ops
    assert not [n for n in proto.graph.node if n.op_type == kernels.RMSNORM
                and n.input[1].endswith(("q_norm.weight", "k_norm.weight"))]
