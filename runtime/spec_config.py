"""`--speculative-config`: vLLM's key names, validated up front with messages that say what is accepted."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from specair.models.errors import InputError

METHODS = ("draft_model", "layer_skip")
ACCEPTANCE = ("rejection", "greedy", "typical")
SCORERS = ("tree", "batch_expansion")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How to speculate: proposer, lookahead, tree, acceptance method."""

    method: str
    num_speculative_tokens: int
    model: str | None = None  # draft_model: path of the draft checkpoint
    num_layers: int | None = None  # layer_skip: target layers the draft keeps
    tree: Any = None  # None/"chain", "kary:DxW", "mc_sim_7b_63", "topk:KxN", or a Medusa choice list
    acceptance: str = "rejection"  # exact; reduces to greedy matching at temperature 0
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3
    scorer: str = "tree"

    @classmethod
    def parse(cls, spec: str | dict[str, Any]) -> "SpeculativeConfig":
        """Parse a JSON string or dict; raise InputError naming any unknown key or bad value."""
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise InputError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(spec, dict):
            raise InputError("--speculative-config must be a JSON object")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(spec) - known)
        if unknown:
            raise InputError(f"unknown speculative-config key(s) {unknown}; known: {sorted(known)}")
        if spec.get("method") not in METHODS:
            raise InputError(f"speculative-config 'method' must be one of {METHODS}, got {spec.get('method')!r}")
        k = spec.get("num_speculative_tokens")
        if not isinstance(k, int) or not 1 <= k <= 16:
            raise InputError(f"'num_speculative_tokens' must be an integer in 1..16, got {k!r}")
        if spec["method"] == "draft_model" and not isinstance(spec.get("model"), str):
            raise InputError("method 'draft_model' needs 'model': the path of a draft checkpoint")
        if spec["method"] == "layer_skip" and not (isinstance(spec.get("num_layers"), int) and spec["num_layers"] > 0):
            raise InputError("method 'layer_skip' needs 'num_layers': how many target layers the draft keeps")
        if spec.get("acceptance", "rejection") not in ACCEPTANCE:
            raise InputError(f"'acceptance' must be one of {ACCEPTANCE}, got {spec.get('acceptance')!r}")
        if spec.get("scorer", "tree") not in SCORERS:
            raise InputError(f"'scorer' must be one of {SCORERS}, got {spec.get('scorer')!r}")
        for key in ("posterior_threshold", "posterior_alpha"):
            if key in spec and not (isinstance(spec[key], (int, float)) and spec[key] > 0):
                raise InputError(f"'{key}' must be a positive number")
        return cls(**spec)
