"""AOTInductor: `torch.export` + AOTInductor → one `.pt2` package per graph and bucket.

Compile: export the graph with static shapes, have AOTInductor generate and build a shared library,
and package it as `<key>.pt2` WITHOUT its weights. Every graph of a model pair (all buckets, all graph
kinds) uses the same parameters (`models.target.*`, `models.draft.*`); embedding them would copy the
whole model into every package. So compile sets

    aot_inductor.package_constants_in_so = False          (torch/_inductor/config.py)
    aot_inductor.package_constants_on_disk_format = "pickle_weights"

The first leaves the weight blob of the .so empty (codecache.py: `serialized_weights = b""` unless
`package_constants_in_so` or "binary_blob"); the second makes `aot_compile` hand back a `Weights`
object (name → tensor) instead of writing them anywhere. That object is NOT packaged: the constants
the live module provides (parameters and buffers, by FQN) are taken from the module at load time;
the few the graph itself creates (index tensors of tree templates, constants Inductor folds) are
small and go to a sidecar `<key>.aoti.pt`, with the expected shape/stride/dtype of every constant.

Load: open the package with `AOTIModelPackageLoader` and hand it every constant with
`load_constants(..., check_full_update=True, user_managed=True)`: user-managed constants are stored
as aliases of the caller's tensors, not copied (aoti_runtime/model_container.h:
`update_constant_buffer` → `MaybeOwningAtenTensorHandle(tensor, /* user_managed = */ true)`), so N
loaded graphs share the model's one copy of the weights, and in-place updates of a parameter
(`p.copy_(...)`) are seen by every graph. Replacing a parameter object needs a reload.

Loading never traces or compiles. `torch._inductor.aoti_load_package` is avoided on purpose: its
`load_pt2` → `_load_aoti` → `get_device_information` → `pick_vec_isa()` test-compiles ISA probes with
g++ and spawns a Python child per ISA (about 2 s per process, only to log a mismatch warning;
pytorch issue #191715). The loader class it ends up constructing is used directly instead, and the
CPU-ISA check is done from the package metadata (`AOTI_CPU_ISA`) against cpuinfo, without a compiler.

No `TORCHINDUCTOR_FREEZING`: freezing folds weights into the graph as package constants, which would
defeat the sharing above.

Packages are content-addressed: what a package holds follows from the exported program (its code, the
names, shapes and strides of the constants it takes, the values of those it owns), the input shapes,
the Inductor options and the torch version and CPU ISA, so a digest of those names it, and a graph whose
digest was compiled before (another bucket's identical graph, a draft's prompt-prefill and catch-up
graphs at batch 1, the same target graphs under another proposer's plan) is copied from
`<specair cache>/aoti-packages/<digest>/` instead of built again (export still runs: a few seconds).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specair.compile.backends.base import Backend, BackendUnavailable, CompiledGraph
from specair.compile.graph_def import GraphDef

SIDECAR_FORMAT = 1


def _package_cache() -> Path:
    from specair.models.default_model import cache_dir

    return cache_dir() / "aoti-packages"


def _cxx_candidates() -> list[str]:
    """The C++ compilers Inductor would try, in its order (torch/_inductor/cpp_builder.get_cpp_compiler:
    config.cpp.cxx, i.e. $CXX or g++; clang++ on macOS)."""
    from torch._inductor import config

    cxx = config.cpp.cxx
    names = list(cxx) if isinstance(cxx, (list, tuple)) else [cxx]
    return [n for n in names if n]


def _find_cxx() -> str | None:
    for name in _cxx_candidates():
        path = shutil.which(name)
        if path:
            return path
    return None


def _cxx_version(path: str) -> str:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.splitlines()[0].strip() if out else "unknown"


def _cpu_isa_ok(package_isa: str) -> bool:
    """Whether this CPU runs code built for `package_isa` (AOTI_CPU_ISA metadata, e.g. "AVX512 AVX512_VNNI").
    Uses cpuinfo (no compiler), unlike Inductor's pick_vec_isa()."""
    checks = {  # the names torch/_inductor/cpu_vec_isa.py gives its VecISA classes
        "AVX2": getattr(torch.cpu, "_is_avx2_supported", None),
        "AVX512": getattr(torch.cpu, "_is_avx512_supported", None),
        "AVX512_VNNI": getattr(torch.cpu, "_is_vnni_supported", None),
        "AMX_TILE": getattr(torch.cpu, "_is_amx_tile_supported", None),
    }
    for flag in package_isa.upper().split():
        check = checks.get(flag)
        if check is not None and not check():
            return False
    return True


