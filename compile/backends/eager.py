"""The reference backend: the graph modules called directly."""

from __future__ import annotations

from pathlib import Path

from specair.compile.backends.base import Backend, CompiledGraph
from specair.compile.graph_def import GraphDef


class EagerBackend(Backend):
    name = "eager"
    any_cache_length = True  # the graph functions slice the cache to their context bucket themselves

    def compile(self, graph: GraphDef, art_dir: Path) -> CompiledGraph:
        return graph.eager

    def load(self, graph: GraphDef, art_dir: Path) -> CompiledGraph:
        return graph.eager
