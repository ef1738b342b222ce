"""specair's own onnxruntime kernels (compile/kernels): MatMulBlocks, CacheAttention and FilteredProbs are
row-independent (each output row is bitwise what that row computes alone, whatever the other rows hold), on
every instruction-set path this CPU has; MatMulBlocks reads every GGUF block format exactly as gguf dequantizes
it and computes those weights' product; FilteredProbs is
graphs/sampling.py's top-k/top-p distribution; and greedy speculation on the int4 path they serve equals plain
decoding on that path, token for token."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from specair.compile import kernels
from specair.compile.kernels import formats
from specair.compile.backends.onnx import _shared_thread_pool

ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

if not kernels.enabled():
    pytest.skip("specair's kernel library does not build here", allow_module_level=True)


def _session(nodes, inputs, outputs, inits=(), config=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(kernels.DOMAIN, 1)])
    so = ort.SessionOptions()
    for key, value in config:
        so.add_session_config_entry(key, value)
    so.register_custom_ops_library(str(kernels.library()))
    if _shared_thread_pool(2):  # the process's one pool, as the onnx backend runs its graphs
        so.use_per_session_threads = False
    else:
        so.intra_op_num_threads = 2
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


# The fp16 fields of each GGUF block (byte offsets): everything else in a block is codes and integer scales,
# any bytes of which are a valid block.
HALF_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
               "Q5_K": (0, 2), "Q6_K": (208,)}


def gguf_rows(name, N, K, seed=0):
    """N rows of K weights of GGUF format `name` as a file stores them: random bytes, with finite fp16 scales."""
    f = formats.FORMATS[name]
    rng = np.random.default_rng(seed)
    if name in formats.FLOAT_FORMATS:
        return rng.standard_normal((N, K)).astype(np.float16 if name == "F16" else np.float32).view(np.uint8)
    b = rng.integers(0, 256, (N, K // f.qk, f.nbytes), dtype=np.uint8)
    for o in HALF_FIELDS[name]:
        b[..., o:o + 2] = (rng.standard_normal((N, K // f.qk)) * 0.01).astype(np.float16)[..., None].view(np.uint8)
    return b.reshape(N, -1)


def blocks_session(w, M, config=()):
    inits = [numpy_helper.from_array(w.records, "r")] + ([] if w.super is None else [numpy_helper.from_array(w.super, "s")])
    node = helper.make_node(kernels.OP, ["x", "r"] + ([] if w.super is None else ["s"]), ["y"], domain=kernels.DOMAIN,
                            K=w.K, N=w.N, format=w.format)
    return _session([node], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [M, w.K])],
                    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [M, w.N])], inits, config)


def quantized_activations(x):
    """x as the kernel reads it: int8 per block of 32, scale amax/127, rounded to nearest even."""
    b = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(b).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
    return (np.clip(np.rint(b * inv), -127, 127) * (amax / np.float32(127))).reshape(x.shape).astype(np.float64)


def reference(w, x):
    """The product the kernel computes, in float64: the weights' scaled codes against the int8 activations, and
    the formats' block minima against the activations' float block sums."""
    full = kernels.dequantize(w).astype(np.float64)
    mins = np.zeros_like(full)
    if w.format in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):  # with every code 0, a block dequantizes to its minimum
        zero = dataclasses.replace(w, records=w.records.copy())
        zero.records[..., :formats.FORMATS[w.format].record - (64 if w.format in ("Q4_1", "Q5_1") else 32)] = 0
        mins = kernels.dequantize(zero).astype(np.float64)
    return quantized_activations(x) @ (full - mins).T + x.astype(np.float64) @ mins.T


def check_rows() -> str:
    """For every format: every row of M-row products equals its one-row product, bitwise, and is the product of
    the file's weights and the int8 activations; returns the path that ran."""
    for name in formats.FORMATS:
        for N, K in ((40, 256), (200, 1536)):  # N = 40 and 200: a partial last tile of columns
            w = formats.pack_gguf(name, gguf_rows(name, N, K), K)
            rng = np.random.default_rng(1)
            x = rng.standard_normal((16, K)).astype(np.float32)
            x[3] *= 1e4  # one row of large activations must not change the others' scales
            alone = blocks_session(w, 1)
            solo = np.concatenate([alone.run(None, {"x": x[r:r + 1]})[0] for r in range(16)])
            ref = x.astype(np.float64) @ kernels.dequantize(w).T.astype(np.float64) if name in formats.FLOAT_FORMATS \
                else reference(w, x)
            assert (np.abs(solo - ref).max(1) / np.abs(ref).max(1)).max() < 1e-5, (name, N, K)
            for M in (2, 5, 16):
                out = blocks_session(w, M).run(None, {"x": x[:M]})[0]
                assert np.array_equal(out, solo[:M]), (name, N, K, M)
    return kernels.isa()


