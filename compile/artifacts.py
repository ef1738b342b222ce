"""Artifact directories: every compiled graph of a plan plus `manifest.json`, and the GraphSet that
serves them by key.

The manifest records what the artifacts were built from (model, draft and tokenizer fingerprints),
by what (backend, device, library versions) and for which shapes (the plan). Loading refuses any
mismatch with a message that says how to recompile.
"""

from __future__ import annotations

import functools
import hashlib
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Collection

import torch
from torch import Tensor
from tqdm import tqdm

from specair import __version__
from specair.compile.backends.base import Backend, CompiledGraph
from specair.compile.catalog import Catalog
from specair.compile.graph_def import GraphKey
from specair.compile.plan import Plan
from specair.models.errors import InputError, ModelFormatError, SpecairError

MANIFEST = "manifest.json"
FORMAT = 1


class ArtifactError(SpecairError):
    """An artifact directory is missing, corrupt, or was built for something else."""


def tokenizer_fingerprint(tokenizer: Any) -> str | None:
    if tokenizer is None:
        return None
    return hashlib.sha256(tokenizer.backend.to_str().encode()).hexdigest()


_SOURCES = (".py", ".cpp", ".h")  # the int4 kernel's C++ too


@functools.cache
def source_digest() -> str:
    """A digest of the code that decides what a graph computes (models, graphs, compile), so artifacts built
    by other code under the same version number are stale, not silently reused."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    sources = (p for d in ("models", "graphs", "compile") for p in (root / d).rglob("*") if p.suffix in _SOURCES)
    for path in sorted(sources):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def versions(backend: Backend) -> dict[str, str]:
    return {"specair": __version__, "specair_source": source_digest(), "python": platform.python_version(),
            **backend.versions()}


def quantization(backend: Backend) -> dict[str, Any] | None:
    """The backend's weight quantization as the manifest records it (None: float weights)."""
    q = getattr(backend, "quantization", None)
    return q.to_json() if q is not None else None


def _quantization_name(q: Any) -> str:
    return "none" if q is None else str(q.get("method", q)) if isinstance(q, dict) else str(q)


