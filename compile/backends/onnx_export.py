"""Torch graphs to ONNX files (the onnx backend's export; `onnx.py` runs them).

Exporter. torch 2.13 still ships the legacy TorchScript exporter (`dynamo=False`, deprecated but kept);
specair uses it at opset 13 (OPSET): every documented CANN release takes opsets 9-13 (CANN >= 7 also
14-18), and edge LLM projects (ascend-llm, qwen-ascend-llm) export with 13. The dynamo exporter
implements opset 18 only (TORCHLIB_OPSET) and reaches lower opsets by best-effort version conversion, so
it is not used. A few lowerings are patched in for the duration of an export (`_symbolic_overrides`):
`tril`/`triu` without Trilu (opset 14; the model's causal mask uses `tril`), `cumsum` of bool (the stock
one emits an invalid CumSum on bool), `eye` via a float EyeLike (onnxruntime has no bool EyeLike),
`sort(stable=True)` (the stock one misreads `stable` as `out=`), and `expand` to the traced static shape
(the stock one mis-infers zero-size dims). No graph has dynamic axes. With specair's kernels, float32 top-k/top-p
filtering is captured as one `specair.ort::FilteredProbs` node (compile/kernels/sampling.h) instead of a sort
of the vocabulary per row (`filter_kernel`).

These graphs are exported without constant folding, so each weight keeps its parameter name
(`models.target.*`, `models.draft.*`) instead of turning into a folded, renamed copy, and each Linear's
`MatMul(x, Transpose(W))` is rewritten to `Gemm(x, W, transB=1)` (reshaped around), so no graph
transposes a weight at run time.

Atlas edge boards: `OnnxBackend(self_contained=True)` or `export_self_contained(graph, path)` writes one
`<key>.onnx` with the (constant-folded) weights embedded, under protobuf's 2 GB limit, for
`atc --framework=5 --model=<key>.onnx ...`; `specair.compile.onnx_ops.check_onnx` says whether ATC will
take it. Float32, float16 and float64 models export; bfloat16 has no numpy type.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from specair.compile import kernels
from specair.compile.backends.onnx_attention import fused_kernel
from specair.compile.graph_def import GraphDef
from specair.graphs.sampling import logits_to_probs, use_filter
from specair.models.errors import SpecairError
from specair.models.llama import rms_norm, swiglu, use_attention, use_rowwise

OPSET = 13
_MAX_PROTO = 2**31 - 1

_export_lock = threading.Lock()  # the exporter's symbolic registry is process-global


class OnnxExportError(SpecairError):
    """A graph could not be exported to ONNX (an op without a lowering at the chosen opset, ...)."""


_TORCH_OF_SCALAR = {"Float": torch.float32, "Double": torch.float64, "Half": torch.float16, "Long": torch.int64,
                    "Int": torch.int32, "Short": torch.int16, "Char": torch.int8, "Byte": torch.uint8,
                    "Bool": torch.bool}


def _tri_symbolic(upper: bool):
    from torch.onnx import symbolic_helper as sh

    def tri(g, self, diagonal, out=None):
        sizes = self.type().sizes()
        diag = sh._maybe_get_const(diagonal, "i")
        if sizes is None or any(s is None for s in sizes[-2:]) or not isinstance(diag, int):
            raise torch.onnx.errors.SymbolicValueError(
                "tril/triu below opset 14 needs a static shape and diagonal", self)
        R, C = sizes[-2], sizes[-1]
        ones = torch.ones(R, C, dtype=torch.bool)
        mask = g.op("Constant", value_t=ones.triu(diag) if upper else ones.tril(diag))
        scalar = self.type().scalarType()
        if scalar == "Bool":
            return g.op("And", self, mask)
        zero = g.op("Constant", value_t=torch.zeros((), dtype=_TORCH_OF_SCALAR.get(scalar, torch.float32)))
        return g.op("Where", mask, self, zero)

    return tri


def _cumsum_symbolic(g, self, dim, dtype=None):
    from torch.onnx import symbolic_helper as sh

    axis = g.op("Constant", value_t=torch.tensor(sh._get_const(dim, "i", "dim"), dtype=torch.int64))
    target = None
    if dtype is not None and not sh._is_none(dtype):
        target = sh._get_const(dtype, "i", "dtype")
        target = sh.scalar_type_to_onnx[target] if isinstance(target, int) else None
    elif self.type().scalarType() in ("Bool", "Byte", "Char", "Short", "Int"):
        target = 7  # torch.cumsum of bool/integers accumulates in int64 (TensorProto.INT64 == 7)
    x = self if target is None else g.op("Cast", self, to_i=int(target))
    return g.op("CumSum", x, axis)


def _eye_symbolic(g, *args):
    """torch.eye as EyeLike on float zeros, then a Cast: onnxruntime's EyeLike has no bool kernel."""
    from torch.onnx import symbolic_helper as sh

    if len(args) == 5:
        n, m, dtype = args[0], args[0], args[1]
    elif len(args) == 6:
        n, m, dtype = args[0], args[1], args[2]
    else:
        return sh._unimplemented("aten::eye", f"with {len(args)} arguments")
    shape = g.op("Concat", sh._unsqueeze_helper(g, n, [0]), sh._unsqueeze_helper(g, m, [0]), axis_i=0)
    zeros = g.op("ConstantOfShape", g.op("Cast", shape, to_i=7), value_t=torch.zeros(1, dtype=torch.float32))
    eye = g.op("EyeLike", zeros)
    st = None if sh._is_none(dtype) else sh._maybe_get_const(dtype, "i")
    onnx_type = 1 if not isinstance(st, int) else int(sh.scalar_type_to_onnx[st])  # 1 = FLOAT
    return eye if onnx_type == 1 else g.op("Cast", eye, to_i=onnx_type)