@pytest.mark.parametrize("isa", ["native", "avx2", "portable"])
def test_block_rows_are_independent_on_every_path(isa):
    env = {**os.environ, **({} if isa == "native" else {"SPECAIR_ISA": isa})}
    code = "import test_kernels as t; print(t.check_rows())"
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=os.path.dirname(__file__), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    ran = r.stdout.split()[-1]
    assert ran == kernels.isa() if isa == "native" else ran in (isa, "portable", "avxvnni")


@pytest.mark.parametrize("name", sorted(formats.FORMATS))
def test_layout_holds_ggufs_own_dequantization(name):
    """Unpacked from the file's bytes and repacked, every weight is what gguf's own dequantization gives, bit for
    bit: nothing is re-rounded (a mixed-up bit or scale would change some)."""
    import gguf

    for N, K in ((40, 512), (3, 256)):
        raw = gguf_rows(name, N, K, seed=N)
        if name in formats.FLOAT_FORMATS:
            raw = raw.reshape(N, -1)
        want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name]).reshape(N, K)
        assert np.array_equal(kernels.dequantize(formats.pack_gguf(name, raw, K)), want), (N, K)


def extremes() -> str:
    """A digest of 8-row products at the integer sums' limits, every format: codes at their largest (and, for
    Q8_0, -128) against activations that quantize to +127 or -127, and random codes and activations beside them."""
    import hashlib

    h = hashlib.sha256()
    for name, f in formats.FORMATS.items():
        N, K = 48, 512
        raw = gguf_rows(name, N, K, seed=5)
        if name in formats.FLOAT_FORMATS:
            w = formats.pack_gguf(name, raw, K)
        else:
            u = formats.unpack(name, raw, K)
            u.codes[:N // 2] = 0x80 if name == "Q8_0" else (1 << f.bits) - 1
            u.codes[N // 2:N // 2 + 4] = 0x7F if name == "Q8_0" else 0
            w = formats.pack(name, u)
        x = np.ones((8, K), np.float32)
        x[1] = -1
        # Multiples of 1/64: a block's sum is exact in any order, so the paths' quantizers (the AVX-512 one sums
        # a block as a tree) agree too.
        x[2:] = np.random.default_rng(6).integers(-127, 128, (6, K)) / 64
        h.update(blocks_session(w, 8).run(None, {"x": x})[0].tobytes())
    return h.hexdigest()


def test_block_paths_agree_bitwise_at_the_integer_limits():
    """The integer block dot products are exact on every path (AVX2's int16 sums neither saturate nor wrap), and
    the float steps after them are the same, so every path gives the same bits."""
    digests = set()
    for isa in ("native", "avx2", "portable"):
        env = {**os.environ, **({} if isa == "native" else {"SPECAIR_ISA": isa})}
        r = subprocess.run([sys.executable, "-c", "import test_kernels as t; print(t.extremes())"], env=env,
                           cwd=os.path.dirname(__file__), capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        digests.add(r.stdout.split()[-1])
    assert len(digests) == 1


@pytest.mark.parametrize("name", sorted(formats.FORMATS))
def test_gather_blocks_looks_rows_up_as_gguf_dequantizes_them(name):
    """GatherBlocks (an embedding stored as blocks): each row is gguf's own dequantization of that row, bit for
    bit, for indices of any shape, negative ones counted from the end as Gather does; an index outside the
    table is refused."""
    N, K = 40, 256  # a partial last tile
    w = formats.pack_gguf(name, gguf_rows(name, N, K), K)
    full = kernels.dequantize(w)
    inputs = ["ids", "r"] + ([] if w.super is None else ["s"])
    inits = [numpy_helper.from_array(w.records, "r")] + ([] if w.super is None else [numpy_helper.from_array(w.super, "s")])
    node = helper.make_node(kernels.GATHER, inputs, ["y"], domain=kernels.DOMAIN, K=K, N=N, format=name)
    s = _session([node], [helper.make_tensor_value_info("ids", TensorProto.INT64, [None, None])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, None, K])], inits)
    ids = np.array([[0, 17, 39], [-1, 16, 5]], np.int64)
    got = s.run(None, {"ids": ids})[0]
    assert got.shape == (2, 3, K) and np.array_equal(got, full[ids % N])
    with pytest.raises(Exception, match="outside the table's 40 rows"):
        s.run(None, {"ids": np.array([[40]], np.int64)})


def test_a_product_has_the_same_bits_however_many_parts_it_splits_into():
    """specair.intra_op_threads sets how many contiguous parts a product splits into (0: small tasks taken in
    turn); each output column is one thread's work whatever the split, so the bits do not change."""
    w = formats.pack_gguf("Q4_K", gguf_rows("Q4_K", 200, 512), 512)
    x = np.random.default_rng(2).standard_normal((3, 512)).astype(np.float32)
    outs = [blocks_session(w, 3, [("specair.intra_op_threads", parts)]).run(None, {"x": x})[0]
            for parts in ("0", "1", "2", "3", "64")]
    assert all(np.array_equal(o, outs[0]) for o in outs[1:])
    assert np.array_equal(blocks_session(w, 3).run(None, {"x": x})[0], outs[0])
    with pytest.raises(Exception, match="specair.intra_op_threads must be a count of threads"):
        blocks_session(w, 3, [("specair.intra_op_threads", "two")])


def test_blocks_refuse_activations_of_another_width_and_a_short_layout():
    w = formats.pack_gguf("Q4_K", gguf_rows("Q4_K", 32, 256), 256)
    node = helper.make_node(kernels.OP, ["x", "r", "s"], ["y"], domain=kernels.DOMAIN, K=256, N=32, format="Q4_K")
    inits = [numpy_helper.from_array(w.records, "r"), numpy_helper.from_array(w.super, "s")]
    s = _session([node], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, None])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32])], inits)
    with pytest.raises(Exception, match=r"must be 256 \(K\)"):
        s.run(None, {"x": np.zeros((1, 288), np.float32)})
    s = _session([node], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 256])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32])],
                 [inits[0], numpy_helper.from_array(w.super[:1], "s")])
    with pytest.raises(Exception, match="super-block parameters"):
        s.run(None, {"x": np.zeros((1, 256), np.float32)})


