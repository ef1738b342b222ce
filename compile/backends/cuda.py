"""CUDA graphs: one `torch.cuda.CUDAGraph` captured per GraphDef (graph x bucket) on static buffers.

How a graph is built (`compile` and `load` both do this, ahead of serving)
  1. Every input gets a static CUDA buffer shaped like the GraphDef's example input, filled with the
     example's values (so warm-up and capture run on valid token ids and lengths), unless the runtime
     bound a tensor of its own for that input (below).
  2. The module runs `warmup` times on a side stream (lazy CUDA init, cuBLAS workspaces, allocator
     warm-up), then once more inside `torch.cuda.graph(...)`, which records the kernels.
  3. The returned `CudaGraphRunner` copies the caller's inputs into the static buffers, replays the
     graph and returns the outputs.

Persistent inputs (the KV caches): `bind_static`
  Copying the whole cache into a static buffer on every step would cost more than the step itself
  and break invariant 6. So the runtime hands each cache tensor to the backend once, *before* it
  loads the graphs::

      backend.bind_static("k_cache", target_k, model="target")
      backend.bind_static("v_cache", target_v, model="target")
      backend.bind_static("k_cache", draft_k, model="draft")   # the draft graphs' caches
      ...
      fn = backend.load(graph, art_dir)

  A bound tensor *is* the static buffer of every input of that name (of graphs whose GraphModule
  holds a model of that role, when `model` is given; of graph `graph_key` only, when that is given)
  whose shape and dtype it matches; several tensors may be bound under one name (e.g. one cache per
  batch bucket): each graph takes the one of its shape. The graph is captured reading that memory,
  and at call time an input whose storage already is the static buffer (same data_ptr, shape,
  strides, dtype) is not copied (`inputs_to_copy`). Passing another tensor still works: it is copied.
  Binding after a graph was captured has no effect on it, so it is refused. Graphs are pure, so the
  graphs only read bound tensors; the runtime's commits write them between replays, which is what
  makes the next replay see the new tokens.

Outputs
  A replay writes into the same output memory every time. By default (`clone_outputs=True`) the
  runner returns clones, which also makes sharing one memory pool between all graphs safe (one
  graph's replay may reuse another's output memory as scratch). With `clone_outputs=False` it
  returns the static output tensors themselves: they are overwritten by the next replay of the same
  graph, and each graph then gets its own private memory pool.

Artifacts
  CUDA graphs cannot be serialized. `compile` captures (which proves the graph capturable) and writes
  only a marker, `<key>.cudagraph.json`, with the input signature; `load` checks the marker and
  captures again from the same GraphDef. That re-capture happens at startup, when the runtime loads
  its plan, ahead of serving, never at serving time (invariant 3): a call with a shape outside the
  plan is an error (`inputs_to_copy`), not a capture.

Requirements on a graph: no host syncs (`.item()`, `.tolist()`, `.cpu()`, data-dependent Python
branches), no tensors created on or copied from the CPU inside it (index buffers must be inputs or
live on the device), static shapes, no RNG ops. Weights must be on the GPU: the runtime moves the
models to `backend.device` first; compile/load refuse parameters or buffers elsewhere.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
from torch import Tensor, nn

from specair.compile.backends.base import Backend, BackendUnavailable, CompiledGraph
from specair.compile.graph_def import GraphDef
from specair.models.errors import InputError, SpecairError

MARKER_SUFFIX = ".cudagraph.json"


# ---- host-side helpers (pure; shared with the npu backend) -------------------------------------------


def is_same_buffer(static: Tensor, given: Tensor) -> bool:
    """True if `given` is exactly the static buffer's memory view (nothing to copy)."""
    return (given.data_ptr() == static.data_ptr() and given.device == static.device
            and given.dtype == static.dtype and given.shape == static.shape and given.stride() == static.stride())


def check_inputs(key: str, names: Sequence[str], expected: Sequence[Tensor], given: Sequence[Tensor],
                 device_type: str) -> None:
    """Refuse a call whose inputs do not match the compiled signature (count, shape, dtype, device)."""
    if len(given) != len(expected):
        raise InputError(f"graph {key}: expected {len(expected)} inputs ({', '.join(names)}), got {len(given)}")
    for name, want, got in zip(names, expected, given):
        if not isinstance(got, Tensor):
            raise InputError(f"graph {key}: input {name} must be a tensor, got {type(got).__name__}")
        if got.shape != want.shape or got.dtype != want.dtype:
            raise InputError(
                f"graph {key}: input {name} has shape {tuple(got.shape)} {got.dtype}, but the graph was compiled "
                f"for {tuple(want.shape)} {want.dtype}; a shape outside the bucket plan needs another bucket "
                f"(recompile with buckets that cover it), never a capture at serving time")
        if got.device.type != device_type:
            raise InputError(f"graph {key}: input {name} is on {got.device}, but this graph runs on {device_type}; "
                             f"move it there first")