def _sort_symbolic(g, self, *args):
    """aten::sort and its `stable=` overload (which the stock lowering misreads as an `out=` argument) as
    TopK over the whole axis; ONNX TopK breaks ties by lower index, which is what a stable sort does."""
    from torch.onnx import symbolic_helper as sh

    if len(args) == 3:  # sort.stable(self, *, stable, dim, descending)
        _, dim, descending = args
    elif len(args) == 2:  # sort(self, dim, descending)
        dim, descending = args
    else:
        return sh._unimplemented("aten::sort", f"with {len(args) + 1} arguments")
    dim = sh._get_const(dim, "i", "dim")
    descending = bool(sh._get_const(descending, "b", "descending"))
    k = g.op("Gather", g.op("Shape", self), g.op("Constant", value_t=torch.tensor([dim], dtype=torch.int64)))
    return g.op("TopK", self, k, axis_i=dim, largest_i=int(descending), sorted_i=1, outputs=2)


def _expand_symbolic(g, self, size, implicit):
    """Expand to the traced (static) output shape. The stock lowering turns -1 into 1 and leans on
    broadcasting, and the exporter's shape inference then gets zero-size dims wrong (an [F, 0] mask
    expanded with -1 came out one column wide, and a later `size(-1)` baked that in)."""
    from torch.onnx._internal.torchscript_exporter import symbolic_opset9

    try:
        sizes = g.original_node.output().type().sizes()
    except Exception:  # noqa: BLE001 - incomplete type: no static shape recorded
        sizes = None
    if sizes is None or any(not isinstance(d, int) for d in sizes):
        return symbolic_opset9.expand(g, self, size, implicit)
    return g.op("Expand", self, g.op("Constant", value_t=torch.tensor(sizes, dtype=torch.int64)))


@contextlib.contextmanager
def _symbolic_overrides(opset: int) -> Iterator[None]:
    """Lowerings specair's graphs need beyond the stock TorchScript exporter, registered for one export."""
    regs = [("aten::cumsum", _cumsum_symbolic), ("aten::eye", _eye_symbolic), ("aten::sort", _sort_symbolic),
            ("aten::expand", _expand_symbolic)]
    if opset < 14:
        regs += [("aten::tril", _tri_symbolic(False)), ("aten::triu", _tri_symbolic(True))]
    for name, fn in regs:
        torch.onnx.register_custom_op_symbolic(name, fn, opset)
    try:
        yield
    finally:
        for name, _ in regs:
            torch.onnx.unregister_custom_op_symbolic(name, opset)


def _cache_slots(graph: GraphDef) -> int | None:
    """The slot count of the graph's KV caches (the `k_cache` input [L, B, Hkv, S, D]), or None without one."""
    for name, t in zip(graph.input_names, graph.example_inputs):
        if name == "k_cache" and t.dim() == 5:
            return int(t.shape[3])
    return None