def attention_session(B, T, H, Hkv, D, S, bias: bool):
    f = lambda name, shape, t=TensorProto.FLOAT: helper.make_tensor_value_info(name, t, shape)  # noqa: E731
    ins = [f("q", [B, T, H * D]), f("k", [B, T, Hkv * D]), f("v", [B, T, Hkv * D]), f("kc", [B, Hkv, S, D]),
           f("vc", [B, Hkv, S, D]), f("lens", [B], TensorProto.INT32), f("total", [], TensorProto.INT32)]
    if bias:
        ins.append(f("bias", [1, 1, T, S]))
    node = helper.make_node(kernels.ATTENTION, [i.name for i in ins], ["out", "kp", "vp"], domain=kernels.DOMAIN,
                            num_heads=H, kv_num_heads=Hkv, scale=D ** -0.5)
    return _session([node], ins, [f("out", [B, T, H * D]), f("kp", [B, Hkv, S, D]), f("vp", [B, Hkv, S, D])])


def check_attention_rows(D: int) -> str:
    """A tree of 4 nodes (0 the root; 1 and 2 its children; 3 the child of 2) verified in one pass: each node's
    output equals, bitwise, decoding its path one token at a time over the committed cache, and both are
    softmax attention computed in float64 to float32 accuracy. Returns the path that ran."""
    H, Hkv, S, L, T = 6, 2, 48, 29, 4
    rng = np.random.default_rng(0)
    kc, vc = (rng.standard_normal((1, Hkv, S, D)).astype(np.float32) for _ in range(2))
    q, k, v = (rng.standard_normal((1, T, n * D)).astype(np.float32) * 2 for n in (H, Hkv, Hkv))
    parent = [-1, 0, 0, 2]
    paths = []
    for t in range(T):
        path, p = [], t
        while p >= 0:
            path.insert(0, p)
            p = parent[p]
        paths.append(path)
    bias = np.full((1, 1, T, S), np.finfo(np.float32).min, np.float32)
    bias[..., :L] = 0.0
    for t, path in enumerate(paths):
        bias[0, 0, t, [L + j for j in path]] = 0.0
    verify = attention_session(1, T, H, Hkv, D, S, bias=True).run(None, {
        "q": q, "k": k, "v": v, "kc": kc, "vc": vc, "lens": np.array([L + T - 1], np.int32),
        "total": np.array(S, np.int32), "bias": bias})[0]
    decode = attention_session(1, 1, H, Hkv, D, S, bias=False)
    for t, path in enumerate(paths):
        ck, cv = kc.copy(), vc.copy()
        for i, node in enumerate(path):
            step = {"q": q[:, node:node + 1], "k": k[:, node:node + 1], "v": v[:, node:node + 1], "kc": ck,
                    "vc": cv, "lens": np.array([L + i], np.int32), "total": np.array(S, np.int32)}
            out, ck, cv = decode.run(None, step)
        assert np.array_equal(out[0, 0], verify[0, t]), t
        keys = np.concatenate([kc[0, :, :L], k[0, path].reshape(len(path), Hkv, D).transpose(1, 0, 2)], 1)
        vals = np.concatenate([vc[0, :, :L], v[0, path].reshape(len(path), Hkv, D).transpose(1, 0, 2)], 1)
        for h in range(H):
            qh = q[0, t, h * D:(h + 1) * D].astype(np.float64)
            s = keys[h // (H // Hkv)].astype(np.float64) @ qh * D ** -0.5
            w = np.exp(s - s.max())
            ref = (w / w.sum()) @ vals[h // (H // Hkv)].astype(np.float64)
            np.testing.assert_allclose(verify[0, t, h * D:(h + 1) * D], ref, rtol=1e-5, atol=1e-5)
    return kernels.isa("attention")


@pytest.mark.parametrize("isa", ["native", "avx2", "portable"])
@pytest.mark.parametrize("D", [64, 40])
def test_a_verify_row_attends_exactly_as_the_decode_step_of_its_token(isa, D):
    env = {**os.environ, **({} if isa == "native" else {"SPECAIR_ISA": isa})}
    code = f"import test_kernels as t; print(t.check_attention_rows({D}))"
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=os.path.dirname(__file__), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    ran = r.stdout.split()[-1]
    assert ran == kernels.isa("attention") if isa == "native" else ran in (isa, "portable")


def test_attention_refuses_a_length_outside_the_cache():
    s = attention_session(1, 2, 2, 1, 16, 8, bias=False)
    z = lambda *shape: np.zeros(shape, np.float32)  # noqa: E731
    with pytest.raises(Exception, match="outside its cache"):
        s.run(None, {"q": z(1, 2, 32), "k": z(1, 2, 16), "v": z(1, 2, 16), "kc": z(1, 1, 8, 16),
                     "vc": z(1, 1, 8, 16), "lens": np.array([8], np.int32), "total": np.array(8, np.int32)})


def filter_session(shape):
    node = helper.make_node(kernels.FILTER, ["x", "k", "p"], ["y"], domain=kernels.DOMAIN)
    return _session([node], [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape),
                             helper.make_tensor_value_info("k", TensorProto.INT64, [shape[0]]),
                             helper.make_tensor_value_info("p", TensorProto.FLOAT, [shape[0]])],
                    [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)])


