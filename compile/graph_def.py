"""A graph as backends see it: a module whose forward takes and returns flat tuples of tensors, plus
example inputs that fix every shape. Backends never learn what the graph computes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn


class GraphModule(nn.Module):
    """Wraps a pure graph function with its static arguments bound. The wrapped models are submodules,
    so every graph shares the same parameter tensors and names (`target.*`, `draft.*`)."""

    def __init__(self, fn: Callable[..., Any], models: dict[str, nn.Module], static: dict[str, Any]) -> None:
        super().__init__()
        self.fn, self.static = fn, static
        self.models = nn.ModuleDict(models)

    def forward(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        out = self.fn(*self.models.values(), *inputs, **self.static)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)


@dataclass
class GraphDef:
    """One graph at one bucket: what every backend compiles, saves and loads."""

    key: str  # unique and filesystem-safe, e.g. "verify.b1.c128"
    module: GraphModule
    example_inputs: tuple[Tensor, ...]
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]

    def eager(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        with torch.inference_mode():
            return self.module(*inputs)