class _FilteredProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:  # noqa: ARG004
        with use_filter(None):
            return logits_to_probs(x, torch.ones_like(top_p), top_k, top_p)

    @staticmethod
    def symbolic(g, x, top_k, top_p):
        out = g.op(f"{kernels.DOMAIN}::{kernels.FILTER}", x, top_k, top_p)
        out.setType(x.type())
        return out


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:  # noqa: ARG004
        return rms_norm(x, weight, eps)

    @staticmethod
    def symbolic(g, x, weight, eps):
        out = g.op(f"{kernels.DOMAIN}::{kernels.RMSNORM}", x, weight, epsilon_f=float(eps))
        out.setType(x.type())
        return out


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up: Tensor) -> Tensor:  # noqa: ARG004
        return swiglu(gate_up)

    @staticmethod
    def symbolic(g, gate_up):
        out = g.op(f"{kernels.DOMAIN}::{kernels.SWIGLU}", gate_up)
        sizes = gate_up.type().sizes()
        out.setType(gate_up.type().with_sizes(sizes[:-1] + [sizes[-1] // 2]) if sizes else gate_up.type())
        return out


class RowwiseKernels:
    """RMSNorm and SwiGLU as one specair.ort operator each (compile/kernels/rowwise.h), for `use_rowwise` while
    exporting graphs that run on specair's kernels; onnx_fusion folds them into the block products they feed."""

    @staticmethod
    def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return _RMSNorm.apply(x, weight, eps) if x.dtype == torch.float32 else rms_norm(x, weight, eps)

    @staticmethod
    def swiglu(gate_up: Tensor) -> Tensor:
        return _SwiGLU.apply(gate_up) if gate_up.dtype == torch.float32 else swiglu(gate_up)


def filter_kernel(x: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """The filter for `use_filter` while exporting graphs that run on specair's kernels."""
    return _FilteredProbs.apply(x, top_k, top_p)


@contextlib.contextmanager
def _shape_inference_without_weights() -> Iterator[None]:
    """torch's ONNX shape-type inference pass handed no weight values (the exporter's own lock is held)."""
    original = torch._C._jit_pass_onnx_graph_shape_type_inference

    def without_values(graph, params_dict, opset_version):  # noqa: ARG001
        return original(graph, {}, opset_version)

    torch._C._jit_pass_onnx_graph_shape_type_inference = without_values
    try:
        yield
    finally:
        torch._C._jit_pass_onnx_graph_shape_type_inference = original


def torch_export(graph: GraphDef, path: Path, opset: int, *, fold: bool, export_params: bool,
                  fuse_attention: bool = False, kernel_filter: bool = False, kernel_rowwise: bool = False) -> None:
    slots = _cache_slots(graph) if fuse_attention else None
    attention = use_attention(fused_kernel(slots)) if slots is not None else contextlib.nullcontext()
    sampling = use_filter(filter_kernel) if kernel_filter else contextlib.nullcontext()
    rowwise = use_rowwise(RowwiseKernels) if kernel_rowwise else contextlib.nullcontext()
    with _export_lock, _symbolic_overrides(opset), torch.no_grad(), warnings.catch_warnings(record=True) as caught, \
            attention, sampling, rowwise:
        warnings.simplefilter("always")  # recorded, not shown: the legacy exporter's deprecation notices
        try:
            if export_params:
                torch.onnx.export(
                    graph.module, tuple(graph.example_inputs), str(path), dynamo=False, opset_version=opset,
                    do_constant_folding=fold, export_params=True, input_names=list(graph.input_names),
                    output_names=list(graph.output_names), keep_initializers_as_inputs=False)
            else:
                # torch's ONNX shape inference copies every weight into a TensorProto for each node that reads
                # it (73 of 83 s of a 1.7B-parameter prefill graph's export here); a graph exported without its
                # weights runs it without their values (their shapes, static from the trace, are all it needs).
                with _shape_inference_without_weights():
                    torch.onnx.export(
                        graph.module, tuple(graph.example_inputs), str(path), dynamo=False, opset_version=opset,
                        do_constant_folding=fold, export_params=False, input_names=list(graph.input_names),
                        output_names=list(graph.output_names), keep_initializers_as_inputs=False)
        except Exception as e:  # re-raised readably (the original dumps the whole IR)
            first = str(e).split("\n", 1)[0][:400]
            raise OnnxExportError(f"ONNX export of graph {graph.key!r} (opset {opset}) failed: "
                                  f"{type(e).__name__}: {first}") from e
    # The tracer turned a tensor into a Python value: the file holds that one value, not the computation.
    host = [w for w in caught if issubclass(w.category, torch.jit.TracerWarning)
            and str(w.message).startswith("Converting a tensor to a Python")]
    if host:
        w = host[0]
        path.unlink(missing_ok=True)
        raise OnnxExportError(f"graph {graph.key!r} reads a tensor value on the host ({Path(w.filename).name}:"
                              f"{w.lineno}: {str(w.message).split('.')[0]}); a static graph must not (no .item(), "
                              "no data-dependent Python branch), or the export bakes in one example's value")


def export_self_contained(graph: GraphDef, path: str | os.PathLike, opset: int = OPSET) -> Path:
    """One ONNX file with the weights embedded (constant-folded, legacy exporter, static shapes), for
    `atc --framework=5` on Atlas boards or any runtime without specair. Must stay under 2 GB."""
    import onnx

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    unique = {t.data_ptr(): t for t in module_tensors(graph.module).values()}
    size = sum(t.numel() * t.element_size() for t in unique.values())
    if size >= _MAX_PROTO:
        raise OnnxExportError(f"graph {graph.key!r} has {size / 2**30:.1f} GiB of weights: a self-contained ONNX "
                              "file must stay under 2 GB (use the shared-weights export, or quantize first)")
    torch_export(graph, path, opset, fold=True, export_params=True)
    if path.stat().st_size < size:  # the exporter moved weights out of the file
        raise OnnxExportError(f"graph {graph.key!r}: the exporter did not embed the weights in {path}; "
                              "a self-contained file must stay under 2 GB")
    onnx.checker.check_model(str(path))
    return path


def module_tensors(module: torch.nn.Module) -> dict[str, Tensor]:
    """Every parameter and buffer under every name it has (tied weights appear under each)."""
    out = dict(module.named_parameters(remove_duplicate=False))
    out.update(module.named_buffers(remove_duplicate=False))
    return out


def _static_shape(vi) -> list[int] | None:
    dims = vi.type.tensor_type.shape.dim
    if not vi.type.tensor_type.HasField("shape") or any(not d.HasField("dim_value") for d in dims):
        return None
    return [d.dim_value for d in dims]


def linear_to_gemm(model, weights: set[str]) -> int:
    """MatMul(x, Transpose(W, perm=[1, 0])) with W a 2-D weight -> Gemm(x, W, transB=1), reshaping x to
    [-1, K] and the result back to x's leading dims + [N], so no weight is transposed at run time (ORT
    cannot fold a transpose of an initializer it is handed at load time). Returns how many it rewrote."""
    import onnx
    from onnx import helper

    g = model.graph
    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True).graph
    except Exception:  # noqa: BLE001 - fall back to the dims the exporter recorded
        inferred = g
    ranks, shapes = {}, {}
    for vi in list(inferred.value_info) + list(inferred.input) + list(inferred.output):
        if vi.type.tensor_type.HasField("shape"):
            ranks[vi.name] = len(vi.type.tensor_type.shape.dim)
            shapes[vi.name] = _static_shape(vi)
    producer = {o: n for n in g.node for o in n.output}
    consumers: dict[str, int] = {}
    for n in g.node:
        for i in n.input:
            consumers[i] = consumers.get(i, 0) + 1
    out_names = {o.name for o in g.output}
    new_nodes, dropped, count = [], set(), 0
    const = lambda name, vals: g.initializer.append(
        helper.make_tensor(name, onnx.TensorProto.INT64, [len(vals)], vals))
    for n in g.node:
        tr = producer.get(n.input[1]) if n.op_type == "MatMul" and not n.domain else None
        ok = (tr is not None and tr.op_type == "Transpose" and tr.input[0] in weights
              and [list(a.ints) for a in tr.attribute if a.name == "perm"] == [[1, 0]]
              and shapes.get(tr.input[0]) is not None and len(shapes[tr.input[0]]) == 2)
        if not ok:
            new_nodes.append(n)
            continue
        count += 1
        N, K = shapes[tr.input[0]]
        x, w, y = n.input[0], tr.input[0], n.output[0]
        base = f"{n.name or y}/gemm"
        if ranks.get(x) == 2:
            new_nodes.append(helper.make_node("Gemm", [x, w], [y], name=base, transB=1))
        else:
            const(f"{base}/k", [-1, K])
            out_shape = [f"{base}/out_shape"]
            shape_nodes = []
            if shapes.get(x) is not None:  # static: one constant target shape
                const(out_shape[0], shapes[x][:-1] + [N])
            else:  # dims unknown here (static at run time): x's leading dims + [N]
                const(f"{base}/n", [N])
                const(f"{base}/start", [0])
                const(f"{base}/end", [-1])
                shape_nodes = [
                    helper.make_node("Shape", [x], [f"{base}/x_shape"], name=f"{base}/shape"),
                    helper.make_node("Slice", [f"{base}/x_shape", f"{base}/start", f"{base}/end"], [f"{base}/lead"],
                                     name=f"{base}/lead"),
                    helper.make_node("Concat", [f"{base}/lead", f"{base}/n"], out_shape, name=f"{base}/concat", axis=0)]
            new_nodes += shape_nodes + [
                helper.make_node("Reshape", [x, f"{base}/k"], [f"{base}/x2d"], name=f"{base}/reshape_in"),
                helper.make_node("Gemm", [f"{base}/x2d", w], [f"{base}/y2d"], name=base, transB=1),
                helper.make_node("Reshape", [f"{base}/y2d", out_shape[0]], [y], name=f"{base}/reshape_out")]
        consumers[tr.output[0]] -= 1
        if consumers[tr.output[0]] == 0 and tr.output[0] not in out_names:
            dropped.add(id(tr))
    del g.node[:]
    g.node.extend(x for x in new_nodes if id(x) not in dropped)
    return count
