"""The one interface every compile backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Callable, ClassVar

from torch import Tensor

from specair.compile.graph_def import GraphDef
from specair.models.errors import SpecairError

CompiledGraph = Callable[..., tuple[Tensor, ...]]


class BackendUnavailable(SpecairError):
    """The backend's package or hardware is missing here."""


class Backend(ABC):
    """Turns GraphDefs into callables ahead of time and persists them in an artifact directory.

    `compile` may write files under `art_dir` (one directory per backend run); `load` must rebuild the
    callable from those files alone, without tracing or compiling. Inputs and outputs are flat tuples
    of torch tensors in the GraphDef's order. Graphs never change what a later step can see: no input is
    mutated, except that a backend may write a step's own K/V into cache slots at or past each row's
    committed length (onnxruntime's fused attention does), which nothing reads before the runtime commits.
    Where such a graph wrote a whole `new_k` / `new_v` output at exactly the slots the runtime commits it
    to (cache_len onwards), it may return None for that output instead; committing None is a no-op.
    """

    name: ClassVar[str]
    device: ClassVar[str] = "cpu"
    # Whether graphs keep functional collectives (all-reduce, all-gather) inside, so a tensor-parallel shard
    # runs on this backend; if not, why not.
    tensor_parallel: ClassVar[bool] = True
    tensor_parallel_why: ClassVar[str] = ""
    # Whether graphs take KV caches of any slot count (at least their context bucket plus the spare slots),
    # so the runtime sizes caches by the context in use; else every cache has the plan's full slot count.
    any_cache_length: ClassVar[bool] = False

    @property
    def row_independent(self) -> bool:
        """Whether every float32 graph at batch 1 computes each of its token rows bit for bit as a one-token
        graph computes it (linear layers and attention alike), so a verify pass scores each token exactly as a
        decode step would and greedy speculation cannot change the output."""
        return False

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads

    @classmethod
    def check_available(cls) -> None:
        """Raise BackendUnavailable with a message naming what is missing."""

    @abstractmethod
    def compile(self, graph: GraphDef, art_dir: Path) -> CompiledGraph:
        """Compile graph for its example shapes; persist what `load` needs under art_dir."""

    @abstractmethod
    def load(self, graph: GraphDef, art_dir: Path) -> CompiledGraph:
        """The compiled graph from art_dir, without tracing or compiling again."""

    def begin(self, art_dir: Path, loading: bool) -> None:
        """Called once before a batch of compile or load calls (e.g. to restore compiler caches)."""

    def end(self, art_dir: Path) -> None:
        """Called once after all graphs were compiled (e.g. to save compiler caches)."""

    # versions() entries that only artifacts built with them depend on (artifacts without them load anywhere)
    optional_versions: frozenset[str] = frozenset()

    def versions(self) -> dict[str, str]:
        """Library versions an artifact from this backend depends on (recorded in the manifest)."""
        import torch

        return {"torch": torch.__version__}