def filter_rows(V=3000):
    """Rows and filters that reach every branch: peaked and flat rows, top-k alone, top-p alone, both, a top-k
    past the vocabulary, and kept sets reaching far below the largest logit (the widening search: row 3 by
    top-p, row 6 by top-k)."""
    rng = np.random.default_rng(0)
    rows = [rng.normal(0, 3, V), rng.normal(0, 0.01, V), rng.normal(0, 3, V) + 30 * (rng.random(V) < 0.002),
            np.where(np.arange(V) == 7, 17.0, rng.normal(0, 0.1, V)), rng.normal(0, 1, V), rng.normal(0, 5, V),
            np.where(np.arange(V) < 3, 40.0, rng.normal(0, 1, V)), rng.normal(0, 2, V)]
    top_k = [0, 0, 40, 0, 2000, V + 5, 500, 1]
    top_p = [0.95, 0.5, 1.0, 0.9999, 0.9, 0.8, 0.999, 0.7]
    return np.stack(rows).astype(np.float32), np.array(top_k, np.int64), np.array(top_p, np.float32)


def exact_filter(x: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """graphs/sampling.py's filters for one row in float64: rank by logit (ties by id), top-k, then keep while
    the mass ranked before a token is below top_p (top_k <= 0 and top_p >= 1 disable them), renormalised."""
    V = len(x)
    order = np.lexsort((np.arange(V), -x.astype(np.float64)))
    e = np.exp(x[order].astype(np.float64) - x.max())
    n = top_k if 0 < top_k < V else V
    e[n:] = 0
    if top_p < 1:
        q = e / e.sum()
        e[(np.cumsum(q) - q) >= top_p] = 0
    out = np.zeros(V)
    out[order] = e / e.sum()
    return out


def test_filtered_probs_is_the_sorted_filters_distribution():
    """FilteredProbs keeps exactly the tokens the filters keep (sums in float64), with graphs/sampling.py's
    probabilities, for [B, V] and [B, T, V] (row b's filters on each of its T rows); each row's bits are that
    row's alone."""
    from specair.graphs.sampling import logits_to_probs

    x, k, p = filter_rows()
    B, V = x.shape
    ref = logits_to_probs(torch.from_numpy(x), torch.ones(B), torch.from_numpy(k), torch.from_numpy(p)).numpy()
    got = filter_session([B, V]).run(None, {"x": x, "k": k, "p": p})[0]
    for b in range(B):
        want = exact_filter(x[b], int(k[b]), float(p[b]))
        assert np.array_equal(got[b] > 0, want > 0), b
        np.testing.assert_allclose(got[b], want, rtol=1e-5, atol=1e-7)
    # The sort's float32 cumulative sum drops a few tokens whose probabilities are below 1e-5 (rows 2, 3).
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    assert np.count_nonzero(got[3]) > 100 and np.count_nonzero(got[2]) == 40 and np.count_nonzero(got[7]) == 1
    assert np.count_nonzero(got[6]) == 3
    one = filter_session([1, V])
    for b in range(B):
        alone = one.run(None, {"x": x[b:b + 1], "k": k[b:b + 1], "p": p[b:b + 1]})[0][0]
        assert np.array_equal(alone, got[b]), b
    xt = np.stack([x, x * 0.5, x - 3], axis=1)  # [B, 3, V]
    out = filter_session([B, 3, V]).run(None, {"x": xt, "k": k, "p": p})[0]
    assert np.array_equal(out[:, 0], got)
    ref_t = logits_to_probs(torch.from_numpy(xt), torch.ones(B), torch.from_numpy(k), torch.from_numpy(p)).numpy()
    np.testing.assert_allclose(out, ref_t, rtol=1e-5, atol=1e-5)


def test_filtered_probs_breaks_ties_by_token_id():
    x = np.zeros((2, 64), np.float32)
    x[:, [5, 9, 30]] = 4.0
    got = filter_session([2, 64]).run(None, {"x": x, "k": np.array([2, 0], np.int64),
                                             "p": np.array([1.0, 0.3], np.float32)})[0]
    assert np.flatnonzero(got[0]).tolist() == [5, 9] and np.allclose(got[0, [5, 9]], 0.5)
    assert np.flatnonzero(got[1]).tolist() == [5, 9]  # each of the three holds 0.24 of the mass


def test_filtered_probs_keeps_the_top_token_at_any_top_p():
    """A top_p below float32's range arrives as 0 or a subnormal: the top token alone stays (not an empty set),
    as in graphs/sampling.py's sort."""
    from specair.graphs.sampling import logits_to_probs

    x = np.random.default_rng(5).standard_normal((3, 300)).astype(np.float32)
    k, p = np.array([0, 7, 0], np.int64), np.array([0.0, 0.0, 1e-45], np.float32)
    got = filter_session([3, 300]).run(None, {"x": x, "k": k, "p": p})[0]
    ref = logits_to_probs(torch.from_numpy(x), torch.ones(3), torch.from_numpy(k), torch.from_numpy(p)).numpy()
    for b in range(3):
        assert np.flatnonzero(got[b]).tolist() == [int(x[b].argmax())] and got[b].max() == 1.0, b
        assert np.array_equal(ref[b], got[b]), b


def test_greedy_speculation_on_the_int4_path_equals_plain_decoding_there(tmp_path_factory):
    """A model whose weights are Q4_1 blocks (as the default model's are), on onnx int4 with specair's kernels:
    every proposer's greedy tokens equal plain decoding's on the same path, not merely up to near-ties."""
    from helpers import save_tiny, to_q4_1

    from specair.models.checkpoint import load_checkpoint
    from specair.models.llama import build_model, truncated
    from specair.runtime.build import engine_from_models, parse_spec
    from specair.runtime.llm import LLM
    from specair.runtime.params import SamplingParams

    path = tmp_path_factory.mktemp("tiny_q41")
    save_tiny("llama-tied", path)
    ckpt = load_checkpoint(path, progress=False)
    model = copy.deepcopy(build_model(ckpt.config, ckpt.state_dict))
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight.copy_(to_q4_1(mod.weight))
    prompts = [list(range(3, 30, 2)), [5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [40, 41, 42, 43, 44, 40, 41, 42]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    kw = dict(max_context=64, prefill_chunk=16, variants=("greedy",), backend="onnx", quantize="int4")
    plain = [r.token_ids for r in LLM.from_engine(engine_from_models(model, **kw)).generate(prompts, params)]
    for spec, draft in ((parse_spec({"method": "ngram", "num_speculative_tokens": 4}), None),
                        (parse_spec({"method": "layer_skip", "num_layers": 1,
                                                  "num_speculative_tokens": 3}), truncated(model, 1)),
                        (parse_spec({"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 2, "tree": "kary:2x2"}),
                         truncated(model, 1))):
        res = LLM.from_engine(engine_from_models(model, None, draft, spec, **kw)).generate(prompts, params)
        assert [r.token_ids for r in res] == plain, spec
        assert any(r.extra["spec"]["mean_accepted_length"] > 1 for r in res)  # it did speculate


def test_artifacts_name_the_kernels_only_when_they_use_them():
    """Artifacts built with the kernels refuse a process without them (or with other sources); artifacts built
    without them (the self-contained Atlas export, SPECAIR_KERNELS=onnxruntime) load with or without them."""
    from specair.compile.artifacts import version_problems, versions
    from specair.compile.backends.onnx import OnnxBackend

    with_kernels, without = OnnxBackend(2), OnnxBackend(2, self_contained=True)
    assert with_kernels.kernels and not without.kernels
    built_with, built_without = versions(with_kernels), versions(without)
    assert version_problems(with_kernels, built_with) == version_problems(with_kernels, built_without) == []
    assert version_problems(without, built_without) == []
    assert version_problems(without, built_with) == [
        f"they were built with specair_kernels {kernels.source_hash()}, which this process does not have"]
    assert "specair_kernels is" in version_problems(with_kernels, {**built_with, "specair_kernels": "0" * 16})[0]


if __name__ == "__main__":
    print(json.dumps(check_rows()))
