"""What every proposer implements, and the registry that maps a `--speculative-config` method to one.

A proposer owns its per-sequence state (`Seq.draft`), declares its graphs to the catalogue, loads its
model, and takes part in three moments of a sequence's life: prefill (beside the target's chunks),
propose (before the verify graph) and after the target's pass (accepted tokens, or a plain decode step).
The engine calls these hooks and never asks which proposer it holds.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, NamedTuple

import torch
from torch import Tensor

from specair.compile.catalog import Catalog, GraphSpec
from specair.compile.graph_def import GraphKey
from specair.compile.plan import Plan
from specair.compile.spec_config import SpeculativeConfig, TreeShape, config_dict, tree_shape
from specair.models.errors import InputError

if TYPE_CHECKING:
    from specair.compile.artifacts import GraphSet
    from specair.runtime.kv_slots import KVSlots
    from specair.runtime.scheduler import Seq

PROPOSERS: dict[str, type["Proposer"]] = {}


def register(cls: type["Proposer"]) -> type["Proposer"]:
    """Class decorator: make a proposer reachable by its `method` name."""
    PROPOSERS[cls.method] = cls
    return cls


def proposer_class(method: Any) -> type["Proposer"]:
    if method not in PROPOSERS:
        raise InputError(f"speculative-config 'method' must be one of {tuple(PROPOSERS)}, got {method!r}")
    return PROPOSERS[method]


def parse_config(spec: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """Parse `--speculative-config` (JSON text or a dict) with the generic checks and the named proposer's
    own; raise InputError naming what is wrong. Heads may omit the lookahead (and tree): their directory
    says what they run with."""
    if spec is None or isinstance(spec, SpeculativeConfig):
        return spec
    raw = config_dict(spec)
    cls = proposer_class(raw.get("method"))
    if "num_speculative_tokens" not in raw:
        raw = {**cls.config_defaults(raw.get("model")), **raw}
    config = SpeculativeConfig.parse(cls.check_config(dict(raw)))
    for c in config.shape_configs():
        cls.check_tree(c, tree_shape(c))
    return config


class Proposal(NamedTuple):
    """A step's proposal on the device: tree tokens [B, T] (node 0 = the root) and per-row parents [B, T]
    (dynamic trees)."""

    tokens: Tensor
    parents: Tensor | None = None


@dataclass
class Step:
    """What a proposer sees of a speculative step over batch bucket B."""

    B: int
    shape: int  # which of the plan's speculative shapes this step runs (an index into Plan.trees)
    tree: TreeShape  # that shape
    rows: list["Seq"]
    ctx: int  # context bucket of the committed prefix
    variant: str  # the step's sampling variant
    sampling: dict[str, Tensor]  # temperature, top_k, top_p [B] on the device
    root: Tensor  # [B] each row's last accepted token (not in the cache yet)
    root_pos: Tensor  # [B] committed length
    uniforms: Tensor  # [B, D]: the uniforms of the positions drafted (a sampled draft reads them)


class Proposer:
    """Base class: a proposer without a model, a cache or graphs of its own. Subclasses override what
    they need; `method` is the `--speculative-config` name."""

    method: ClassVar[str]
    has_cache: ClassVar[bool] = False  # keeps a KV cache of its own, beside the target's (KVSlots role "draft")
    # How the native runner (runtime/native) drives it: "ngram", "cached_draft" or "last_hidden" (None: it cannot).
    native: ClassVar[str | None] = None

    def __init__(self, spec: SpeculativeConfig, plan: Plan, target: Any, draft: Any) -> None:
        draft_vocab = getattr(getattr(draft, "config", draft), "vocab_size", None)  # heads keep it on themselves
        if draft is not None and draft_vocab != target.config.vocab_size:
            raise InputError(f"the draft's vocabulary ({draft_vocab} tokens) differs from the "
                             f"target's ({target.config.vocab_size}); a draft must share the target's tokenizer")
        self.spec, self.plan, self.trees, self.target, self.draft = spec, plan, plan.trees, target, draft
        self.graphs: GraphSet | None = None
        self.kv: KVSlots | None = None

    # ---- configuration and loading (the builder) -------------------------------------------------------

    @classmethod
    def config_defaults(cls, model: str | None) -> dict[str, Any]:
        """Config keys to use when the user gave no lookahead (heads read theirs from their checkpoint)."""
        raise InputError(f"method {cls.method!r} needs 'num_speculative_tokens'")

    @classmethod
    def check_config(cls, raw: dict[str, Any]) -> dict[str, Any]:
        """Method-specific checks of a raw config (InputError); may fill defaults."""
        if raw.get("prompt_lookup_min") is not None or raw.get("prompt_lookup_max") is not None:
            raise InputError(f"'prompt_lookup_min'/'prompt_lookup_max' do not apply to method {cls.method!r}")
        return raw

    @classmethod
    def check_tree(cls, config: SpeculativeConfig, tree: TreeShape) -> None:
        """Refuse tree shapes this proposer cannot fill (InputError); called for each of the config's shapes."""

    @classmethod
    def load(cls, spec: SpeculativeConfig, target: Any, tokenizer: Any, target_path: str | None,
             load_model: Callable[[str], tuple[Any, Any, str]]) -> tuple[Any, str | None]:
        """The proposer's model (None if it has none) and its fingerprint for the artifact manifest, given
        the loaded target and its tokenizer; `load_model(path)` loads a checkpoint in the target's dtype:
        (model, tokenizer, fingerprint)."""
        return None, None

    @classmethod
    def target_view(cls, target: Any, draft: Any) -> Any:
        """The target as this proposer's plan runs it (default: itself); a proposer that reads other target
        features than the final hidden state returns a view that outputs them (sharing the weights)."""
        return target

    # ---- graphs (the catalogue) ---------------------------------------------------------------------

    def graph_keys(self, plan: Plan) -> list[GraphKey]:
        return []

    def draft_key(self, B: int, ctx: int, variant: str, shape: int) -> GraphKey | None:
        """The graph that drafts a step over batch bucket B, context bucket ctx, sampling variant and shape
        (None: proposals are made on the host)."""
        return None

    def build_graph(self, key: GraphKey, catalog: Catalog) -> GraphSpec:
        raise KeyError(f"{self.method} proposer has no graph {key}")

    # ---- the engine's hooks -------------------------------------------------------------------------

    def attach(self, graphs: "GraphSet", kv: "KVSlots") -> None:
        """Called once by the engine: where to run graphs and keep caches."""
        self.graphs, self.kv = graphs, kv

    @property
    def device(self) -> torch.device:
        return self.graphs.device

    def start(self, seq: "Seq") -> None:
        """A sequence starts prefilling: set up `seq.draft`."""
        seq.draft = None

    def prefill_chunk(self, seq: "Seq", tokens: Tensor, start: int, n: int, ctx: int, hidden: Tensor) -> None:
        """Beside a target prefill chunk (tokens [1, chunk] on the device, n real from prompt index `start`;
        hidden [1, chunk, H] the target's states): fill the proposer's own scratch cache."""

    def prefilled(self, seq: "Seq", last_hidden: Tensor) -> None:
        """The prompt is in; last_hidden [H] is the target's state that produced the first token."""

    def can_speculate(self, rows: list["Seq"]) -> bool:
        """Whether this step has something to propose (asked only when the engine would speculate)."""
        return True

    def propose(self, step: Step) -> Proposal:
        raise NotImplementedError

    def accepted(self, rows: list["Seq"], num_accepted: list[int], path_hidden: Tensor) -> None:
        """After a verify step: row i kept num_accepted[i] drafted tokens plus one; path_hidden [B, D+1, H]
        holds the target's states along each accepted path (root first)."""

    def decoded(self, rows: list["Seq"], hidden: Tensor) -> None:
        """After a plain decode step: hidden [B, H] is the target's state that produced each new token."""