def inputs_to_copy(key: str, names: Sequence[str], static: Sequence[Tensor], given: Sequence[Tensor],
                   device_type: str = "cuda") -> list[int]:
    """Indices of the inputs that must be copied into their static buffers before a replay: all of
    them except those the caller passes as the static buffer itself (bound tensors, e.g. KV caches)."""
    check_inputs(key, names, static, given, device_type)
    return [i for i, (s, g) in enumerate(zip(static, given)) if not is_same_buffer(s, g)]


def input_names(graph: GraphDef) -> tuple[str, ...]:
    n = len(graph.example_inputs)
    names = tuple(graph.input_names)
    return names if len(names) == n else tuple(f"input{i}" for i in range(n))


def check_on_device(graph: GraphDef, device_type: str, backend: str) -> None:
    """Refuse a graph whose parameters or buffers are not on the backend's device."""
    bad = [(n, t.device) for n, t in _tensors_of(graph.module) if t.device.type != device_type]
    if bad:
        listed = ", ".join(f"{n} on {d}" for n, d in bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise SpecairError(f"{backend} backend: graph {graph.key}: weights must be on {device_type}, but {listed}; "
                           f"move the models to the backend's device (model.to({device_type!r})) before compiling "
                           f"or loading")


def _tensors_of(module: nn.Module) -> Iterable[tuple[str, Tensor]]:
    yield from module.named_parameters()
    yield from module.named_buffers()


def signature(graph: GraphDef) -> list[list[Any]]:
    """The input signature a marker records: [[name, shape, dtype], ...]."""
    return [[n, list(t.shape), str(t.dtype).replace("torch.", "")] for n, t in zip(input_names(graph),
                                                                                   graph.example_inputs)]


def write_marker(graph: GraphDef, art_dir: Path, backend: str, suffix: str, **extra: Any) -> Path:
    path = Path(art_dir) / f"{graph.key}{suffix}"
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"backend": backend, "key": graph.key, "inputs": signature(graph),
            "outputs": list(graph.output_names), **extra}
    path.write_text(json.dumps(body, indent=1) + "\n")
    return path


def read_marker(graph: GraphDef, art_dir: Path, backend: str, suffix: str) -> dict[str, Any]:
    """The marker `compile` wrote for this graph; refuses a missing one or one for other shapes."""
    path = Path(art_dir) / f"{graph.key}{suffix}"
    if not path.is_file():
        raise SpecairError(f"{backend} backend: {art_dir} holds no {path.name} for graph {graph.key}: it was not "
                           f"compiled with the {backend} backend; recompile the artifact directory with it")
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SpecairError(f"{backend} backend: {path} is unreadable ({e}); recompile the artifact directory") from None
    if body.get("backend") != backend or body.get("key") != graph.key:
        raise SpecairError(f"{backend} backend: {path} belongs to backend {body.get('backend')!r}, graph "
                           f"{body.get('key')!r}; recompile the artifact directory")
    if body.get("inputs") != signature(graph):
        raise SpecairError(f"{backend} backend: graph {graph.key} was compiled for inputs {body.get('inputs')}, "
                           f"but the plan now gives {signature(graph)}; recompile the artifact directory")
    return body


class StaticBindings:
    """Tensors the runtime owns persistently (the KV caches), handed to a backend once so that they
    are the static buffers of the graph inputs they feed. See the module docstring."""

    def __init__(self) -> None:
        self._bound: list[tuple[str, str | None, str | None, Tensor]] = []  # (name, model role, graph key, t)
        self._used: set[tuple[str, str]] = set()  # (graph key, input name) already captured with a buffer

    def bind(self, name: str, tensor: Tensor, model: str | None = None, graph_key: str | None = None) -> None:
        if not isinstance(tensor, Tensor):
            raise TypeError(f"bind_static({name!r}) needs a tensor, got {type(tensor).__name__}")
        late = sorted(k for k, n in self._used if n == name and graph_key in (None, k))
        if late:
            raise SpecairError(f"bind_static({name!r}) after graphs {late[:3]} were built with their own buffer; "
                               f"bind persistent inputs before compile/load")
        self._bound.append((name, model, graph_key, tensor))

    def names(self) -> set[str]:
        return {b[0] for b in self._bound}

    def lookup(self, graph: GraphDef, name: str, like: Tensor) -> Tensor | None:
        """The bound tensor for input `name` of `graph` with `like`'s shape and dtype, if any."""
        roles = set(getattr(graph.module, "models", {}).keys())
        for n, role, key, t in reversed(self._bound):  # the latest binding wins
            if n != name or (key is not None and key != graph.key) or (role is not None and role not in roles):
                continue
            if t.shape == like.shape and t.dtype == like.dtype:
                return t
        return None

    def static_inputs(self, graph: GraphDef, device: str | torch.device, backend: str) -> list[Tensor]:
        """One buffer per input: the bound tensor where there is one, else a fresh copy of the example
        input on `device`."""
        device = torch.device(device)
        out = []
        for name, ex in zip(input_names(graph), graph.example_inputs):
            t = self.lookup(graph, name, ex)
            if t is not None and t.device.type != device.type:
                raise SpecairError(f"{backend} backend: the tensor bound as {name!r} is on {t.device}, not "
                                   f"{device.type}")
            if t is None:
                if name in self.names():
                    warnings.warn(f"{backend} backend: graph {graph.key}: no tensor of shape {tuple(ex.shape)} "
                                  f"{ex.dtype} is bound as {name!r}, so every call copies this input", stacklevel=3)
                t = torch.empty_like(ex, device=device)
                t.copy_(ex)
            self._used.add((graph.key, name))
            out.append(t)
        return out


