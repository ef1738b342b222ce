"""A graph as backends see it: a module whose forward takes and returns flat tuples of tensors, plus
example inputs that fix every shape. Backends never learn what the graph computes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class GraphKey:
    """Which graph at which bucket: what the runtime dispatches on and artifacts are named by.

    `kind` names the computation ("prefill", "decode", "verify", or a proposer's own kinds); `batch` and
    `ctx` are the batch and context buckets (ctx 0: the graph reads no cache); `method` the acceptance
    method of a verify graph; `variant` the sampling variant; `chunk` the tokens per row of a prefill graph
    smaller than the plan's prefill chunk (0: the plan's, see Plan.chunk_key); `shape` the speculative shape
    of a draft or verify graph (an index into Plan.trees; 0: the main one).
    """

    kind: str
    batch: int
    ctx: int = 0
    method: str = ""
    variant: str = ""
    chunk: int = 0
    shape: int = 0

    @property
    def name(self) -> str:
        """Unique and filesystem-safe, e.g. `verify.b1.c128.exact.filtered`, `prefill.b1.c2048.t32`,
        `verify.b1.c128.s1.greedy`."""
        parts = ([self.kind, f"b{self.batch}"] + ([f"c{self.ctx}"] if self.ctx else [])
                 + ([f"t{self.chunk}"] if self.chunk else []) + ([f"s{self.shape}"] if self.shape else []))
        return ".".join(parts + [p for p in (self.method, self.variant) if p])

    def __str__(self) -> str:
        return self.name


class GraphModule(nn.Module):
    """Wraps a pure graph function with its static arguments bound. The wrapped models are submodules,
    so every graph shares the same parameter tensors and names (`target.*`, `draft.*`). With
    `input_names`, inputs reach the function as keyword arguments of those names (optional inputs stay
    optional); without, positionally."""

    def __init__(self, fn: Callable[..., Any], models: dict[str, nn.Module], static: dict[str, Any],
                 input_names: Sequence[str] | None = None) -> None:
        super().__init__()
        self.fn, self.static = fn, static
        self.input_names = tuple(input_names) if input_names is not None else None
        self.models = nn.ModuleDict(models)

    def forward(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        if self.input_names is None:
            out = self.fn(*self.models.values(), *inputs, **self.static)
        else:
            out = self.fn(*self.models.values(), **dict(zip(self.input_names, inputs)), **self.static)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)


@dataclass
class GraphDef:
    """One graph at one bucket: what every backend compiles, saves and loads."""

    key: str  # unique and filesystem-safe, e.g. "verify.b1.c128" (GraphKey.name for the catalogue's graphs)
    module: GraphModule
    example_inputs: tuple[Tensor, ...]
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]

    def eager(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        with torch.inference_mode():
            return self.module(*inputs)
