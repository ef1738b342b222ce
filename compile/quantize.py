"""Weight-only quantization of an exported graph's linear layers, with onnxruntime's own tools.

Every linear layer of an exported graph is `MatMul(x, Transpose(W, perm=[1, 0]))` with W a module weight
[N, K] and x of any rank (the LM head is one, tied or not). A scheme replaces each of them by the operator
onnxruntime's quantization tool emits for it, which takes x as it is (no reshape to 2-D around it), and
nothing else changes: embeddings
(Gather) keep the float table, so a tied LM head gets a quantized copy of the table while the lookup reads
the float one. Each distinct weight is quantized once per process by running the tool on a one-MatMul
model of W^T; the tool's nodes and packed tensors are then spliced in place of every MatMul that reads W, in
every graph, under names derived from the weight's (`<weight>_Q4`, `<weight>_scales`, ...). Draft models,
layer-skip drafts, EAGLE heads (fc and layer) and MLPSpeculator heads are nn.Linear too and are quantized
the same way; Medusa's own residual blocks are one batched matmul over stacked [heads, H, H] weights, which
MatMulNBits (2-D weights only) cannot take, so they stay float (4 heads on SmolLM2: 1.3M weights, under 1%
of the model; their tied LM head is quantized).

Schemes (`SCHEMES`):

- `int4`: com.microsoft `MatMulNBits` from `MatMulNBitsQuantizer`, 4 bits, blocks of 32 along K,
  asymmetric (a scale and a 4-bit zero point per block, 5.125 bits per weight with fp32 scales), and
  accuracy_level 4. Asymmetric because that is GGUF Q4_1's shape: Q4_1 stores a scale and a minimum per
  block of 32 (w = d*q + m), Q4_0 a scale only (w = d*(q - 8)), the symmetric one. onnxruntime's zero point
  is an integer and its range always includes 0 (a block of [1, 2] is quantized over [0, 2]), so it is
  Q4_1 with the minimum rounded to a multiple of the scale: the grid shifts by up to half a step. Measured
  on SmolLM2-135M, whose linear weights come from a Q4_1 GGUF (an exact Q4_1 requantization reproduces
  every one of them; only the tied embedding table is not Q4_1 in that file): relative RMS weight error
  0.084 asymmetric, 0.090 symmetric, over every 2-D weight. So int4 here is a second rounding of those
  weights, where llama.cpp reads them as they are — unless a weight IS Q4_1 blocks: then (`q4_1_blocks`)
  its q, d and m are read back exactly from the loader's d*q + m and the layer computes the checkpoint's
  own weights as MatMulNBits(x; q, d, zero point 0) + (x @ E) @ m^T (E [K, K/32] sums each block), the
  minima's part in float
  (onnxruntime's float zero points would do it in one operator, but its CPU kernel runs them ~65x slower:
  134 ms against 2 ms for SmolLM2's LM head shape at one row, measured here). accuracy_level 4 makes MLAS quantize the activations to
  int8 per block and use integer dot products, which is what llama.cpp does on CPU for Q4_1 (activations as
  Q8_1); accuracy_level 0 (float activations) measured 3.6x slower on SmolLM2's LM head at batch 1 here.
  Where specair's own kernel builds (compile/kernels), every int4 layer runs it: Q4_1 blocks exactly, and
  other float weights rounded (`int4_format`) onto Q4_K's shape where K is a multiple of 256 (8-bit block
  scales and minima under float16 super-block scales: 4.625 bits per weight in the kernel's layout, and on
  Gaussian weights the same RMS error as Q4_1, 0.0784 against 0.0782 of the weights' RMS), else onto Q4_1
  blocks as llama.cpp quantizes to Q4_1 (a float minimum, not an integer zero point: SmolLM2's widths, 576
  and 960, are not multiples of 256), so that no layer of the path computes a row differently at M rows.
- `int8`: `MatMulNBits` again, 8 bits, blocks of 32, symmetric (GGUF Q8_0's shape: one scale per block of
  32), accuracy_level 4. onnxruntime's dynamic quantization (`quantize_dynamic`: DynamicQuantizeLinear +
  MatMulInteger, fused into DynamicQuantizeMatMul) was measured too and is faster (decode step ~10%,
  128-token prefill ~40%), but it quantizes the activations with ONE scale per call, over every row of the
  call: a token's logits then depend on the other tokens computed with it (measured: with one large
  activation in one row, no row of a [128, 576] x [576, 1536] product equals that row computed alone).
  That breaks what the engine guarantees (greedy speculative == greedy autoregressive, batched == alone),
  so it is not offered.
  MatMulNBits quantizes activations per row and block: every row was bit-identical at M = 1, 4, 16, 128.

onnxruntime must pre-pack these weights for speed (without it MatMulNBits dequantizes the whole matrix to
float on every call: ~700 ms instead of ~2 ms for SmolLM2's LM head), and its Python API has no shared
pre-packed weights container, so every session keeps its own packed copy of the weights it reads; the
quantized tensors themselves are stored once per artifact directory and handed to every session from one
copy in memory (see backends/onnx.py).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from specair.compile import kernels
from specair.compile.kernels import formats
from specair.compile.kernels.formats import PackedWeight
from specair.models.errors import InputError, SpecairError
from specair.models.checkpoint import GGUF_PARTS

QUANTIZE_CHOICES = ("none", "int4", "int8")
log = logging.getLogger("specair")
_PLACEHOLDER_X, _PLACEHOLDER_W, _PLACEHOLDER_Y = "x", "W", "y"
_CHUNK_BYTES = 1 << 30  # a bigger weight is quantized in chunks of output rows (protobuf caps a tensor at 2 GB)


class QuantizationError(SpecairError):
    """A graph could not be quantized as asked (a linear layer in a form the rewrite does not know, ...)."""


@dataclass(frozen=True)
class Quantization:
    """One weight-only quantization scheme; recorded in the artifact manifest (`to_json`)."""

    method: str  # "int4" | "int8": the --quantize name
    op: str  # the operator the linear layers become (com.microsoft MatMulNBits)
    bits: int
    block_size: int  # weights per scale, along K
    symmetric: bool  # False: a zero point per block too
    accuracy_level: int  # MatMulNBits' compute type (4: activations quantized to int8 per row and block)
    # Q4_1 blocks' operator: kernels.OP (specair's row-independent kernel) or "MatMulNBits" (+ float minima)
    kernel: str = "MatMulNBits"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def bytes_per_weight(self, K: int) -> float:
        """Bytes a linear layer's weight with K inputs takes as this scheme stores a float weight: the codes, and
        per block a scale and a zero point (MatMulNBits: float32 and 4 bits), or as specair's kernel lays out
        the block format it rounds onto (`int4_format`)."""
        if self.kernel != "MatMulNBits":
            return formats.FORMATS[int4_format(K)].bits_per_weight / 8
        return self.bits / 8 + (4 + (0 if self.symmetric else self.bits / 8)) / self.block_size


SCHEMES = {
    "int4": Quantization("int4", "MatMulNBits", 4, 32, symmetric=False, accuracy_level=4),
    "int8": Quantization("int8", "MatMulNBits", 8, 32, symmetric=True, accuracy_level=4),
}


def parse_quantize(name: str | None) -> Quantization | None:
    """The scheme for a --quantize value (None or "none": no quantization). int4 runs specair's own kernel
    where it builds here (else MatMulNBits, with a warning saying why)."""
    if name is None or name == "none":
        return None
    if name not in SCHEMES:
        raise InputError(f"unknown quantization {name!r}; choose one of {', '.join(QUANTIZE_CHOICES)}")
    q = SCHEMES[name]
    if q.bits == 4 and not q.symmetric and kernels.enabled():
        q = dataclasses.replace(q, kernel=kernels.OP)
    return q


@dataclass
class _Template:
    """The tool's output for one weight: nodes over the placeholders x, W<suffix>, y, and the new tensors."""

    nodes: list[Any]
    arrays: dict[str, np.ndarray]  # suffix (e.g. "_Q4") -> tensor
    opsets: dict[str, int]
    shared: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # full name -> tensor, any weight