def shipped_head(name: str) -> Path:
    """The trained heads shipped for the default model (models/heads/)."""
    from specair import models

    path = Path(models.__file__).parent / "heads" / "smollm2-135m-instruct" / name
    if not path.exists():
        raise InputError(f"no shipped {name} heads at {path}; pass 'model' in --speculative-config")
    return path


def file_fingerprint(path: Path) -> str:
    """sha256 over the names and bytes of a file or of every file under a directory."""
    files = sorted(p for p in (path.rglob("*") if path.is_dir() else [path]) if p.is_file())
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


class HeadProposer(Proposer):
    """Heads on the target's hidden state, loaded from a checkpoint directory (or shipped for the default
    model): the lookahead may come from the checkpoint."""

    shipped: ClassVar[str | None] = None  # the folder name of heads shipped for the default model
    lookahead_key: ClassVar[str | None] = None  # config.json key giving the head count

    @staticmethod
    def loader(path: Path, target: Any) -> Any:
        raise NotImplementedError

    @classmethod
    def head_path(cls, model: str | None) -> Path:
        if model:
            return Path(model).expanduser()
        if cls.shipped is None:
            raise InputError(f"method {cls.method!r} needs 'model' (the heads' path)")
        return shipped_head(cls.shipped)

    @classmethod
    def config_defaults(cls, model: str | None) -> dict[str, Any]:
        """`speculative.json` beside the heads (the shipped ones carry it), else the head count in config.json."""
        path = cls.head_path(model)
        folder = path if path.is_dir() else path.parent
        if (folder / "speculative.json").exists():
            return json.loads((folder / "speculative.json").read_text())
        cfg = json.loads((folder / "config.json").read_text()) if (folder / "config.json").exists() else {}
        n = cfg.get(cls.lookahead_key) if cls.lookahead_key else None
        if not isinstance(n, int):
            raise InputError(f"method {cls.method!r}: set 'num_speculative_tokens' (nothing in {folder} says how many)")
        return {"num_speculative_tokens": n}

    @classmethod
    def load(cls, spec: SpeculativeConfig, target: Any, tokenizer: Any, target_path: str | None,
             load_model: Callable[[str], tuple[Any, Any, str]]) -> tuple[Any, str | None]:
        if spec.model is None and target_path is not None:
            raise InputError(f"method {spec.method!r} needs 'model' (the heads' path): heads are shipped only "
                             "for the default model")
        path = cls.head_path(spec.model)
        if not path.exists():
            raise InputError(f"{path}: no such file or directory")
        heads = cls.loader(path, target)
        print(f"loaded {spec.method} heads from {path}", file=sys.stderr, flush=True)
        return heads, f"{spec.method}:{file_fingerprint(path)}"


class LastHiddenHead(HeadProposer):
    """Heads that read the target's hidden state at the position that produced the last token (Medusa,
    MLPSpeculator); they keep no cache. `seq.draft` is that hidden state [H]."""

    native = "last_hidden"

    def prefilled(self, seq: "Seq", last_hidden: Tensor) -> None:
        seq.draft = last_hidden

    def decoded(self, rows: list["Seq"], hidden: Tensor) -> None:
        for i, s in enumerate(rows):
            s.draft = hidden[i]

    def accepted(self, rows: list["Seq"], num_accepted: list[int], path_hidden: Tensor) -> None:
        for i, (s, n) in enumerate(zip(rows, num_accepted)):
            s.draft = path_hidden[i, n]

    def hidden(self, step: Step) -> Tensor:
        """[B, H]: each row's last hidden state, zeros for padding rows."""
        h = torch.zeros(step.B, self.target.feature_size, dtype=self.target.dtype, device=self.device)
        h[:len(step.rows)] = torch.stack([s.draft for s in step.rows])
        return h
