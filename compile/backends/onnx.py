"""ONNX: `torch.onnx.export` at static shapes, run by onnxruntime (CPU) with IO binding; Atlas boards via ATC.

Exporter. torch 2.13 still ships the legacy TorchScript exporter (`dynamo=False`, deprecated but kept);
specair uses it at opset 13 (OPSET): every documented CANN release takes opsets 9-13 (CANN >= 7 also
14-18), and edge LLM projects (ascend-llm, qwen-ascend-llm) export with 13. The dynamo exporter
implements opset 18 only (TORCHLIB_OPSET) and reaches lower opsets by best-effort version conversion, so
it is not used. A few lowerings are patched in for the duration of an export (`_symbolic_overrides`):
`tril`/`triu` without Trilu (opset 14; the model's causal mask uses `tril`), `cumsum` of bool (the stock
one emits an invalid CumSum on bool), `eye` via a float EyeLike (onnxruntime has no bool EyeLike),
`sort(stable=True)` (the stock one misreads `stable` as `out=`), and `expand` to the traced static shape
(the stock one mis-infers zero-size dims). No graph has dynamic axes.

Artifact directory (one per backend run, i.e. one model pair):

    <key>.onnx          one graph per bucket, without weights (~1 MB for a 30-layer model)
    onnx_weights.bin    every weight of every graph once (raw, 64-byte aligned), referenced by all graph
                        files as ONNX external data; one torch tensor under two names (tied weights, a
                        layer-skip draft) is stored once; big constants (RoPE tables) too, by content
    onnx_weights.json   its index: name -> offset, length, dtype, shape, sha256

These graphs are exported without constant folding, so each weight keeps its parameter name
(`models.target.*`, `models.draft.*`) instead of turning into a folded, renamed copy, and each Linear's
`MatMul(x, Transpose(W))` is rewritten to `Gemm(x, W, transB=1)` (reshaped around), so no graph
transposes a weight at run time.

Loading builds each InferenceSession from its file alone (no tracing, no export) and hands it the
weights with `SessionOptions.add_initializer(name, OrtValue)`, built zero-copy on the live torch
parameters of `graph.module` (`OrtValue.ortvalue_from_numpy(tensor.numpy())`, tensors kept alive by the
callable): all sessions of the process share the model's single copy, and onnx_weights.bin is not read
for them (SmolLM2-135M, 517 MB of weights: four sessions add ~120 MB in all). Tensors the module lacks
(quantized weights, lifted constants, or all of them for a module on the meta device) are read from
onnx_weights.bin once per backend and handed to every session the same way. ORT's GEMM pre-packing would
give every session its own packed copy of every weight (measured: four sessions +2.4 GB), so it is off;
`OnnxBackend(prepack=True)` buys faster GEMMs with that memory.

Weight-only quantization (`OnnxBackend(quantize="int4" | "int8")`, see compile/quantize.py): every linear
layer, the LM head included, becomes com.microsoft MatMulNBits (blocks of 32; int4 asymmetric like GGUF
Q4_1, int8 symmetric like Q8_0) while embeddings keep the float table. Each distinct weight is quantized
once per backend; the packed weights, scales and zero points are stored once in onnx_weights.bin (draft
graphs that name the target's tensors share them by content) and every session gets the same in-memory
copy. MatMulNBits is only fast pre-packed, so quantized sessions pre-pack, and each keeps its own packed
copy of what it reads (onnxruntime's Python API cannot share pre-packed weights between sessions). The
manifest records the scheme; artifacts of another scheme are refused.

Running: IO binding on torch memory. Each input is bound by pointer (`io_binding.bind_input(name, "cpu",
0, dtype, shape, tensor.data_ptr())`), so the KV caches, the biggest inputs, are never copied; a binding
whose pointer is unchanged since the last call is kept. Outputs are fresh torch tensors per call, bound
the same way (ORT writes into them). Inputs must be contiguous CPU tensors of the planned shape and dtype,
or the call raises saying which. Inputs a graph never reads are dropped by the exporter and ignored. One
call at a time per graph (a lock guards the binding).

Atlas edge boards: `OnnxBackend(self_contained=True)` or `export_self_contained(graph, path)` writes one
`<key>.onnx` with the (constant-folded) weights embedded, under protobuf's 2 GB limit, for
`atc --framework=5 --model=<key>.onnx ...`; `specair.compile.onnx_ops.check_onnx` says whether ATC will
take it. Float32, float16 and float64 models export; bfloat16 has no numpy type.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import warnings
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from specair.compile.backends.base import Backend, BackendUnavailable, CompiledGraph
from specair.compile.backends.onnx_attention import IN_PLACE, PRESENT, fused_kernel, lower_fused_attention
from specair.compile.graph_def import GraphDef
from specair.compile import kernels
from specair.compile.quantize import WeightQuantizer, parse_quantize
from specair.models.errors import InputError, SpecairError
from specair.models.llama import use_attention

OPSET = 13
WEIGHTS_FILE = "onnx_weights.bin"
WEIGHTS_INDEX = "onnx_weights.json"
_ALIGN = 64
_LIFT_BYTES = 1 << 16  # constants at least this big move to the shared weights file
_MAX_PROTO = 2**31 - 1

_export_lock = threading.Lock()  # the exporter's symbolic registry is process-global


class OnnxExportError(SpecairError):
    """A graph could not be exported to ONNX (an op without a lowering at the chosen opset, ...)."""


class OnnxArtifactError(SpecairError):
    """An ONNX artifact is missing or does not match the graph it is loaded for."""


def _missing_packages() -> list[str]:
    missing = []
    for pkg in ("onnx", "onnxruntime"):
        try:
            __import__(pkg)
        except ImportError:
            missing.append(pkg)
    return missing


# --------------------------------------------------------------------------------------------- export


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


def _torch_export(graph: GraphDef, path: Path, opset: int, *, fold: bool, export_params: bool,
                  fuse_attention: bool = False) -> None:
    slots = _cache_slots(graph) if fuse_attention else None
    kernel = use_attention(fused_kernel(slots)) if slots is not None else contextlib.nullcontext()
    with _export_lock, _symbolic_overrides(opset), torch.no_grad(), warnings.catch_warnings(record=True) as caught, \
            kernel:
        warnings.simplefilter("always")  # recorded, not shown: the legacy exporter's deprecation notices
        try:
            torch.onnx.export(
                graph.module, tuple(graph.example_inputs), str(path), dynamo=False, opset_version=opset,
                do_constant_folding=fold, export_params=export_params, input_names=list(graph.input_names),
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
    unique = {t.data_ptr(): t for t in _module_tensors(graph.module).values()}
    size = sum(t.numel() * t.element_size() for t in unique.values())
    if size >= _MAX_PROTO:
        raise OnnxExportError(f"graph {graph.key!r} has {size / 2**30:.1f} GiB of weights: a self-contained ONNX "
                              "file must stay under 2 GB (use the shared-weights export, or quantize first)")
    _torch_export(graph, path, opset, fold=True, export_params=True)
    if path.stat().st_size < size:  # the exporter moved weights out of the file
        raise OnnxExportError(f"graph {graph.key!r}: the exporter did not embed the weights in {path}; "
                              "a self-contained file must stay under 2 GB")
    onnx.checker.check_model(str(path))
    return path


def _module_tensors(module: torch.nn.Module) -> dict[str, Tensor]:
    """Every parameter and buffer under every name it has (tied weights appear under each)."""
    out = dict(module.named_parameters(remove_duplicate=False))
    out.update(module.named_buffers(remove_duplicate=False))
    return out


# ------------------------------------------------------------------------------------- weights store


def _numpy_dtype(dtype: torch.dtype):
    import numpy as np

    return np.dtype(str(dtype).removeprefix("torch.")) if dtype != torch.bfloat16 else None


def _numpy(t: Tensor):
    t = t.detach()
    if t.dtype == torch.bfloat16:
        raise OnnxExportError("the onnx backend takes float32/float16 models; bfloat16 has no numpy type")
    if t.device.type != "cpu":
        raise OnnxExportError(f"the onnx backend runs on CPU; got a tensor on {t.device}")
    return t.contiguous().numpy()


def _version(t: Tensor) -> int:
    """The in-place version counter (inference tensors have none: they cannot change in place outside
    inference mode, so -1)."""
    try:
        return t._version
    except RuntimeError:
        return -1


class _WeightStore:
    """onnx_weights.bin + onnx_weights.json in an artifact directory: append-only, one entry per tensor name;
    names of one torch tensor (or of equal bytes, dtype and shape) share one stored copy."""

    def __init__(self, art_dir: Path) -> None:
        self.bin, self.idx = art_dir / WEIGHTS_FILE, art_dir / WEIGHTS_INDEX
        self.entries: dict[str, dict[str, Any]] = {}
        if self.idx.exists():
            self.entries = json.loads(self.idx.read_text())["tensors"]
        self._by_content = {self._content_key(e): n for n, e in self.entries.items()}
        # name -> (tensor, version) stored or verified by this process; holding the tensor keeps its
        # data_ptr from being reused by another tensor, so (data_ptr, shape, dtype) identifies it.
        self._verified: dict[str, tuple[Tensor, int]] = {}
        self._by_ptr: dict[tuple, str] = {}
        self._dirty = False

    @staticmethod
    def _content_key(entry: dict[str, Any]) -> tuple:
        return entry["sha256"], entry["dtype"], tuple(entry["shape"])

    def add(self, name: str, tensor: Tensor | None = None, array=None) -> dict[str, Any]:
        """Store the tensor (or numpy array) under name unless it is stored already; its index entry.
        A name stored before with other contents is an error (one directory holds one model pair)."""
        import numpy as np

        ptr_key = None
        if tensor is not None:
            seen = self._verified.get(name)
            if seen is not None and seen[0] is tensor and seen[1] == _version(tensor):
                return self.entries[name]
            ptr_key = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype, _version(tensor))
            alias = self._by_ptr.get(ptr_key)
            if alias is not None and name not in self.entries:  # the same torch tensor under another name
                self.entries[name] = self.entries[alias]
                self._verified[name] = (tensor, _version(tensor))
                self._dirty = True
                return self.entries[name]
            array = _numpy(tensor)
        array = np.ascontiguousarray(array)
        entry = {"dtype": str(array.dtype), "shape": list(array.shape),
                 "sha256": hashlib.sha256(memoryview(array).cast("B")).hexdigest()}
        old = self.entries.get(name)
        if old is not None and self._content_key(old) != self._content_key(entry):
            raise OnnxArtifactError(f"{self.bin.parent}: tensor {name!r} differs from the one already stored there; "
                                    "one artifact directory holds one model pair: compile into a fresh directory")
        if old is None:
            same = self._by_content.get(self._content_key(entry))
            if same is not None:
                entry = self.entries[same]
            else:
                with open(self.bin, "ab") as f:
                    off = f.seek(0, os.SEEK_END)
                    pad = -off % _ALIGN
                    f.write(b"\0" * pad)
                    f.write(memoryview(array).cast("B"))
                entry.update(offset=off + pad, length=array.nbytes)
                self._by_content[self._content_key(entry)] = name
            self.entries[name] = entry
            self._dirty = True
        if tensor is not None:
            self._verified[name] = (tensor, _version(tensor))
            self._by_ptr[ptr_key] = name
        return self.entries[name]

    def flush(self) -> None:
        if self._dirty:
            tmp = self.idx.with_suffix(".tmp")
            tmp.write_text(json.dumps({"file": WEIGHTS_FILE, "tensors": self.entries}, indent=0))
            tmp.replace(self.idx)
            self._dirty = False


def _external_tensor(name: str, entry: dict[str, Any]):
    import numpy as np
    import onnx

    t = onnx.TensorProto()
    t.name = name
    t.data_type = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(entry["dtype"]))
    t.dims.extend(entry["shape"])
    t.data_location = onnx.TensorProto.EXTERNAL
    for k, v in (("location", WEIGHTS_FILE), ("offset", str(entry["offset"])), ("length", str(entry["length"]))):
        e = t.external_data.add()
        e.key, e.value = k, v
    return t


def _static_shape(vi) -> list[int] | None:
    dims = vi.type.tensor_type.shape.dim
    if not vi.type.tensor_type.HasField("shape") or any(not d.HasField("dim_value") for d in dims):
        return None
    return [d.dim_value for d in dims]


def _linear_to_gemm(model, weights: set[str]) -> int:
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


def _externalize(model, tensors: dict[str, Tensor], store: _WeightStore) -> None:
    """Weights (graph inputs named after module tensors, or embedded initializers) and big constants ->
    external-data initializers in the shared weights file."""
    import onnx
    from onnx import numpy_helper

    g = model.graph
    for vi in [vi for vi in g.input if vi.name in tensors]:
        g.input.remove(vi)
        g.initializer.append(_external_tensor(vi.name, store.add(vi.name, tensor=tensors[vi.name])))
    for i, init in enumerate(list(g.initializer)):
        if init.data_location == onnx.TensorProto.EXTERNAL:
            continue
        if init.name in tensors:
            g.initializer[i].CopyFrom(_external_tensor(init.name, store.add(init.name, tensor=tensors[init.name])))
        elif len(init.raw_data) >= _LIFT_BYTES:
            arr = numpy_helper.to_array(init)
            g.initializer[i].CopyFrom(_external_tensor(init.name, store.add(init.name, array=arr)))
    keep = []
    for node in g.node:
        value = next((a.t for a in node.attribute if a.name == "value"), None) if node.op_type == "Constant" else None
        if value is not None and not node.domain and len(value.raw_data) >= _LIFT_BYTES:
            arr = numpy_helper.to_array(value)
            # Named by content, shape and dtype: equal bytes in another shape (zeros, say) are another constant.
            h = hashlib.sha256(f"{arr.dtype}{arr.shape}".encode())
            h.update(memoryview(arr).cast("B"))
            name = "const." + h.hexdigest()[:20]
            entry = store.add(name, array=arr)
            g.initializer.append(_external_tensor(node.output[0], entry))
        else:
            keep.append(node)
    del g.node[:]
    g.node.extend(keep)


# ------------------------------------------------------------------------------------------- running


_NP_OF_ORT = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(double)": "float64",
              "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(int16)": "int16", "tensor(int8)": "int8",
              "tensor(uint8)": "uint8", "tensor(bool)": "bool"}
_TORCH_OF_NP = {"float32": torch.float32, "float16": torch.float16, "float64": torch.float64,
                "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
                "uint8": torch.uint8, "bool": torch.bool}


class OrtGraph:
    """A loaded graph: call it with the GraphDef's inputs, get its outputs as torch tensors."""

    def __init__(self, session, graph: GraphDef, keepalive: list[Any]) -> None:
        import numpy as np

        self.session, self.key = session, graph.key
        self._keepalive = keepalive  # session options and the OrtValues/tensors behind shared weights
        self._n_inputs = len(graph.input_names)
        metas = {m.name: m for m in session.get_inputs()}
        # (position, name, numpy dtype, torch dtype, planned shape, bound whole, per-layer bindings); unused
        # inputs were dropped. A cache that fused attention reads in place is also (or only) bound one layer
        # per input (`k_cache.<i>`, at the layer's offset), and again as the layer's in-place output.
        self._inputs = []
        layered: dict[int, list[tuple[str, int]]] = {}
        for name in metas:
            hit = _layer_input(name, graph.input_names)
            if hit is not None:
                layered.setdefault(graph.input_names.index(hit[0]), []).append((name, hit[1]))
        for pos, name in enumerate(graph.input_names):
            if name in metas or pos in layered:
                meta = metas[name] if name in metas else metas[layered[pos][0][0]]
                np_dt = _NP_OF_ORT[meta.type]
                self._inputs.append((pos, name, np.dtype(np_dt), _TORCH_OF_NP[np_dt],
                                     tuple(graph.example_inputs[pos].shape), name in metas, layered.get(pos, ())))
        self._outputs = []  # (name, numpy dtype, torch dtype, static shape or None)
        outs = {m.name: m for m in session.get_outputs()}
        # Outputs the export dropped because the graph writes them into the caller's cache (None to the caller).
        self._written = [i for i, name in enumerate(graph.output_names) if name not in outs and name in IN_PLACE]
        for name in graph.output_names:
            if name not in outs and name in IN_PLACE:
                continue
            m = outs[name]
            np_dt = _NP_OF_ORT[m.type]
            static = all(isinstance(d, int) and d >= 0 for d in m.shape)
            self._outputs.append((name, np.dtype(np_dt), _TORCH_OF_NP[np_dt], tuple(m.shape) if static else None))
        self._binding = session.io_binding()
        for name, *_ in self._outputs:  # first, so get_outputs() lists them before in-place cache outputs
            self._binding.bind_output(name, "cpu")
        self._bound: list[int | None] = [None] * len(self._inputs)
        self._lock = threading.Lock()

    def _check(self, name: str, t: Any, dtype: torch.dtype, shape: tuple) -> None:
        if not isinstance(t, Tensor):
            raise TypeError(f"onnx graph {self.key!r}: input {name!r} must be a torch tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise ValueError(f"onnx graph {self.key!r}: input {name!r} is on {t.device}; this backend binds CPU memory")
        if t.dtype != dtype:
            raise ValueError(f"onnx graph {self.key!r}: input {name!r} is {t.dtype}, "
                             f"the graph was compiled for {dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(f"onnx graph {self.key!r}: input {name!r} has shape {tuple(t.shape)}, the graph was "
                             f"compiled for {shape}; a shape outside the plan needs its own bucket")
        if not t.is_contiguous():
            raise ValueError(f"onnx graph {self.key!r}: input {name!r} is not contiguous; the backend binds tensor "
                             "memory directly and never copies it, so pass a contiguous tensor "
                             "(make the buffer contiguous once, outside the step loop)")

    def __call__(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        if len(inputs) != self._n_inputs:
            raise TypeError(f"onnx graph {self.key!r} takes {self._n_inputs} inputs, got {len(inputs)}")
        io = self._binding
        with self._lock:
            for i, (pos, name, np_dt, dt, shape, whole, layers) in enumerate(self._inputs):
                t = inputs[pos]
                self._check(name, t, dt, shape)
                ptr = t.data_ptr()
                if self._bound[i] != ptr:
                    if whole:
                        io.bind_input(name, "cpu", 0, np_dt, list(shape), ptr)
                    step = t.stride(0) * t.element_size()
                    for onnx_name, layer in layers:
                        io.bind_input(onnx_name, "cpu", 0, np_dt, list(shape[1:]), ptr + layer * step)
                        io.bind_output(onnx_name + PRESENT, "cpu", 0, np_dt, list(shape[1:]), ptr + layer * step)
                    self._bound[i] = ptr
            outs: list[Tensor | None] = []
            for name, np_dt, dt, shape in self._outputs:
                if shape is None:
                    io.bind_output(name, "cpu")
                    outs.append(None)
                else:
                    o = torch.empty(shape, dtype=dt)
                    io.bind_output(name, "cpu", 0, np_dt, list(shape), o.data_ptr())
                    outs.append(o)
            self.session.run_with_iobinding(io)
            if any(o is None for o in outs):
                values = io.get_outputs()
                outs = [torch.from_numpy(values[j].numpy()) if o is None else o for j, o in enumerate(outs)]
            # Drop references to this call's tensors; the pointers stay bound for the next call.
        for i in self._written:
            outs.insert(i, None)
        return tuple(outs)  # type: ignore[arg-type]


def _layer_input(name: str, input_names) -> tuple[str, int] | None:
    """(graph input, layer) for the per-layer cache input `<input>.<layer>` of fused attention, else None."""
    base, _, layer = name.rpartition(".")
    return (base, int(layer)) if layer.isdigit() and base in input_names else None


_pool_lock = threading.Lock()
_pool_threads: int | None = None  # the process-wide pool's size once made (0: onnxruntime's default); -1: none


def _shared_thread_pool(threads: int | None) -> bool:
    """Whether every session of this process runs on one intra-op thread pool (made on first use).

    The engine calls several sessions in turn each step (decode, verify, draft). With a pool per session,
    the threads of the one that just ran keep spinning on the cores while the next runs: measured here
    on 2 cores, an int4 decode step took 37 ms instead of 17 beside a verify session. One shared pool has
    no idle spinners. onnxruntime builds the pool with its environment, so the first backend of the
    process sizes it (before any session exists: code that made an onnxruntime session of its own first
    should make its backend earlier); later backends' thread counts do not resize it.
    """
    global _pool_threads
    with _pool_lock:
        if _pool_threads is None:
            from onnxruntime.capi import _pybind_state

            try:
                _pybind_state.set_global_thread_pool_sizes(int(threads or 0), 1)
                _pool_threads = int(threads or 0)
            except RuntimeError:
                _pool_threads = -1
        return _pool_threads >= 0


class OnnxBackend(Backend):
    name = "onnx"
    tensor_parallel = False
    tensor_parallel_why = "ONNX has no collective operators that onnxruntime's CPU provider runs"
    device = "cpu"
    optional_versions = frozenset({"specair_kernels"})

    def __init__(self, threads: int | None = None, *, self_contained: bool = False, opset: int = OPSET,
                 prepack: bool = False, providers: list[str] | None = None, quantize: str | None = None,
                 fuse_attention: bool | None = None) -> None:
        super().__init__(threads)
        self.self_contained, self.opset, self.prepack = self_contained, opset, prepack
        # onnxruntime's GroupQueryAttention (com.microsoft) in place of exported attention; not for ATC.
        self.fuse_attention = (not self_contained) if fuse_attention is None else fuse_attention
        # specair's row-independent kernels (compile/kernels) for fused attention and Q4_1 weights, where they build
        self.kernels = not self_contained and kernels.enabled()
        if self.fuse_attention and self_contained:
            raise InputError("fused attention writes onnxruntime's com.microsoft operators, which Ascend ATC does "
                             "not take: it applies to the shared-weights export, not to --self-contained")
        self.providers = providers or ["CPUExecutionProvider"]
        self.quantization = parse_quantize(quantize)  # recorded in the manifest; None: float weights
        if self.quantization is not None and self_contained:
            raise InputError(f"--quantize {quantize} writes onnxruntime's com.microsoft operators, which Ascend ATC "
                             "does not take: it applies to the shared-weights export, not to --self-contained")
        self._quantizer = WeightQuantizer(self.quantization) if self.quantization is not None else None
        self._shared_pool = _shared_thread_pool(threads)
        self._stores: dict[Path, _WeightStore] = {}
        self._shared: dict[tuple, Any] = {}  # (name, data_ptr) -> (tensor, array, OrtValue), shared by sessions
        # (weights file, offset, length) -> (array, OrtValue): stored tensors the module lacks (quantized
        # weights, lifted constants), in memory once and shared by every session that reads them
        self._stored: dict[tuple, tuple[Any, Any]] = {}

    @property
    def row_independent(self) -> bool:
        # specair's CacheAttention and MatMulQ4_1 on every linear layer (LM head included)
        return self.kernels and self.fuse_attention and getattr(self.quantization, "kernel", None) == kernels.OP

    @classmethod
    def check_available(cls) -> None:
        missing = _missing_packages()
        if missing:
            raise BackendUnavailable(f"the onnx backend needs the pip package{'s' if len(missing) > 1 else ''} "
                                     f"{' and '.join(missing)} (pip install {' '.join(missing)})")

    def versions(self) -> dict[str, str]:
        import onnx
        import onnxruntime

        extra = {"specair_kernels": kernels.source_hash()} if self.kernels else {}
        return {**super().versions(), "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__, **extra}

    def path(self, graph: GraphDef, art_dir: Path) -> Path:
        return Path(art_dir) / f"{graph.key}.onnx"

    def begin(self, art_dir: Path, loading: bool) -> None:
        """Before a full build: forget the weights of an earlier build in art_dir (its graphs are rewritten)."""
        if not loading:
            art_dir = Path(art_dir)
            self._stores.pop(art_dir, None)
            self._forget_stored(art_dir / WEIGHTS_FILE)
            for name in (WEIGHTS_FILE, WEIGHTS_INDEX):
                (art_dir / name).unlink(missing_ok=True)

    # ---------------------------------------------------------------------------------- compile

    def compile(self, graph: GraphDef, art_dir: Path) -> CompiledGraph:
        self.check_available()
        art_dir = Path(art_dir)
        art_dir.mkdir(parents=True, exist_ok=True)
        path = self.path(graph, art_dir)
        if self.self_contained:
            export_self_contained(graph, path, self.opset)
        else:
            self._export_shared(graph, art_dir, path)
        return self.load(graph, art_dir)

    def _export_shared(self, graph: GraphDef, art_dir: Path, path: Path) -> None:
        import onnx

        tmp = path.with_name(path.name + ".tmp")
        try:
            # Weights stay graph inputs (no data written, nothing folded into renamed copies).
            _torch_export(graph, tmp, self.opset, fold=False, export_params=False,
                          fuse_attention=self.fuse_attention)
            model = onnx.load(str(tmp))
        finally:
            tmp.unlink(missing_ok=True)
        lower_fused_attention(model, row_independent=self.kernels)
        tensors = _module_tensors(graph.module)
        quantized = self._quantizer.rewrite(model, tensors) if self._quantizer is not None else {}
        _linear_to_gemm(model, set(tensors))
        store = self._stores.get(art_dir)
        if store is None or (store.entries and not store.bin.exists()):  # first use, or the directory was wiped
            self._forget_stored(art_dir / WEIGHTS_FILE)
            store = self._stores[art_dir] = _WeightStore(art_dir)
        _externalize(model, tensors, store)
        for name, array in quantized.items():
            entry = store.add(name, array=array)
            model.graph.initializer.append(_external_tensor(name, entry))
            self._stored_value(store.bin, entry["offset"], entry["length"], lambda a=array: a)
        store.flush()
        leftover = [vi.name for vi in model.graph.input if vi.name not in graph.input_names
                    and _layer_input(vi.name, graph.input_names) is None]
        if leftover:
            raise OnnxExportError(f"graph {graph.key!r}: exported inputs {leftover} are neither graph inputs "
                                  "nor module tensors")
        onnx.save(model, str(path))
        onnx.checker.check_model(str(path))

    # ------------------------------------------------------------------------------------- load

    def _forget_stored(self, weights_file: Path) -> None:
        for key in [k for k in self._stored if k[0] == str(Path(weights_file).resolve())]:
            del self._stored[key]

    def _stored_value(self, weights_file: Path, offset: int, length: int, read):
        """The one OrtValue of a stored tensor (read() gives its array the first time it is asked for)."""
        import onnxruntime as ort

        key = (str(Path(weights_file).resolve()), int(offset), int(length))
        if key not in self._stored:
            arr = read()
            if arr.nbytes != length:
                raise OnnxArtifactError(f"{weights_file}: {length} bytes at offset {offset} do not hold the "
                                        f"{arr.dtype}{list(arr.shape)} tensor the graph names; recompile")
            self._stored[key] = (arr, ort.OrtValue.ortvalue_from_numpy(arr))
        return self._stored[key]

    def _shared_value(self, name: str, t: Tensor, keepalive: list[Any]):
        import onnxruntime as ort

        key = (name, t.data_ptr(), tuple(t.shape), t.dtype)
        if key not in self._shared:
            arr = _numpy(t)  # a view of the torch tensor (a copy only if it was not contiguous)
            self._shared[key] = (t, arr, ort.OrtValue.ortvalue_from_numpy(arr))
        keepalive.append(self._shared[key])
        return self._shared[key][2]

    def load(self, graph: GraphDef, art_dir: Path) -> CompiledGraph:
        self.check_available()
        import onnx
        import onnxruntime as ort

        path = self.path(graph, Path(art_dir))
        if not path.exists():
            raise OnnxArtifactError(f"{path} is missing: compile the plan with the onnx backend into {art_dir}")
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.log_severity_level = 3  # errors only: serving logs stay clean
        if self._shared_pool:
            so.use_per_session_threads = False
        else:
            if self.threads:
                so.intra_op_num_threads = self.threads
            # Per-session pools: a session's threads spin after its run and starve the next graph's.
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if self.kernels:
            so.register_custom_ops_library(str(kernels.library()))
        keepalive: list[Any] = [so]
        external = []
        if (Path(art_dir) / WEIGHTS_INDEX).exists():  # shared weights (a self-contained file needs no parse)
            proto = onnx.load(str(path), load_external_data=False)
            external = [t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
            del proto
        if external:
            # Quantized kernels need pre-packing (unpacked, MatMulNBits dequantizes all of W on every call);
            # a quantized graph has no float GEMM weights left for it to copy.
            if not self.prepack and self.quantization is None:
                so.add_session_config_entry("session.disable_prepacking", "1")
            tensors = _module_tensors(graph.module)
            for init in external:
                t = tensors.get(init.name)
                if t is None or t.device.type == "meta":
                    so.add_initializer(init.name, self._file_tensor(Path(art_dir), init, keepalive))
                    continue
                exported = (tuple(init.dims), onnx.helper.tensor_dtype_to_np_dtype(init.data_type))
                if exported != (tuple(t.shape), _numpy_dtype(t.dtype)):
                    raise OnnxArtifactError(
                        f"{path}: weight {init.name!r} was exported as {exported[1]}{list(exported[0])}, the model "
                        f"has {t.dtype}{list(t.shape)}: recompile the plan for this model")
                so.add_initializer(init.name, self._shared_value(init.name, t, keepalive))
        session = ort.InferenceSession(str(path), so, providers=self.providers)
        return OrtGraph(session, graph, keepalive)

    def _file_tensor(self, art_dir: Path, init, keepalive: list[Any]):
        """An external initializer the module lacks, read from the weights file once per process."""
        import numpy as np
        import onnx

        info = {e.key: e.value for e in init.external_data}
        path = art_dir / info["location"]
        offset, length = int(info.get("offset", 0)), int(info["length"])
        dtype, dims = onnx.helper.tensor_dtype_to_np_dtype(init.data_type), tuple(init.dims)

        def read():
            count = int(np.prod(dims, dtype=np.int64))
            return np.fromfile(path, dtype=dtype, count=count, offset=offset).reshape(dims)

        value = self._stored_value(path, offset, length, read)
        keepalive.append(value)
        return value[1]
