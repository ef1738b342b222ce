"""Ascend NPU (Atlas A2/A3, 910B class) through torchair: GE graph mode or aclgraph capture/replay.

Modes (`NpuBackend(mode=...)`)
  "ge"        torchair's Ascend-IR/GE graph ("max-autotune"): the whole graph compiled by GE, fused and
              sunk to the device. `torch.compile(m, backend=torchair.get_npu_backend(compiler_config=cfg),
              fullgraph=True, dynamic=False)`, `cfg.experimental_config.frozen_parameter = True`.
  "aclgraph"  capture/replay like CUDA graphs: `torch.compile(m, backend="npugraph_ex", fullgraph=True,
              dynamic=False, options={...})` (the backend torch_npu registers); on an older torch_npu
              without npugraph_ex, torchair's deprecated `cfg.mode = "reduce-overhead"`.
  Atlas 310B/310P edge boards are not torchair targets: they take ONNX through ATC (onnx backend).

Warm start (`warm_start=True`, the default)
  `compile` wraps the graph in `torchair.inference.cache_compile` (aclgraph:
  `torch.npu.npugraph_ex.inference.cache_compile`), runs it once on the example inputs, which traces,
  compiles and writes the cache (`compiled_module`: the Dynamo bytecode plus the generated graph code;
  with `ge_cache=True` also GE's compiled `.om`) under `<art_dir>/npu_cache/<key>/`, and writes the
  marker `<key>.npu.json`. `load` copies that cache to a private work directory, restores it through
  the same call, which skips Dynamo and its guards, and runs the graph once on the example inputs
  (or the bound tensors) so that GE compilation (without ge_cache) or the aclgraph capture happen at
  startup, never at serving time. It refuses, rather than silently recompiles, when the cache was
  not hit. With `warm_start=False` compile writes only the marker and load compiles again with plain
  `torch.compile` (at startup, like the cuda backend).

Constraints cache_compile puts on a graph, and how this backend meets them
  - The function must be an undecorated method of an nn.Module that compiles to one full graph with
    one trace; it is cached per method *name*, and a method traced twice (e.g. the same code object
    for two graphs) drops its cache. Every GraphModule shares `GraphModule.forward`, so each graph gets
    a bound copy of forward with a code object of its own (`proxy_method`, the trick vllm-ascend's
    torchair model runner uses per batch size), and a cache directory of its own.
  - Guards are skipped at load, so a call with other shapes would run the wrong graph: every call is
    checked against the compiled input signature first (`check_inputs`).
  - No RNG ops (specair graphs take uniforms as inputs); the cache is tied to the CANN version
    (recorded in the manifest through `versions()`; recompile after a CANN upgrade); torchair loads a
    cache file only if it is owned by the current user with mode 0600 (load works on a fresh copy).

Persistent inputs (the KV caches): `bind_static(name, tensor, model=..., graph_key=...)` as in the cuda
backend. aclgraph by default clones every non-parameter input of a captured graph each call
("clone_input"), which for the caches would be a copy of the whole cache per step; this backend sets
`clone_input: False`, under which npugraph_ex re-points nothing and copies an input only when its
address differs from the one captured. Binding the runtime's cache tensors before `load` makes the
capture run on them, so no step copies them. GE receives inputs by address. Outputs are cloned by
default (`clone_outputs=True`): aclgraph outputs live in the graph's memory and are overwritten by a
later replay.

Verified against sources (Ascend/torchair, Ascend/pytorch, vllm-project/vllm-ascend; see the task report):
  signatures of `cache_compile` (torchair and npugraph_ex), `get_npu_backend`, `CompilerConfig`
  (`mode` in {"max-autotune", "reduce-overhead"}, `experimental_config.frozen_parameter`,
  `debug.aclgraph.clone_input`), the npugraph_ex option names (`frozen_parameter`, `clone_input`), the
  cache path layout `<cache_dir>/<Class>_<static|dynamic>[_aclgraphcache|_gecache]_<md5>/<func name>/
  compiled_module`, the 0600/owner check, that a broken cache is deleted and recompiled, that
  `import torch_npu` registers the "npugraph_ex" dynamo backend and a lazy `torchair` module.

UNVERIFIED (nothing here has run on an NPU):
  - that specair's graphs (plain torch ops, boolean masks, gather/scatter, topk, one_hot, cumsum,
    searchsorted-free sampling) convert to GE without a graph break or an unsupported-op error, and
    match eager within tolerance;
  - that the Dynamo bytecode of `GraphModule.forward(self, *inputs)` (varargs) round-trips through
    cache_compile's marshal/rebase, and that the `L['self']...` parameter sources of
    inline_inbuilt_nn_modules=True (torch's default) are resolved by `_get_used_params`; if not,
    set torch._dynamo.config.inline_inbuilt_nn_modules = False before compile (vllm-ascend's
    npugraph_ex users do);
  - `ge_cache=True` together with `frozen_parameter=True`, and relocating a GE cache by copying it;
  - that npugraph_ex's `clone_input=False` avoids a per-step cache copy for bound caches, and that
    GE outputs are fresh tensors per run (outputs are cloned anyway by default);
  - the CANN version lookup (`torch_npu.version.cann` or `torch_npu.utils.get_cann_version`);
  - `torch.npu.set_compile_mode(jit_compile=False)` being wanted here (vllm-ascend sets it for torchair);
  - a separate `torchair` wheel: torchair ships inside torch_npu (`torch_npu/dynamo/torchair`); PyPI
    has no package named `torchair`.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import re
import shutil
import stat
import tempfile
import types
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor, nn

from specair.compile.backends.base import Backend, BackendUnavailable, CompiledGraph
from specair.compile.backends.cuda import (StaticBindings, check_inputs, check_on_device, input_names,
                                           read_marker, write_marker)
from specair.compile.graph_def import GraphDef
from specair.models.errors import SpecairError

MODES = ("ge", "aclgraph")
MARKER_SUFFIX = ".npu.json"
CACHE_DIR = "npu_cache"
CACHE_FILE = "compiled_module"  # torchair's CompiledModel.FILE
INSTALL_HINT = ("install the Ascend CANN toolkit and a torch_npu wheel built for torch {torch} (it ships torchair), "
                "e.g. `pip install specair[npu]`, on an Atlas A2/A3 machine")

_proxy_ids = itertools.count()


def import_npu() -> tuple[Any, Any]:
    """(torch_npu, torchair), or BackendUnavailable naming the one that is missing. Imported only here,
    never at module import."""
    hint = INSTALL_HINT.format(torch=torch.__version__.split("+")[0])
    try:
        import torch_npu  # registers the "npu" device, the "npugraph_ex" backend and a lazy `torchair`
    except Exception as e:  # ImportError, or OSError/RuntimeError when CANN's libraries are missing
        raise BackendUnavailable(f"npu backend: torch_npu is not importable here ({type(e).__name__}: {e}); "
                                 f"{hint}") from None
    try:
        import torchair
    except Exception as e:
        raise BackendUnavailable(f"npu backend: torchair is not importable here ({type(e).__name__}: {e}); "
                                 f"torch_npu {getattr(torch_npu, '__version__', '?')} was built without it; "
                                 f"{hint}") from None
    return torch_npu, torchair


def proxy_name(key: str) -> str:
    """The deterministic method name a graph is cached under (part of torchair's cache path)."""
    return "specair_" + re.sub(r"\W", "_", key) + "_" + hashlib.sha1(key.encode()).hexdigest()[:8]


def proxy_method(module: nn.Module, key: str) -> types.MethodType:
    """`module.forward` as a bound method with its own name and its own code object, so that Dynamo
    traces each graph in a frame of its own (no recompile across graphs that share GraphModule.forward)
    and torchair caches it under its own name. The code object's co_name also carries a process-wide
    counter: torchair matches traced frames by code equality, which includes co_name."""
    forward = type(module).forward
    name = proxy_name(key)
    code = forward.__code__.replace(co_name=f"{name}_{next(_proxy_ids)}")
    fn = types.FunctionType(code, forward.__globals__, name, forward.__defaults__, forward.__closure__)
    fn.__qualname__ = f"{type(module).__qualname__}.{name}"
    fn.__kwdefaults__ = forward.__kwdefaults__
    return types.MethodType(fn, module)


def prepare_cache_copy(src: Path, dst: Path) -> list[Path]:
    """Copy a graph's cache directory to `dst` with the modes torchair insists on (files 0600, dirs
    0700, owned by us); return the cache files found. A copy also keeps torchair, which deletes a cache
    it fails to load, away from the artifact directory."""
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst, symlinks=False)
    for root, dirs, files in os.walk(dst):
        os.chmod(root, 0o700)
        for f in files:
            os.chmod(os.path.join(root, f), 0o600)
    return sorted(dst.rglob(CACHE_FILE))