class GraphSet:
    """Compiled graphs by `GraphKey`, called with named inputs and returning named outputs. Without
    artifacts (`lazy`), a missing graph is compiled on first use with a visible note; from an artifact
    directory, a key outside the plan is an error, never a compile.

    Static-buffer backends (CUDA graphs, aclgraph) capture against the tensors the runtime binds with
    `bind` (its KV caches) before the first graph is built, so no call copies a cache.
    """

    def __init__(self, catalog: Catalog, backend: Backend, art_dir: Path | None, lazy: bool,
                 note: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr, flush=True)) -> None:
        self.catalog, self.backend, self.art_dir, self.lazy, self.note = catalog, backend, art_dir, lazy, note
        catalog.meta_example_caches = backend.any_cache_length  # its graphs fix no cache shape to trace
        self.fns: dict[GraphKey, CompiledGraph] = {}
        self._pending: set[GraphKey] = set()  # artifacts checked but not loaded yet (see `prepare`)
        self.timings: dict[str, list[float]] | None = None  # kind -> [seconds, calls] while profiling
        self.observer: Callable[[GraphKey], None] | None = None  # told of every call, before it runs

    @property
    def plan(self) -> Plan:
        return self.catalog.plan

    @property
    def device(self) -> torch.device:
        return self.catalog.device

    @property
    def any_cache_length(self) -> bool:
        """Whether graphs take caches sized by the context in use (see Backend.any_cache_length)."""
        return self.backend.any_cache_length and not self.static_buffers

    @property
    def static_buffers(self) -> bool:
        """Whether the backend captures graphs on bound buffers (and so wants persistent caches)."""
        return hasattr(self.backend, "bind_static")

    def bind(self, name: str, tensor: Tensor, role: str, key: GraphKey | None = None) -> None:
        """Hand a persistent tensor (a KV cache) to a static-buffer backend for every graph input `name`
        of the graphs that read the model of `role` (of graph `key` only, if given); a no-op elsewhere."""
        if self.static_buffers:
            self.backend.bind_static(name, tensor, model=role, graph_key=None if key is None else key.name)

    def prepare(self) -> None:
        """Called once the runtime bound its buffers. Static-buffer backends load (capture) every checked
        artifact now; others load each graph when it is first called, so a run pays only for the buckets it
        reaches (an onnxruntime session pre-packs its weights when it is made: ~1 s per graph)."""
        if self.static_buffers:
            self.load_pending()

    def load_pending(self, variants: Collection[str] | None = None) -> int:
        """Load every checked artifact not loaded yet, or only those of the given sampling `variants` (and
        graphs that do not sample), so no load lands inside a timed request; returns how many loaded."""
        keys = [k for k in self._pending if variants is None or k.variant in ("", *variants)]
        for key in sorted(keys, key=lambda k: k.name):
            self._load(key)
        return len(keys)

    def _load(self, key: GraphKey) -> CompiledGraph:
        try:
            fn = self.fns[key] = self.backend.load(self.catalog.graph(key), self.art_dir)
        except (OSError, RuntimeError, ValueError, ModelFormatError) as e:
            raise ArtifactError(f"artifact {key} in {self.art_dir} cannot be loaded ({type(e).__name__}: "
                                f"{str(e)[:200]}); recompile with: {self._hint}") from None
        self._pending.discard(key)
        return fn

    def __call__(self, key: GraphKey, **inputs: Tensor) -> dict[str, Tensor]:
        fn = self.fns.get(key)
        if fn is None and key in self._pending:
            fn = self._load(key)
        if fn is None:
            if not self.lazy:
                raise ArtifactError(f"graph {key} is not in the compiled plan of {self.art_dir}; recompile with "
                                    f"buckets that cover it (specair compile … --out {self.art_dir})")
            if self.backend.name != "eager":
                self.note(f"specair: compiling {key} with {self.backend.name} (use `specair compile` to do this "
                          f"ahead of time)")
            fn = self.fns[key] = self.backend.compile(self.catalog.graph(key), self._scratch())
        graph = self.catalog.graph(key)
        if inputs.keys() != set(graph.input_names):
            missing = [n for n in graph.input_names if n not in inputs]
            extra = sorted(set(inputs) - set(graph.input_names))
            raise InputError(f"graph {key} takes inputs {list(graph.input_names)}; missing {missing}, "
                             f"unexpected {extra}")
        if self.observer is not None:
            self.observer(key)
        t = time.perf_counter() if self.timings is not None else 0.0
        out = fn(*(inputs[n] for n in graph.input_names))
        if self.timings is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            acc = self.timings.setdefault(key.kind, [0.0, 0])
            acc[0] += time.perf_counter() - t
            acc[1] += 1
        return dict(zip(graph.output_names, out))

    def _scratch(self) -> Path:
        """Where graphs compiled on first use keep their files: removed with this GraphSet."""
        if self.art_dir is None:
            import tempfile

            self._tmp = tempfile.TemporaryDirectory(prefix=f"specair-{self.backend.name}-")
            self.art_dir = Path(self._tmp.name)
        return self.art_dir


