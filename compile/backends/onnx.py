"""ONNX: `torch.onnx.export` at static shapes, run by onnxruntime (CPU) with IO binding; Atlas boards via ATC.

Export: `onnx_export.py`; the shared weights file: `onnx_weights.py`; the fused attention and the int4 kernels'
lowering: `onnx_attention.py`.

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
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specair.compile.backends.base import Backend, BackendUnavailable, CompiledGraph
from specair.compile.backends.onnx_attention import IN_PLACE, PRESENT, lower_fused_attention
from specair.compile.backends.onnx_fusion import fuse_rowwise
from specair.compile.backends.onnx_export import (OPSET, OnnxExportError, export_self_contained, linear_to_gemm,
                                                  module_tensors, torch_export)
from specair.compile.backends.onnx_weights import (WEIGHTS_FILE, WEIGHTS_INDEX, HugePageArena, OnnxArtifactError,
                                                   WeightStore, external_tensor, externalize, numpy_dtype,
                                                   to_numpy)
from specair.compile.graph_def import GraphDef
from specair.compile import kernels
from specair.compile.quantize import WeightQuantizer, parse_quantize
from specair.models.errors import InputError


def _missing_packages() -> list[str]:
    missing = []
    for pkg in ("onnx", "onnxruntime"):
        try:
            __import__(pkg)
        except ImportError:
            missing.append(pkg)
    return missing


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
        self._stores: dict[Path, WeightStore] = {}
        self._shared: dict[tuple, Any] = {}  # (name, data_ptr) -> (tensor, array, OrtValue), shared by sessions
        # (weights file, offset, length) -> (array, OrtValue): stored tensors the module lacks (quantized
        # weights, lifted constants), in memory once and shared by every session that reads them
        self._stored: dict[tuple, tuple[Any, Any]] = {}
        self._arena = HugePageArena()

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

    def end(self, art_dir: Path) -> None:
        """After a build: the quantizer's per-weight results go (every graph has its packed weights, and
        loaded sessions hold them from the weights file), and with them its references to float weights."""
        if self._quantizer is not None:
            self._quantizer.forget()

    @property
    def reads_own_weights(self) -> bool:
        """Whether its graphs read every linear layer from their own quantized copies, not the module's."""
        return self._quantizer is not None and self.kernels and self.quantization.kernel == kernels.OP

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
            torch_export(graph, tmp, self.opset, fold=False, export_params=False,
                          fuse_attention=self.fuse_attention, kernel_filter=self.kernels, kernel_rowwise=self.kernels)
            model = onnx.load(str(tmp))
        finally:
            tmp.unlink(missing_ok=True)
        lower_fused_attention(model, row_independent=self.kernels)
        tensors = module_tensors(graph.module)
        quantized = self._quantizer.rewrite(model, tensors) if self._quantizer is not None else {}
        if self.kernels:
            fuse_rowwise(model)
        linear_to_gemm(model, set(tensors))
        store = self._stores.get(art_dir)
        if store is None or (store.entries and not store.bin.exists()):  # first use, or the directory was wiped
            self._forget_stored(art_dir / WEIGHTS_FILE)
            store = self._stores[art_dir] = WeightStore(art_dir)
        externalize(model, tensors, store)
        for name, array in quantized.items():
            entry = store.add(name, array=array)
            model.graph.initializer.append(external_tensor(name, entry))
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
            arr = to_numpy(t)  # a view of the torch tensor (a copy only if it was not contiguous)
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
            pool = _pool_threads if self._shared_pool else self.threads
            if pool:  # products split into one part per thread of the pool (compile/kernels/ort_ops.cpp)
                so.add_session_config_entry("specair.intra_op_threads", str(pool))
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
            tensors = module_tensors(graph.module)
            for init in external:
                t = tensors.get(init.name)
                if t is None or t.device.type == "meta":
                    so.add_initializer(init.name, self._file_tensor(Path(art_dir), init, keepalive))
                    continue
                exported = (tuple(init.dims), onnx.helper.tensor_dtype_to_np_dtype(init.data_type))
                if exported != (tuple(t.shape), numpy_dtype(t.dtype)):
                    raise OnnxArtifactError(
                        f"{path}: weight {init.name!r} was exported as {exported[1]}{list(exported[0])}, the model "
                        f"has {t.dtype}{list(t.shape)}: recompile the plan for this model")
                so.add_initializer(init.name, self._shared_value(init.name, t, keepalive))
        session = ort.InferenceSession(str(path), so, providers=self.providers)
        return OrtGraph(session, graph, keepalive)

    def _file_tensor(self, art_dir: Path, init, keepalive: list[Any]):
        """An external initializer the module lacks, read from the weights file once per process."""
        import onnx

        info = {e.key: e.value for e in init.external_data}
        path = art_dir / info["location"]
        offset, length = int(info.get("offset", 0)), int(info["length"])
        dtype, dims = onnx.helper.tensor_dtype_to_np_dtype(init.data_type), tuple(init.dims)

        value = self._stored_value(path, offset, length, lambda: self._arena.read(path, offset, dtype, dims))
        keepalive.append(value)
        return value[1]