# ---- the backend ---------------------------------------------------------------------------------


class CudaGraphRunner:
    """A captured graph: call it with the GraphDef's inputs; see the module docstring."""

    def __init__(self, key: str, names: Sequence[str], cuda_graph: Any, static_inputs: list[Tensor],
                 static_outputs: tuple[Tensor, ...], clone_outputs: bool) -> None:
        self.key, self.names = key, tuple(names)
        self.graph, self.static_inputs, self.static_outputs = cuda_graph, static_inputs, static_outputs
        self.clone_outputs = clone_outputs
        self.last_copied: tuple[int, ...] = ()  # which inputs the last call copied (diagnostics, tests)

    def __call__(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        copy = inputs_to_copy(self.key, self.names, self.static_inputs, inputs, "cuda")
        with torch.inference_mode():
            for i in copy:
                self.static_inputs[i].copy_(inputs[i])
            self.graph.replay()
            out = tuple(o.clone() for o in self.static_outputs) if self.clone_outputs else self.static_outputs
        self.last_copied = tuple(copy)
        return out


class CudaGraphBackend(Backend):
    """CUDA graphs per GraphDef on static buffers (see the module docstring)."""

    name = "cuda"
    device = "cuda"

    def __init__(self, threads: int | None = None, *, clone_outputs: bool = True, warmup: int = 2) -> None:
        super().__init__(threads)
        self.clone_outputs, self.warmup = clone_outputs, warmup
        self.bindings = StaticBindings()
        self._pool: Any = None

    @classmethod
    def check_available(cls) -> None:
        if not torch.cuda.is_available():
            build = torch.version.cuda
            raise BackendUnavailable(
                "cuda backend: no CUDA device: torch.cuda.is_available() is False "
                f"(torch {torch.__version__}, " + (f"built with CUDA {build}" if build else "a CPU-only build") +
                "); run on an NVIDIA GPU with a CUDA build of torch, or choose another backend (eager, inductor, "
                "aoti, onnx)")

    def bind_static(self, name: str, tensor: Tensor, *, model: str | None = None,
                    graph_key: str | None = None) -> None:
        """Make `tensor` the static buffer of input `name` (of graphs holding model role `model`, or of
        graph `graph_key` only): calls that pass `tensor` itself copy nothing. Call before compile/load."""
        self.bindings.bind(name, tensor, model, graph_key)

    def compile(self, graph: GraphDef, art_dir: Path) -> CompiledGraph:
        runner = self._capture(graph)
        write_marker(graph, art_dir, self.name, MARKER_SUFFIX,
                     note="CUDA graphs are not serializable: load captures again from the same GraphDef")
        return runner

    def load(self, graph: GraphDef, art_dir: Path) -> CompiledGraph:
        read_marker(graph, art_dir, self.name, MARKER_SUFFIX)
        return self._capture(graph)

    def versions(self) -> dict[str, str]:
        return {"torch": torch.__version__, "cuda": str(torch.version.cuda)}

    def _capture(self, graph: GraphDef) -> CudaGraphRunner:
        self.check_available()
        check_on_device(graph, "cuda", self.name)
        names = input_names(graph)
        static = self.bindings.static_inputs(graph, "cuda", self.name)
        module = graph.module
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), torch.inference_mode():
                for _ in range(max(self.warmup, 1)):
                    module(*static)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            cuda_graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(cuda_graph, pool=self._graph_pool()):
                outputs = tuple(module(*static))
            torch.cuda.synchronize()
        except Exception as e:
            raise SpecairError(
                f"cuda backend: capturing graph {graph.key} failed: {type(e).__name__}: {e}. A CUDA graph needs "
                f"static shapes and no host syncs (.item(), .tolist(), .cpu()), no CPU tensors inside the graph "
                f"(index buffers must be inputs or on the GPU) and no RNG ops") from e
        return CudaGraphRunner(graph.key, names, cuda_graph, static, outputs, self.clone_outputs)

    def _graph_pool(self) -> Any:
        """One memory pool for every graph when outputs are cloned (replays are sequential, so scratch
        memory can be shared); a private pool per graph otherwise, so that no replay clobbers another
        graph's static outputs."""
        if not self.clone_outputs:
            return None
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool
