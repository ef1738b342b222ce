"""`--speculative-config`: vLLM's key names, validated up front with messages that say what is accepted.

The checks here are the ones every method shares; each proposer (runtime/proposers) adds its own and
owns the list of method names."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from specair.graphs.tree import TreeTemplate, get_template
from specair.models.errors import InputError

ACCEPTANCE = ("exact", "greedy", "typical")
SCORERS = ("tree", "batch_expansion")


def config_dict(spec: str | dict[str, Any]) -> dict[str, Any]:
    """A speculative config given as JSON text or a dict, as a dict (InputError otherwise)."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise InputError(f"--speculative-config is not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise InputError("--speculative-config must be a JSON object")
    return spec


@dataclass(frozen=True)
class SpeculativeConfig:
    """How to speculate: proposer, lookahead, tree, acceptance method."""

    method: str
    num_speculative_tokens: int
    model: str | None = None  # the draft checkpoint, or a head's
    num_layers: int | None = None  # target layers a layer-skip draft keeps
    tree: Any = None  # None/"chain", "kary:DxW", "mc_sim_7b_63", "topk:KxN", or a Medusa choice list
    acceptance: str = "exact"  # the target's own sample decides every position; greedy matching at temperature 0
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3
    scorer: str = "tree"
    disable_by_batch_size: int | None = None  # plain decode steps while more sequences than this are running
    adaptive: bool = False  # greedy steps: plain decoding or one of the shapes, whichever recently emitted more tokens/s
    # Further speculative shapes compiled beside the main one, each {"num_speculative_tokens", "tree"}, for
    # `adaptive` to choose among; the main shape stays the one sampled steps run.
    shapes: Any = ()
    prompt_lookup_min: int | None = None  # prompt lookup: shortest suffix to match
    prompt_lookup_max: int | None = None  # prompt lookup: longest suffix to match

    @classmethod
    def parse(cls, spec: str | dict[str, Any]) -> "SpeculativeConfig":
        """Parse a JSON string or dict with the checks every method shares; raise InputError naming any
        unknown key or bad value (`runtime.proposers.parse_config` adds the method's own checks)."""
        spec = config_dict(spec)
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(spec) - known)
        if unknown:
            raise InputError(f"unknown speculative-config key(s) {unknown}; known: {sorted(known)}")
        if not isinstance(spec.get("method"), str) or not spec["method"]:
            raise InputError(f"speculative-config 'method' must name a proposer, got {spec.get('method')!r}")
        k = spec.get("num_speculative_tokens")
        if not isinstance(k, int) or not 1 <= k <= 16:
            raise InputError(f"'num_speculative_tokens' must be an integer in 1..16, got {k!r}")
        if spec.get("acceptance") == "rejection":
            raise InputError("acceptance 'rejection' is now 'exact': the target samples every position from "
                             "that position's seeded uniform and a draft token is accepted when it matches")
        if spec.get("acceptance", "exact") not in ACCEPTANCE:
            raise InputError(f"'acceptance' must be one of {ACCEPTANCE}, got {spec.get('acceptance')!r}")
        if spec.get("scorer", "tree") not in SCORERS:
            raise InputError(f"'scorer' must be one of {SCORERS}, got {spec.get('scorer')!r}")
        for key in ("disable_by_batch_size", "prompt_lookup_min", "prompt_lookup_max"):
            if spec.get(key) is not None and not (isinstance(spec[key], int) and spec[key] >= 1):
                raise InputError(f"'{key}' must be a positive integer, got {spec[key]!r}")
        if not isinstance(spec.get("adaptive", False), bool):
            raise InputError(f"'adaptive' must be true or false, got {spec['adaptive']!r}")
        for key in ("posterior_threshold", "posterior_alpha"):
            if key in spec and not (isinstance(spec[key], (int, float)) and spec[key] > 0):
                raise InputError(f"'{key}' must be a positive number")
        shapes = spec.get("shapes", ())
        if not isinstance(shapes, (list, tuple)) or not all(isinstance(x, dict) for x in shapes):
            raise InputError("'shapes' must be a list of objects with 'num_speculative_tokens' and/or 'tree'")
        if shapes and not spec.get("adaptive"):
            raise InputError("'shapes' gives the adaptive choice more shapes: it needs \"adaptive\": true")
        for x in shapes:
            if not x or set(x) - {"num_speculative_tokens", "tree"}:
                raise InputError(f"each of 'shapes' sets 'num_speculative_tokens' and/or 'tree' only, got {x}")
        config = cls(**{**spec, "shapes": tuple(dict(x) for x in shapes)})
        configs = config.shape_configs()
        for c in configs[1:]:
            cls.parse(dataclasses.asdict(c))  # each shape passes the main config's checks
        trees = [tree_shape(c) for c in configs]  # validate the trees now, not at the first step
        if len(set(map(repr, trees))) != len(trees):
            raise InputError("'shapes' repeats a shape")
        return config

    def shape_configs(self) -> list["SpeculativeConfig"]:
        """The main config, then one per entry of `shapes` (the main one with that lookahead and tree)."""
        return [self] + [dataclasses.replace(self, shapes=(), adaptive=False, **x) for x in self.shapes]


@dataclass(frozen=True)
class TreeShape:
    """The static shape of a speculative step's tree, resolved from a config's `tree` and lookahead."""

    kind: str  # "chain" (sampled draft chain), "static" (a template filled with top-k), "topk" (per-row dynamic)
    depth: int  # D: draft tokens on the longest path
    num_nodes: int  # T: nodes including the root
    max_width: int  # W: most children of one node
    template: TreeTemplate | None = None
    topk: int = 0  # K candidates per expansion ("topk" trees)

    @property
    def dynamic(self) -> bool:
        """Whether trees of this shape differ per row (the proposer returns their parents)."""
        return self.kind == "topk"


def tree_shape(config: SpeculativeConfig) -> TreeShape:
    """Resolve and validate the tree of a speculative config (raises InputError)."""
    k, tree = config.num_speculative_tokens, config.tree
    if isinstance(tree, str) and tree.startswith("topk:"):
        try:
            K, N = (int(x) for x in tree.split(":", 1)[1].lower().split("x"))
        except ValueError:
            raise InputError(f"tree {tree!r}: expected 'topk:KxN', e.g. 'topk:4x16'") from None
        created = K + (k - 1) * K * K
        if K < 1 or not 1 <= N <= created:
            raise InputError(f"tree {tree!r} keeps {N} nodes but creates only {created} at depth {k}")
        if config.scorer != "tree":
            raise InputError("the batch-expansion scorer needs a static tree, not a per-row topk tree")
        return TreeShape("topk", k, N + 1, K, topk=K)
    try:
        template = get_template(tree, k)
    except ValueError as e:
        raise InputError(str(e)) from None
    if template.max_depth != k:
        raise InputError(f"tree {tree!r} has depth {template.max_depth}; "
                         f"set num_speculative_tokens to {template.max_depth}")
    kind = "chain" if template.max_width == 1 else "static"
    return TreeShape(kind, k, template.num_nodes, template.max_width, template=template)