def _spec(t: Tensor) -> dict[str, Any]:
    return {"shape": list(t.shape), "stride": list(t.stride()), "dtype": str(t.dtype).removeprefix("torch."),
            "device": t.device.type}


def _strides_match(t: Tensor, spec: dict[str, Any]) -> bool:
    # A dimension of size 1 is never stepped over, so its stride does not matter.
    return all(n == 1 or s == e for n, s, e in zip(t.shape, t.stride(), spec["stride"]))


def _matches(t: Tensor, spec: dict[str, Any]) -> bool:
    return (list(t.shape) == spec["shape"] and str(t.dtype).removeprefix("torch.") == spec["dtype"]
            and t.device.type == spec["device"] and _strides_match(t, spec))


def _module_tensors(graph: GraphDef) -> dict[str, Tensor]:
    """The live module's parameters and buffers (non-persistent ones too) by fully qualified name."""
    named = dict(graph.module.named_parameters(remove_duplicate=False))
    named.update(graph.module.named_buffers(remove_duplicate=False))
    return named


class AotiGraph:
    """A loaded package: call with the flat inputs, get a tuple of tensors.

    Checks each input's shape, dtype and stride against the compiled ones (AOTInductor itself only does
    that with AOTI_RUNTIME_CHECK_INPUTS=1 and otherwise reads out of bounds), then runs the library.
    """

    def __init__(self, key: str, runner: Any, inputs: list[dict[str, Any]], input_names: tuple[str, ...],
                 keep_alive: dict[str, Tensor]) -> None:
        self.key, self.runner, self.inputs, self.input_names = key, runner, inputs, input_names
        self._run = runner.loader.boxed_run
        self._keep_alive = keep_alive  # the constants the library aliases (user-managed)
        # Fast path of the per-call check: exact (shape, stride, dtype, device type) as compiled.
        self._fast = [(torch.Size(s["shape"]), tuple(s["stride"]), getattr(torch, s["dtype"]), s["device"])
                      for s in inputs]

    def __call__(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        if len(inputs) != len(self._fast):
            raise ValueError(f"graph {self.key} takes {len(self._fast)} inputs, got {len(inputs)}")
        for i, (t, (shape, stride, dtype, device)) in enumerate(zip(inputs, self._fast)):
            if t.shape != shape or t.dtype != dtype or t.stride() != stride or t.device.type != device:
                self._check(i, t)
        return tuple(self._run(list(inputs)))

    def _check(self, i: int, t: Tensor) -> None:
        spec = self.inputs[i]
        if not _matches(t, spec):
            name = self.input_names[i] if i < len(self.input_names) else f"#{i}"
            raise ValueError(f"graph {self.key}: input {name} is {_spec(t)}, compiled for {spec} "
                             f"(static shapes: pick the bucket that matches, or pass contiguous tensors)")

    def constant_fqns(self) -> list[str]:
        return list(self.runner.get_constant_fqns())

    def metadata(self) -> dict[str, str]:
        return dict(self.runner.get_metadata())


class AotiBackend(Backend):
    name = "aoti"
    tensor_parallel = False
    tensor_parallel_why = ("an AOTInductor package's collective never completed beside a worker's (seen with torch "
                           "2.13 on gloo: the first graph's wait_tensor timed out)")

    def __init__(self, threads: int | None = None, inductor_configs: dict[str, Any] | None = None) -> None:
        super().__init__(threads)
        self.inductor_configs = dict(inductor_configs or {})

    # -- availability and versions ---------------------------------------------------------------
    @classmethod
    def check_available(cls) -> None:
        if not hasattr(torch._C, "_aoti") or not hasattr(torch._C._aoti, "AOTIModelPackageLoader"):
            raise BackendUnavailable(f"backend 'aoti': this torch build ({torch.__version__}) has no AOTInductor "
                                     "runtime (torch._C._aoti)")
        if _find_cxx() is None:
            tried = ", ".join(_cxx_candidates()) or "none configured"
            raise BackendUnavailable(f"backend 'aoti' needs a C++ compiler to build its packages and none was found "
                                     f"on PATH (tried: {tried}); install g++ (e.g. `apt-get install g++`) or set "
                                     f"CXX to one")

    def versions(self) -> dict[str, str]:
        # Compared exactly at load (compile/artifacts.load_artifacts). A package links against this
        # torch's libtorch and its kernels are built for this CPU's vector ISA (-march=native), so both
        # are recorded. The compiler is not: loading never runs it, so serving hosts need not have the
        # same one; it is recorded in every package's metadata instead (`specair_cxx`).
        return {"torch": torch.__version__, "aoti_cpu": torch.backends.cpu.get_cpu_capability()}

    # -- compile ---------------------------------------------------------------------------------
    def _options(self) -> dict[str, Any]:
        cxx = _find_cxx()
        opts: dict[str, Any] = {
            "aot_inductor.package": True,
            "aot_inductor.package_constants_in_so": False,
            "aot_inductor.package_constants_on_disk_format": "pickle_weights",
            "aot_inductor.metadata": {"specair_cxx": _cxx_version(cxx) if cxx else "none",
                                      "specair_torch": torch.__version__},
        }
        if self.threads:
            opts["cpp.threads"] = int(self.threads)
        opts.update(self.inductor_configs)
        return opts

    def compile(self, graph: GraphDef, art_dir: Path) -> CompiledGraph:
        from torch._inductor.package import package_aoti
        from torch.export.pt2_archive._package_weights import Weights

        self.check_available()
        art_dir = Path(art_dir)
        art_dir.mkdir(parents=True, exist_ok=True)
        inputs = tuple(graph.example_inputs)
        # Run once eagerly first: graph code may build and cache tensors on first use (tree template
        # buffers are lru-cached); built under export's fake mode, the cache would hold fake tensors.
        with torch.no_grad():
            graph.module(*inputs)
        ep = torch.export.export(graph.module, inputs, strict=False)
        try:
            gm = ep.module(check_guards=False)  # what aoti_compile_and_package compiles
        except TypeError:
            gm = ep.module()
        pt2, side = self._paths(graph, art_dir)
        cached = _package_cache() / self._digest(ep, inputs)
        if (cached / "graph.pt2").is_file() and (cached / "graph.aoti.pt").is_file():
            sidecar = torch.load(cached / "graph.aoti.pt", map_location="cpu", weights_only=True)
            sidecar.update(key=graph.key, input_names=list(graph.input_names), output_names=list(graph.output_names))
            self._write(art_dir, graph.key, pt2, side, lambda p: shutil.copyfile(cached / "graph.pt2", p), sidecar)
            return self.load(graph, art_dir)
        files = torch._inductor.aot_compile(gm, *ep.example_inputs, options=self._options())
        weights = [f for f in files if isinstance(f, Weights)]
        files = [f for f in files if not isinstance(f, Weights)]

        module = _module_tensors(graph)
        constants: dict[str, dict[str, Any]] = {}
        owned: dict[str, Tensor] = {}
        for w in weights:
            for fqn, (value, _props) in w.items():
                spec, live = _spec(value), module.get(fqn)
                if live is None:  # created by the graph or by Inductor: small, kept with the package
                    constants[fqn] = {**spec, "source": "package"}
                    owned[fqn] = value.detach().cpu()
                elif _matches(live, spec):  # a model weight: taken from the live model at load
                    constants[fqn] = {**spec, "source": "module"}
                else:
                    raise ValueError(f"graph {graph.key}: the compiled code expects {fqn} as {spec} but the model "
                                     f"holds {_spec(live)}; it could not be shared")
        sidecar = {"format": SIDECAR_FORMAT, "key": graph.key, "inputs": [_spec(t) for t in inputs],
                   "input_names": list(graph.input_names), "output_names": list(graph.output_names),
                   "constants": constants, "tensors": owned}

        self._write(art_dir, graph.key, pt2, side, lambda p: package_aoti(str(p), files), sidecar)
        try:  # into the package cache too; a cache that cannot be written only costs later compiles
            cached.mkdir(parents=True, exist_ok=True)
            self._write(cached, graph.key, cached / "graph.pt2", cached / "graph.aoti.pt",
                        lambda p: shutil.copyfile(pt2, p), sidecar)
        except OSError:
            pass
        del weights, ep
        return self.load(graph, art_dir)

    @staticmethod
    def _write(parent: Path, key: str, pt2: Path, side: Path, make_pt2: Any, sidecar: dict[str, Any]) -> None:
        """Write a package and its sidecar under their final names in a scratch dir, then move them, the package
        last: an interrupted compile never leaves a half-written package behind."""
        scratch = Path(tempfile.mkdtemp(prefix=f".partial-{key}-", dir=parent))
        try:
            make_pt2(scratch / pt2.name)
            torch.save(sidecar, scratch / side.name)
            os.replace(scratch / side.name, side)
            os.replace(scratch / pt2.name, pt2)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _digest(self, ep: Any, inputs: tuple[Tensor, ...]) -> str:
        """What the package built from this exported program would hold (see the module doc)."""
        h = hashlib.sha256()
        h.update(json.dumps({"format": SIDECAR_FORMAT, "versions": self.versions(),
                             "inputs": [_spec(t) for t in inputs], "options": repr(sorted(self._options().items()))},
                            sort_keys=True).encode())
        h.update(ep.graph_module.print_readable(print_output=False, include_stride=True, include_device=True).encode())
        h.update(str(ep.graph_signature).encode())
        for name, t in sorted(ep.state_dict.items()):
            h.update(f"{name}:{json.dumps(_spec(t))}".encode())
        for name, c in sorted(ep.constants.items()):
            h.update(name.encode())
            if isinstance(c, Tensor):
                c = c.detach().cpu().contiguous()
                h.update(json.dumps(_spec(c)).encode() + c.view(-1).view(torch.uint8).numpy().tobytes())
            else:
                h.update(repr(c).encode())
        return h.hexdigest()[:32]

    # -- load ------------------------------------------------------------------------------------
    @staticmethod
    def _paths(graph: GraphDef, art_dir: Path) -> tuple[Path, Path]:
        return Path(art_dir) / f"{graph.key}.pt2", Path(art_dir) / f"{graph.key}.aoti.pt"

    @staticmethod
    def _open(path: Path) -> Any:
        """The package's runner, without aoti_load_package's compiler-based ISA probe (see module doc)."""
        from torch.export.pt2_archive._package import AOTICompiledModel

        try:
            loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
        except TypeError:  # a torch whose constructor changed: the public path, probe included
            return torch._inductor.aoti_load_package(str(path))
        return AOTICompiledModel(loader)

    def load(self, graph: GraphDef, art_dir: Path) -> CompiledGraph:
        pt2, side = self._paths(graph, art_dir)
        if not pt2.is_file() or not side.is_file():
            raise FileNotFoundError(f"graph {graph.key}: {pt2.name} or {side.name} missing in {art_dir}")
        meta = torch.load(side, map_location="cpu", weights_only=True)
        if meta.get("format") != SIDECAR_FORMAT:
            raise ValueError(f"{side.name} has format {meta.get('format')!r}, this specair reads {SIDECAR_FORMAT}")
        if len(meta["inputs"]) != len(graph.example_inputs):
            raise ValueError(f"graph {graph.key}: package takes {len(meta['inputs'])} inputs, the graph "
                             f"definition {len(graph.example_inputs)}")

        runner = self._open(pt2)
        info = runner.get_metadata()
        isa = info.get("AOTI_CPU_ISA", "")
        if info.get("AOTI_DEVICE_KEY", "cpu") == "cpu" and not _cpu_isa_ok(isa):
            raise RuntimeError(f"graph {graph.key} was built for CPU ISA {isa!r}, which this CPU lacks")

        module = _module_tensors(graph)
        constants: dict[str, Tensor] = {}
        for fqn in runner.get_constant_fqns():
            spec = meta["constants"].get(fqn)
            if spec is None:
                raise ValueError(f"graph {graph.key}: package constant {fqn!r} is not described in {side.name}")
            if spec["source"] == "package":
                t = meta["tensors"][fqn].to(spec["device"])
            else:
                t = module.get(fqn)
                if t is None:
                    raise ValueError(f"graph {graph.key}: the package needs {fqn!r}, which the model lacks")
                if not _matches(t, spec):
                    raise ValueError(f"graph {graph.key}: {fqn} is {_spec(t)} in the model but {spec} in the "
                                     f"package (a different model?)")
                t = t.detach()  # same storage; the package must not see autograd
            constants[fqn] = t
        if constants:
            runner.load_constants(constants, check_full_update=True, user_managed=True)
        return AotiGraph(graph.key, runner, meta["inputs"], tuple(graph.input_names), constants)