def compile_artifacts(catalog: Catalog, backend: Backend, out_dir: Path, fingerprints: dict[str, Any],
                      progress: bool = True) -> GraphSet:
    """Compile every graph of the catalog's plan into out_dir and write its manifest (last, so a
    directory without one is never mistaken for a finished build)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MANIFEST).unlink(missing_ok=True)
    backend.begin(out_dir, loading=False)
    graphs = GraphSet(catalog, backend, out_dir, lazy=False)
    keys = catalog.keys()
    times: dict[str, float] = {}
    for key in tqdm(keys, desc=f"compiling ({backend.name})", file=sys.stderr, disable=not progress):
        t = time.perf_counter()
        graphs.fns[key] = backend.compile(catalog.graph(key), out_dir)
        times[key.name] = round(time.perf_counter() - t, 3)
    backend.end(out_dir)
    manifest = {
        "format": FORMAT, "backend": backend.name, "device": backend.device, "versions": versions(backend),
        "quantization": quantization(backend), "fingerprints": fingerprints, "plan": catalog.plan.to_json(),
        "graphs": [k.name for k in keys], "compile_seconds": times,
    }
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return graphs


def read_manifest(art_dir: Path) -> dict[str, Any]:
    """The manifest of an artifact directory, checked for shape (not yet against a model)."""
    path = Path(art_dir) / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{art_dir} has no {MANIFEST}: not a (finished) specair artifact directory; "
                            f"build one with `specair compile --backend … --out {art_dir}`")
    try:
        manifest = json.loads(path.read_text())
        if manifest.get("format") != FORMAT:
            raise ArtifactError(f"{path} has format {manifest.get('format')!r}; this specair reads format {FORMAT}")
        Plan.from_json(manifest["plan"])
        manifest["backend"], manifest["fingerprints"], manifest["graphs"]  # noqa: B018 (presence check)
    except ArtifactError:
        raise
    except (ValueError, KeyError, TypeError, SpecairError) as e:
        raise ArtifactError(f"{path} is corrupt ({type(e).__name__}: {e}); recompile with `specair compile`") from None
    return manifest


def version_problems(backend: Backend, built: dict[str, str]) -> list[str]:
    """Why artifacts built with the library versions `built` cannot run on `backend` here (empty: they can)."""
    have, problems = versions(backend), []
    for lib in sorted(set(have) | set(built)):
        optional_and_unused = lib in backend.optional_versions and lib not in built
        if lib == "python" or optional_and_unused or built.get(lib) == have.get(lib):
            continue
        problems.append(f"{lib} is {have[lib]} but they were built with {built.get(lib)}" if lib in have else
                        f"they were built with {lib} {built[lib]}, which this process does not have")
    return problems


def load_artifacts(catalog: Catalog, backend: Backend, art_dir: Path, manifest: dict[str, Any],
                   fingerprints: dict[str, Any], recompile_hint: str) -> GraphSet:
    """The compiled graphs of a checked manifest, loaded (without tracing or compiling) by
    `GraphSet.prepare` once the runtime has bound its persistent buffers."""
    problems = []
    if manifest["backend"] != backend.name:
        problems.append(f"they were compiled for backend {manifest['backend']!r}, not {backend.name!r}")
    built_q, have_q = manifest.get("quantization"), quantization(backend)
    if built_q != have_q:
        built, have = _quantization_name(built_q), _quantization_name(have_q)
        problems.append(f"they were compiled with quantization {built!r}, not {have!r}"
                        + (f" (scheme {built_q} vs {have_q})" if built == have else ""))
    for name, value in fingerprints.items():
        if manifest["fingerprints"].get(name) != value:
            problems.append(f"the {name} differs (artifacts: {str(manifest['fingerprints'].get(name))[:16]}…, "
                            f"given: {str(value)[:16]}…)")
    problems += version_problems(backend, manifest.get("versions", {}))
    if problems:
        raise ArtifactError(f"cannot use the artifacts in {art_dir}: " + "; ".join(problems) +
                            f". Recompile with: {recompile_hint}")
    keys = catalog.keys()
    if [k.name for k in keys] != list(manifest["graphs"]):
        missing = sorted(set(k.name for k in keys) - set(manifest["graphs"]))
        raise ArtifactError(f"the artifacts in {art_dir} do not hold this plan's graphs (missing {missing[:4]}"
                            f"{' …' if len(missing) > 4 else ''}); recompile with: {recompile_hint}")
    backend.begin(art_dir, loading=True)
    graphs = GraphSet(catalog, backend, art_dir, lazy=False)
    graphs._pending, graphs._hint = set(keys), recompile_hint
    return graphs