def check_cache_file(path: Path) -> None:
    """The conditions torchair checks before loading a cache file, as an error that says what to do
    (torchair itself would delete the cache and recompile)."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise SpecairError(f"npu backend: {path} is a symlink; torchair refuses it")
    if st.st_uid != os.getuid():
        raise SpecairError(f"npu backend: {path} is owned by uid {st.st_uid}, not the serving user {os.getuid()}; "
                           f"torchair loads only its own cache files")
    if stat.S_IMODE(st.st_mode) != 0o600:
        raise SpecairError(f"npu backend: {path} has mode {oct(stat.S_IMODE(st.st_mode))}; torchair needs 0o600")


class NpuGraphRunner:
    """A compiled NPU graph: checks the call against the compiled signature, runs, clones outputs."""

    def __init__(self, key: str, names: tuple[str, ...], expected: tuple[Tensor, ...], fn: Callable[..., Any],
                 device_type: str, clone_outputs: bool, keep: tuple[Tensor, ...] = ()) -> None:
        self.key, self.names, self.expected, self.fn = key, names, expected, fn
        self.device_type, self.clone_outputs = device_type, clone_outputs
        self._keep = keep  # the tensors an aclgraph was captured on: alive as long as the graph

    def __call__(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        check_inputs(self.key, self.names, self.expected, inputs, self.device_type)
        with torch.no_grad():
            out = self.fn(*inputs)
            out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
            return tuple(o.clone() for o in out) if self.clone_outputs else out


class NpuBackend(Backend):
    """torchair GE graphs or aclgraph per GraphDef on Ascend A2/A3 (see the module docstring)."""

    name = "npu"
    device: ClassVar[str] = "npu"

    def __init__(self, threads: int | None = None, *, mode: str = "ge", warm_start: bool = True,
                 ge_cache: bool = True, clone_outputs: bool = True) -> None:
        super().__init__(threads)
        if mode not in MODES:
            raise SpecairError(f"npu backend: mode must be one of {MODES}, got {mode!r}")
        self.mode, self.warm_start, self.ge_cache, self.clone_outputs = mode, warm_start, ge_cache, clone_outputs
        self.bindings = StaticBindings()
        self._work: Path | None = None
        self._ready = False

    @classmethod
    def check_available(cls) -> None:
        import_npu()
        if not torch.npu.is_available():  # type: ignore[attr-defined]
            raise BackendUnavailable("npu backend: no Ascend NPU device: torch.npu.is_available() is False "
                                     "(check the driver, `npu-smi info` and ASCEND_RT_VISIBLE_DEVICES)")

    def bind_static(self, name: str, tensor: Tensor, *, model: str | None = None,
                    graph_key: str | None = None) -> None:
        """Run the first call (compile/capture) on `tensor` for input `name`; see the module docstring."""
        self.bindings.bind(name, tensor, model, graph_key)

    # ---- compile / load ---------------------------------------------------------------------------

    def compile(self, graph: GraphDef, art_dir: Path) -> CompiledGraph:
        self._setup()
        check_on_device(graph, self.device, self.name)
        art_dir = Path(art_dir)
        cache_dir = art_dir / CACHE_DIR / graph.key
        extra: dict[str, Any] = {"mode": self.mode, "warm_start": self.warm_start}
        if self.warm_start:
            if cache_dir.exists():  # torchair would load a stale cache instead of compiling
                shutil.rmtree(cache_dir)
            cache_dir.mkdir(parents=True, mode=0o700)
            fn = self._make_cached(proxy_method(graph.module, graph.key), cache_dir)
            first = self._first_call(graph, fn)
            found = sorted(cache_dir.rglob(CACHE_FILE))
            if len(found) != 1:
                raise SpecairError(
                    f"npu backend: cache_compile left {len(found)} cache files for graph {graph.key} under "
                    f"{cache_dir} (expected 1): torchair skips the cache when a graph recompiles, breaks or cannot "
                    f"be serialized (its log says why); compile with NpuBackend(warm_start=False) to avoid it")
            extra.update(cache=found[0].relative_to(art_dir).as_posix(), ge_cache=self.ge_cache)
        else:
            fn = self._make_plain(proxy_method(graph.module, graph.key))
            first = self._first_call(graph, fn)
        write_marker(graph, art_dir, self.name, MARKER_SUFFIX, **extra)
        return self._runner(graph, fn, first)

    def load(self, graph: GraphDef, art_dir: Path) -> CompiledGraph:
        art_dir = Path(art_dir)
        marker = read_marker(graph, art_dir, self.name, MARKER_SUFFIX)
        if marker.get("mode") != self.mode or bool(marker.get("warm_start")) != self.warm_start:
            raise SpecairError(f"npu backend: graph {graph.key} was compiled with mode={marker.get('mode')!r}, "
                               f"warm_start={marker.get('warm_start')}, not mode={self.mode!r}, "
                               f"warm_start={self.warm_start}; recompile or load with the same settings")
        self._setup()
        check_on_device(graph, self.device, self.name)
        if not self.warm_start:
            fn = self._make_plain(proxy_method(graph.module, graph.key))
            return self._runner(graph, fn, self._first_call(graph, fn))
        if self.mode == "ge" and bool(marker.get("ge_cache")) != self.ge_cache:
            raise SpecairError(f"npu backend: graph {graph.key} was compiled with ge_cache={marker.get('ge_cache')}; "
                               f"load with the same setting or recompile")
        src = art_dir / CACHE_DIR / graph.key
        recorded = art_dir / str(marker.get("cache", ""))
        if not src.is_dir() or not recorded.is_file():
            raise SpecairError(f"npu backend: the torchair cache of graph {graph.key} ({recorded}) is missing; "
                               f"recompile the artifact directory with the npu backend")
        work = self._work_dir() / graph.key
        files = prepare_cache_copy(src, work)
        for f in files:
            check_cache_file(f)
        fn = self._make_cached(proxy_method(graph.module, graph.key), work)
        first = self._first_call(graph, fn)
        if type(getattr(fn, "_compiled_model", None)).__name__ == "ModelCacheSaver":
            raise SpecairError(
                f"npu backend: graph {graph.key}: torchair did not find its cache (it compiled the graph instead): "
                f"the cache path depends on the torchair/CANN version, the compiler options and the model's "
                f"structure; recompile the artifact directory on this machine")
        return self._runner(graph, fn, first)

    def versions(self) -> dict[str, str]:
        out = {"torch": torch.__version__}
        try:
            torch_npu, torchair = import_npu()
        except BackendUnavailable:
            return out
        out["torch_npu"] = str(getattr(torch_npu, "__version__", "unknown"))
        out["torchair"] = str(getattr(torchair, "__version__", "bundled"))
        out["cann"] = cann_version(torch_npu)
        out["npu_mode"] = self.mode
        return out

    # ---- internals ----------------------------------------------------------------------------------

    def _setup(self) -> None:
        if self._ready:
            return
        self.check_available()
        set_mode = getattr(torch.npu, "set_compile_mode", None)  # type: ignore[attr-defined]
        if set_mode is not None:
            set_mode(jit_compile=False)  # binary kernels; what vllm-ascend sets before torchair compiles
        self._ready = True

    def _work_dir(self) -> Path:
        if self._work is None:
            self._work = Path(tempfile.mkdtemp(prefix="specair-npu-cache-"))
        return self._work

    def _first_call(self, graph: GraphDef, fn: Callable[..., Any]) -> tuple[Tensor, ...]:
        """Trace/compile (compile) or restore and capture (load) now, on the bound tensors where the
        runtime bound some, so that the first request does not. Returns the inputs it ran on."""
        inputs = tuple(self.bindings.static_inputs(graph, self.device, self.name))
        with torch.no_grad():
            fn(*inputs)
        return inputs

    def _runner(self, graph: GraphDef, fn: Callable[..., Any], first: tuple[Tensor, ...]) -> NpuGraphRunner:
        # With clone_input=False, npugraph_ex copies an input whose address changed into the memory it
        # captured on; keep that memory alive (UNVERIFIED whether npugraph_ex holds it itself). For the
        # bound caches this holds nothing extra.
        keep = first if self.mode == "aclgraph" else ()
        return NpuGraphRunner(graph.key, input_names(graph), tuple(graph.example_inputs), fn, self.device,
                              self.clone_outputs, keep)

    def _ge_config(self) -> Any:
        _, torchair = import_npu()
        cfg = torchair.CompilerConfig()
        cfg.experimental_config.frozen_parameter = True
        return cfg

    def _aclgraph_options(self) -> dict[str, Any]:
        return {"frozen_parameter": True, "clone_input": False}

    def _legacy_aclgraph_config(self) -> Any:
        """torchair's "reduce-overhead" mode, for a torch_npu without npugraph_ex (deprecated upstream)."""
        _, torchair = import_npu()
        cfg = torchair.CompilerConfig()
        cfg.mode = "reduce-overhead"
        cfg.experimental_config.frozen_parameter = True
        aclgraph = getattr(cfg.debug, "aclgraph", None)
        if aclgraph is not None and hasattr(aclgraph, "clone_input"):
            aclgraph.clone_input = False
        return cfg

    @staticmethod
    def _npugraph_ex() -> Any:
        return getattr(torch.npu, "npugraph_ex", None)  # type: ignore[attr-defined]

    def _make_cached(self, method: types.MethodType, cache_dir: Path) -> Callable[..., Any]:
        """cache_compile(method): compiles and saves on the first call when cache_dir holds no cache for
        it, else loads the cache (no Dynamo, no guards)."""
        _, torchair = import_npu()
        if self.mode == "ge":
            return torchair.inference.cache_compile(method, config=self._ge_config(), dynamic=False,
                                                    cache_dir=str(cache_dir), ge_cache=self.ge_cache)
        ex = self._npugraph_ex()
        if ex is not None:
            return ex.inference.cache_compile(method, dynamic=False, cache_dir=str(cache_dir),
                                              options=self._aclgraph_options())
        return torchair.inference.cache_compile(method, config=self._legacy_aclgraph_config(), dynamic=False,
                                                cache_dir=str(cache_dir))

    def _make_plain(self, method: types.MethodType) -> Callable[..., Any]:
        _, torchair = import_npu()
        if self.mode == "ge":
            backend = torchair.get_npu_backend(compiler_config=self._ge_config())
            return torch.compile(method, backend=backend, fullgraph=True, dynamic=False)
        if self._npugraph_ex() is not None:
            return torch.compile(method, backend="npugraph_ex", fullgraph=True, dynamic=False,
                                 options=self._aclgraph_options())
        backend = torchair.get_npu_backend(compiler_config=self._legacy_aclgraph_config())
        return torch.compile(method, backend=backend, fullgraph=True, dynamic=False)


def cann_version(torch_npu: Any) -> str:
    """The CANN version torch_npu runs on (UNVERIFIED lookups; 'unknown' when neither exists)."""
    v = getattr(getattr(torch_npu, "version", None), "cann", None)
    if v:
        return str(v)
    get = getattr(getattr(torch_npu, "utils", None), "get_cann_version", None)
    if get is not None:
        try:
            return str(get(module="CANN"))
        except Exception:
            pass
    return "unknown"
