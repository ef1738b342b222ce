"""Inductor: torch.compile(fullgraph=True, dynamic=False) per graph and bucket.

Ahead of time means: `specair compile` runs every graph once on its example inputs, which makes
Inductor generate and build its kernels, then saves torch's portable compiler caches
(`torch.compiler.save_cache_artifacts`) into the artifact directory. Loading restores those caches
first, so Inductor's compile is a cache hit; Dynamo still traces each graph once at load (Python
bytecode cannot be cached across processes), which is fast next to code generation. After loading,
any further compile would be a recompile at serving time, so every call runs with
`error_on_recompile`: a shape outside the plan fails loudly instead of compiling silently.
"""

from __future__ import annotations

import itertools
import types
from pathlib import Path

import torch
import torch._dynamo

from specair.compile.backends.base import Backend, CompiledGraph
from specair.compile.graph_def import GraphDef

CACHE_FILE = "inductor_cache.bin"
_ids = itertools.count()


def _own_frame(graph: GraphDef) -> types.MethodType:
    """graph.module.forward under a code object of its own. Dynamo caches compiled graphs per code
    object, and every GraphModule shares one forward: without this, each planned graph would count as
    a recompile of the others."""
    base = type(graph.module).forward
    code = base.__code__.replace(co_name=f"graph_{next(_ids)}")
    fn = types.FunctionType(code, base.__globals__, code.co_name, base.__defaults__, base.__closure__)
    return types.MethodType(fn, graph.module)


class InductorBackend(Backend):
    name = "inductor"

    def _compiled(self, graph: GraphDef) -> CompiledGraph:
        fn = torch.compile(_own_frame(graph), fullgraph=True, dynamic=False)
        with torch.inference_mode():
            fn(*graph.example_inputs)  # trace, generate and build now, not at the first request

        def run(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            with torch.inference_mode(), torch._dynamo.config.patch(error_on_recompile=True):
                return fn(*inputs)

        return run

    def compile(self, graph: GraphDef, art_dir: Path) -> CompiledGraph:
        return self._compiled(graph)

    def load(self, graph: GraphDef, art_dir: Path) -> CompiledGraph:
        return self._compiled(graph)

    def begin(self, art_dir: Path, loading: bool) -> None:
        if loading and (art_dir / CACHE_FILE).exists():
            torch.compiler.load_cache_artifacts((art_dir / CACHE_FILE).read_bytes())

    def end(self, art_dir: Path) -> None:
        saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            (art_dir / CACHE_FILE).write_bytes(saved[0])