def _one_matmul(wt: np.ndarray):
    from onnx import TensorProto, helper, numpy_helper

    K, N = wt.shape
    x = helper.make_tensor_value_info(_PLACEHOLDER_X, TensorProto.FLOAT, ["M", K])
    y = helper.make_tensor_value_info(_PLACEHOLDER_Y, TensorProto.FLOAT, ["M", N])
    node = helper.make_node("MatMul", [_PLACEHOLDER_X, _PLACEHOLDER_W], [_PLACEHOLDER_Y], name="linear")
    graph = helper.make_graph([node], "linear", [x], [y], [numpy_helper.from_array(wt, _PLACEHOLDER_W)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def _run_tool(q: Quantization, wt: np.ndarray):
    """The quantized one-MatMul model, as onnxruntime's MatMulNBitsQuantizer writes it."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    log = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = log.level
    log.setLevel(logging.WARNING)  # it logs every node it quantizes at INFO
    try:
        tool = MatMulNBitsQuantizer(_one_matmul(wt), bits=q.bits, block_size=q.block_size,
                                    is_symmetric=q.symmetric, accuracy_level=q.accuracy_level)
        tool.process()
        return tool.model.model
    finally:
        log.setLevel(level)


def _q4_1_rounding(w: Tensor, block: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """w's blocks [N, K/block, block] in float64 and their rounding onto Q4_1 as llama.cpp quantizes to Q4_1
    (m the block's minimum, d its range / 15, q the nearest step): (blocks, q, d, m)."""
    b = w.detach().to(torch.float64).reshape(w.shape[0], -1, block)
    m = b.amin(-1)
    d = (b.amax(-1) - m) / 15
    safe = torch.where(d > 0, d, torch.ones_like(d))
    return b, ((b - m[..., None]) / safe[..., None]).round().clamp(0, 15), d, m


def _as_arrays(qs: Tensor, d: Tensor, m: Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # d and m in float16, as GGUF stores them (and llama.cpp rounds them after choosing q)
    return qs.to(torch.uint8).reshape(qs.shape[0], -1).numpy(), d.half().numpy(), m.half().numpy()


_ROUND_ROWS = 4096  # rows rounded at a time: the rounding works in float64 (2 GiB for a 151936 x 2048 table)


def q4_1_blocks(w: Tensor, block: int = 32) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """If every block of `block` weights along K is exactly d*q + m with q in 0..15 (a GGUF Q4_1 block, as
    the loader dequantized it from float16 d and m, up to float32's rounding of d*q + m), return q [N, K]
    uint8, d and m [N, K/block] float16; else None (known from the first rows that are not, a chunk at a time)."""
    if w.shape[1] % block:
        return None
    qs, ds, ms = [], [], []
    for r0 in range(0, w.shape[0], _ROUND_ROWS):
        b, q, d, m = _q4_1_rounding(w[r0:r0 + _ROUND_ROWS], block)
        err = (q * d[..., None] + m[..., None] - b).abs()
        if not bool((err <= 4 * torch.finfo(torch.float32).eps * (m.abs() + 15 * d)[..., None]).all()):
            return None
        for out, a in zip((qs, ds, ms), _as_arrays(q, d, m)):
            out.append(a)
    return np.concatenate(qs), np.concatenate(ds), np.concatenate(ms)


def round_to_q4_1(w: Tensor, block: int = 32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w rounded onto Q4_1 blocks as llama.cpp quantizes to Q4_1: q [N, K] uint8, d and m [N, K/block]
    float16."""
    parts = [_as_arrays(*_q4_1_rounding(w[r0:r0 + _ROUND_ROWS], block)[1:])
             for r0 in range(0, w.shape[0], _ROUND_ROWS)]
    return tuple(np.concatenate(a) for a in zip(*parts))  # type: ignore[return-value]


def int4_format(K: int) -> str:
    """The block format int4 rounds a float weight with K inputs onto, on specair's kernel: Q4_K's shape where
    K is a multiple of 256 (4.625 bits per weight as the kernel lays it out), else Q4_1 (5 bits)."""
    return "Q4_K" if K % (formats.BLOCK * formats.SUPER) == 0 else "Q4_1"


def _half_at_least(x: Tensor) -> Tensor:
    """The smallest float16 >= x (x >= 0, finite in float16): a super-block scale that no block's scale exceeds
    255 times."""
    h = x.to(torch.float16)
    bits = h.view(torch.int16) + (h.to(x.dtype) < x).to(torch.int16)  # the next float16 up (x >= 0)
    return bits.view(torch.float16)


def _ratio_or_zero(a: Tensor, b: Tensor) -> Tensor:
    """a / b, and 0 where b is 0 (an all-zero block or super-block)."""
    return torch.where(b > 0, a / torch.where(b > 0, b, 1), 0)


def round_to_q4_k(w: Tensor) -> formats.Unpacked:
    """w [N, K] (K a multiple of 256) rounded onto Q4_K's shape: per super-block of 256, float16 d and dmin; per
    block of 32, a scale s and a minimum m in 0..255; w = d*s*q - dmin*m with q in 0..15. GGUF's Q4_K keeps s
    and m in 6 bits; the kernel's layout gives each a byte, so the finer steps cost nothing. Each block's range
    is its minimum (or 0, when the block lies above 0: Q4_K's minimum is subtracted) to its maximum; s is
    rounded up, so the range fits the 16 steps, and q is the nearest step."""
    N, K = w.shape
    if K % (formats.BLOCK * formats.SUPER):
        raise ValueError(f"Q4_K needs K to be a multiple of 256, got {K}")
    codes, scales, mins, ds, dmins = [], [], [], [], []
    for r0 in range(0, N, _ROUND_ROWS):
        b = w[r0:r0 + _ROUND_ROWS].detach().to(torch.float64)
        b = b.reshape(b.shape[0], K // 256, 8, 32)
        low = (-b.amin(-1)).clamp_min(0)
        span = (b.amax(-1) + low) / 15
        if not bool(torch.isfinite(span).all()) or float(span.max()) / 255 > 65504:
            raise QuantizationError("a weight too large for Q4_K's float16 scales cannot be rounded onto int4")
        d, dmin = _half_at_least(span.amax(-1) / 255), _half_at_least(low.amax(-1) / 255)
        d64, dmin64 = d.to(torch.float64)[..., None], dmin.to(torch.float64)[..., None]
        s = _ratio_or_zero(span, d64).ceil().clamp(0, 255)
        m = _ratio_or_zero(low, dmin64).round().clamp(0, 255)
        step, offset = (d64 * s)[..., None], (dmin64 * m)[..., None]
        q = _ratio_or_zero(b + offset, step).round().clamp(0, 15)
        n = b.shape[0]
        codes.append(q.to(torch.uint8).reshape(n, K).numpy())
        scales.append(s.to(torch.uint8).reshape(n, -1).numpy())
        mins.append(m.to(torch.uint8).reshape(n, -1).numpy())
        ds.append(d.numpy())
        dmins.append(dmin.numpy())
    return formats.Unpacked(np.concatenate(codes), [np.concatenate(scales), np.concatenate(mins)],
                            [np.concatenate(ds), np.concatenate(dmins)])


def int4_packed(w: Tensor) -> PackedWeight:
    """A float weight [N, K] rounded for specair's kernel (`int4_format`), in its layout."""
    if int4_format(w.shape[1]) == "Q4_K":
        return formats.pack("Q4_K", round_to_q4_k(w))
    return formats.from_q4_1(*round_to_q4_1(w))


def int4_values(w: Tensor) -> Tensor:
    """The float32 values specair's kernel holds for a float weight [N, K] (`int4_packed`), as its products
    compute them (scale times code, minus or plus the minimum)."""
    N, K = w.shape
    if int4_format(K) == "Q4_K":
        u = round_to_q4_k(w)
        codes = torch.from_numpy(u.codes).reshape(N, K // 256, 8, 32).float()
        d, dmin = (torch.from_numpy(a).float()[..., None] for a in u.sup)
        s, m = (torch.from_numpy(a).float().reshape(N, K // 256, 8) for a in u.block)
        return (codes * (d * s)[..., None] - (dmin * m)[..., None]).reshape(N, K)
    q, d, m = round_to_q4_1(w)
    blocks = torch.from_numpy(q).reshape(N, K // 32, 32).float() * torch.from_numpy(d).float()[..., None]
    return (blocks + torch.from_numpy(m).float()[..., None]).reshape(N, K)


def _blocks_template(parts: list[PackedWeight]) -> _Template:
    """y = x W^T on specair's block kernel (`specair.ort::MatMulBlocks`, compile/kernels), W read exactly in each
    part's format; a weight whose rows come in parts of different formats (a fused q/k/v or gate/up of a mixed
    GGUF, such as Q4_K_M) is one operator per part, concatenated along the output."""
    from onnx import helper

    X, W, Y = _PLACEHOLDER_X, _PLACEHOLDER_W, _PLACEHOLDER_Y
    nodes, arrays = [], {}
    for i, p in enumerate(parts):
        suffix = f"_{p.format.lower()}" + (f"_{i}" if len(parts) > 1 else "")
        inputs = [X, W + suffix]
        arrays[suffix] = p.records
        if p.super is not None:
            inputs.append(W + suffix + "_super")
            arrays[suffix + "_super"] = p.super
        nodes.append(helper.make_node(kernels.OP, inputs, [Y if len(parts) == 1 else f"part{i}"], name=f"blocks{i}",
                                      domain=kernels.DOMAIN, K=p.K, N=p.N, format=p.format))
    if len(parts) > 1:
        nodes.append(helper.make_node("Concat", [f"part{i}" for i in range(len(parts))], [Y], name="concat", axis=-1))
    return _Template(nodes, arrays, {kernels.DOMAIN: 1})


def _packed_parts(w: Tensor) -> list[PackedWeight] | None:
    """A module weight's rows as the checkpoint stores them (`gguf_parts`, set by the loader for GGUF files),
    packed for the kernel with consecutive parts of one format together; None for a weight without them."""
    parts = getattr(w, GGUF_PARTS, None)
    if not parts:
        return None
    groups: list[list[Any]] = []
    for part in parts:
        if groups and groups[-1][0].type == part.type:
            groups[-1].append(part)
        else:
            groups.append([part])
    return [_pack_stored(g[0].type, np.concatenate([p.raw for p in g]), g[0].shape[1]) for g in groups]


_NOTED: set[str] = set()


def _pack_stored(kind: str, raw: np.ndarray, K: int) -> PackedWeight:
    """Stored rows in the kernel's layout: as stored for its formats; other types (BF16, the IQ and Q2_K/Q3_K
    types, ...) dequantized exactly by gguf and run as float32, the nearest exact path, with a notice once."""
    if kind in formats.FORMATS:
        return formats.pack_gguf(kind, raw, K)
    import gguf

    if kind not in _NOTED and kind not in ("BF16", "F64"):
        _NOTED.add(kind)
        log.warning("specair: GGUF type %s is not read natively by specair's kernels: those weights run dequantized "
                    "to float32 (exact, %.1fx the bytes)", kind,
                    32 / (8 * gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][1]
                          / gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][0]))
    w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(raw.shape[0], K)
    return formats.pack_float(np.asarray(w, dtype=np.float32))


def _q4_1_template(q: Quantization, blocks: tuple[np.ndarray, np.ndarray, np.ndarray]) -> _Template:
    """y = x W^T for W = d*q + m per block, exactly: specair's block kernel where it builds, else MatMulNBits over
    (d, q) with zero points 0 plus the blocks' minima times the per-block sums of x (two small float MatMuls that
    keep x's rank)."""
    from onnx import helper

    qs, d, m = blocks
    if q.kernel == kernels.OP:
        return _blocks_template([formats.from_q4_1(qs, d, m)])
    N, K = qs.shape
    X, W, Y = _PLACEHOLDER_X, _PLACEHOLDER_W, _PLACEHOLDER_Y
    nb = K // q.block_size
    packed = (qs[:, 0::2] | (qs[:, 1::2] << 4)).astype(np.uint8).reshape(N, nb, q.block_size // 2)
    zeros = np.zeros(N * ((nb + 1) // 2), dtype=np.uint8)
    sums = f"specair.block_sums.{K}x{q.block_size}"  # one per shape, shared by every weight of that K
    nodes = [
        helper.make_node("MatMulNBits", [X, W + "_Q4", W + "_scales", W + "_zero_points"], ["scaled"],
                         name="q4", domain="com.microsoft", K=K, N=N, bits=4, block_size=q.block_size,
                         accuracy_level=q.accuracy_level),
        helper.make_node("MatMul", [X, sums], ["block_sums"], name="block_sums"),
        helper.make_node("MatMul", ["block_sums", W + "_mins"], ["offsets"], name="mins"),
        helper.make_node("Add", ["scaled", "offsets"], [Y], name="y"),
    ]
    arrays = {"_Q4": packed, "_scales": d.reshape(-1).astype(np.float32), "_zero_points": zeros,
              "_mins": np.ascontiguousarray(m.T.astype(np.float32))}
    shared = {sums: np.kron(np.eye(nb, dtype=np.float32), np.ones((q.block_size, 1), np.float32))}
    return _Template(nodes, arrays, {"com.microsoft": 1}, shared)


def _template(q: Quantization, w: Tensor) -> _Template:
    from onnx import numpy_helper

    if q.kernel == kernels.OP:
        parts = _packed_parts(w)
        if parts is not None:
            return _blocks_template(parts)
    if q.bits == 4 and not q.symmetric and w.shape[1] % q.block_size == 0:
        blocks = q4_1_blocks(w, q.block_size)
        if blocks is not None:  # Q4_1 blocks already: read exactly, on either path
            return _q4_1_template(q, blocks)
        if q.kernel == kernels.OP:  # the tool's path requantizes other weights itself, below
            return _blocks_template([int4_packed(w)])
    w32 = w.detach().to(torch.float32)
    N, K = w32.shape
    rows = max(1, min(N, _CHUNK_BYTES // (4 * K)))
    parts: list[dict[str, np.ndarray]] = []
    nodes, opsets = None, None
    for n0 in range(0, N, rows):
        model = _run_tool(q, np.ascontiguousarray(w32[n0:n0 + rows].T.numpy()))
        g = model.graph
        arrays = {}
        for init in g.initializer:
            if not init.name.startswith(_PLACEHOLDER_W):
                raise QuantizationError(f"onnxruntime's quantizer produced an unexpected tensor {init.name!r}")
            arrays[init.name[len(_PLACEHOLDER_W):]] = numpy_helper.to_array(init)
        parts.append(arrays)
        nodes, opsets = list(g.node), {o.domain: o.version for o in model.opset_import}
    if not nodes or any(n.input and _PLACEHOLDER_W in n.input for n in nodes):
        raise QuantizationError(f"onnxruntime's {q.op} quantizer left a {N}x{K} weight unquantized")
    if len(parts) > 1:  # packed data, scales and zero points are all [N, ...]: chunks stack along N
        arrays = {s: np.concatenate([p[s] for p in parts], axis=0) for s in parts[0]}
        for node in nodes:
            for a in node.attribute:
                if a.name == "N":
                    a.i = N
    else:
        arrays = parts[0]
    return _Template(nodes, arrays, opsets)


def _version(t: Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter (they cannot change in place)
        return -1


class WeightQuantizer:
    """Rewrites exported graphs so that every linear layer reads quantized weights. Each distinct torch
    weight is quantized once per instance (graphs of one model pair share the result)."""

    def __init__(self, q: Quantization) -> None:
        self.q = q
        # (data_ptr, shape, dtype, version) -> (tensor kept alive so the pointer is not reused, template)
        self._done: dict[tuple, tuple[Tensor, _Template]] = {}

    def template(self, w: Tensor) -> _Template:
        key = (w.data_ptr(), tuple(w.shape), w.dtype, _version(w))
        if key not in self._done:
            self._done[key] = (w, _template(self.q, w))
        return self._done[key][1]

    def forget(self) -> None:
        """Drop every weight's result (and the reference to the weight it holds)."""
        self._done.clear()

    def _stored_table(self, n, tensors: dict[str, Tensor]) -> tuple[Any, dict[str, np.ndarray]] | None:
        """For a `Gather` of rows from a table stored as blocks of one format (a GGUF file's embedding), the
        `GatherBlocks` node that looks them up in the kernel's layout, sharing a tied LM head's arrays; else None."""
        from onnx import helper

        if n.op_type != "Gather" or n.domain or self.q.kernel != kernels.OP or n.input[0] not in tensors:
            return None
        w = tensors[n.input[0]]
        if w.dim() != 2 or not getattr(w, GGUF_PARTS, None) or any(a.name == "axis" and a.i for a in n.attribute):
            return None
        tpl = self.template(w)
        if len(tpl.nodes) != 1:  # rows in several formats: the float table stays
            return None
        blocks = tpl.nodes[0]
        weights = [n.input[0] + name[len(_PLACEHOLDER_W):] for name in blocks.input[1:]]
        attrs = {a.name: helper.get_attribute_value(a) for a in blocks.attribute}
        node = helper.make_node(kernels.GATHER, [n.input[1], *weights], list(n.output), name=f"{n.name}/blocks",
                                domain=kernels.DOMAIN, K=attrs["K"], N=attrs["N"], format=attrs["format"].decode())
        return node, {n.input[0] + s: a for s, a in tpl.arrays.items()}

    def rewrite(self, model, tensors: dict[str, Tensor]) -> dict[str, np.ndarray]:
        """Replace every `MatMul(x, Transpose(W, perm=[1, 0]))` reading a 2-D module weight by the quantized
        subgraph, and every lookup in a table stored as blocks by `GatherBlocks`; drop the transposes and weight
        inputs nothing reads any more. Returns the new tensors by initializer name."""
        from onnx import helper

        g = model.graph
        producer = {o: n for n in g.node for o in n.output}
        new_nodes, arrays, opsets = [], {}, {}
        for n in g.node:
            table = self._stored_table(n, tensors)
            if table is not None:
                new_nodes.append(table[0])
                arrays.update(table[1])
                opsets[kernels.DOMAIN] = 1
                continue
            tr = producer.get(n.input[1]) if n.op_type == "MatMul" and not n.domain else None
            w = tr.input[0] if tr is not None and tr.op_type == "Transpose" else None
            perm = [list(a.ints) for a in tr.attribute if a.name == "perm"] if w is not None else None
            if w is None or w not in tensors or tensors[w].dim() != 2 or perm != [[1, 0]]:
                new_nodes.append(n)
                continue
            if tensors[w].dtype not in (torch.float32,):
                raise QuantizationError(f"--quantize takes float32 models (weight {w} is {tensors[w].dtype})")
            tpl = self.template(tensors[w])
            prefix = f"{n.name or n.output[0]}/{self.q.method}"
            rename = {_PLACEHOLDER_X: n.input[0], _PLACEHOLDER_Y: n.output[0], "": ""}
            rename.update({_PLACEHOLDER_W + s: w + s for s in tpl.arrays})
            rename.update({name: name for name in tpl.shared})
            for t in tpl.nodes:
                c = type(t)()
                c.CopyFrom(t)
                c.name = f"{prefix}/{t.name}"
                for seq in (c.input, c.output):
                    for i, name in enumerate(seq):
                        seq[i] = rename.get(name, f"{prefix}/{name}")
                new_nodes.append(c)
            arrays.update({w + s: a for s, a in tpl.arrays.items()})
            arrays.update(tpl.shared)
            opsets.update(tpl.opsets)
        read = {i for x in new_nodes for i in x.input} | {o.name for o in g.output}
        del g.node[:]
        g.node.extend(x for x in new_nodes if x.op_type != "Transpose" or x.output[0] in read)
        have = {o.domain for o in model.opset_import}
        for domain, version in opsets.items():
            if domain not in have:
                model.opset_import.append(helper.make_opsetid(domain, version))
        read = {i for n in g.node for i in n.input}
        for vi in [vi for vi in g.input if vi.name in tensors and vi.name not in read]:
            g.input.remove(vi)
        transposed = {o: n.input[0] for n in g.node if n.op_type == "Transpose" for o in n.output}
        left = [w for n in g.node if n.op_type in ("Gemm", "MatMul") and len(n.input) > 1
                for w in [transposed.get(n.input[1], n.input[1])] if w in tensors and tensors[w].dim() >= 2]
        if left:
            raise QuantizationError(f"linear layers reading {sorted(set(left))[:3]} are not in the MatMul(x, "
                                    f"Transpose(W)) form the {self.q.method} rewrite knows; they would stay float")
        return arrays
