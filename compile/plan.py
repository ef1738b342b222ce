"""The bucket plan: every static shape a decoder may run, fixed ahead of time."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from specair.compile.spec_config import SpeculativeConfig, TreeShape, tree_shape
from specair.models.errors import InputError

MIN_CONTEXT_BUCKET = 64
VARIANTS = ("greedy", "plain", "filtered")  # sampling graph variants, cheapest first


@dataclass(frozen=True)
class Plan:
    """Batch buckets, context buckets (powers of two up to max_context), prefill chunks, sampling
    variants and the speculative step's shape. Serialised into every artifact manifest."""

    max_context: int
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8)
    prefill_chunk: int = 128
    variants: tuple[str, ...] = ("greedy", "filtered")
    speculative: SpeculativeConfig | None = None
    dtype: str = "fp32"
    # False: one context bucket (max_context), for backends whose attention reads only the used slots
    # (onnxruntime's fused attention), where more buckets would be identical graphs.
    context_buckets: bool = True
    # Smaller prefill chunks compiled beside prefill_chunk: a prompt's last chunk runs on the smallest one
    # that holds it, so a short prompt computes little padding.
    prefill_chunks: tuple[int, ...] = ()
    trees: tuple[TreeShape, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_context < 2:
            raise InputError(f"max_context must be at least 2, got {self.max_context}")
        if not self.batch_buckets or any(b < 1 for b in self.batch_buckets):
            raise InputError(f"batch buckets must be positive integers, got {self.batch_buckets}")
        object.__setattr__(self, "batch_buckets", tuple(sorted(set(self.batch_buckets))))
        bad = [v for v in self.variants if v not in VARIANTS]
        if bad or not self.variants:
            raise InputError(f"sampling variants must be among {VARIANTS}, got {self.variants}")
        object.__setattr__(self, "variants", tuple(v for v in VARIANTS if v in self.variants))
        if self.prefill_chunk < 1 or any(not 0 < c <= self.prefill_chunk for c in self.prefill_chunks):
            raise InputError(f"prefill chunks must be in 1..prefill_chunk ({self.prefill_chunk}), got "
                             f"{self.prefill_chunk} and {self.prefill_chunks}")
        object.__setattr__(self, "prefill_chunks", tuple(sorted(set(self.prefill_chunks) - {self.prefill_chunk})))
        if self.speculative is not None:
            object.__setattr__(self, "trees", tuple(tree_shape(c) for c in self.speculative.shape_configs()))

    @property
    def tree(self) -> TreeShape | None:
        """The main speculative shape (the one sampled steps run), None without speculation."""
        return self.trees[0] if self.trees else None

    @property
    def max_depth(self) -> int:
        """The deepest speculative shape's draft tokens (0 without speculation)."""
        return max((t.depth for t in self.trees), default=0)

    def shapes(self, variant: str) -> range:
        """The speculative shapes (indices into `trees`) a step of that compiled variant may run: all of them
        for greedy steps of an adaptive plan, else the main one (a sampled step's random draws depend on its
        shape, and a seeded request must not depend on timing)."""
        spec = self.speculative
        return range(len(self.trees) if spec is not None and spec.adaptive and variant == "greedy" else 1)

    @property
    def ctx_buckets(self) -> tuple[int, ...]:
        """Powers of two from MIN_CONTEXT_BUCKET below max_context, then max_context itself (only
        max_context without context buckets)."""
        if not self.context_buckets:
            return (self.max_context,)
        out, c = [], MIN_CONTEXT_BUCKET
        while c < self.max_context:
            out.append(c)
            c *= 2
        return tuple(out) + (self.max_context,)

    @property
    def chunk_buckets(self) -> tuple[int, ...]:
        """Every prefill chunk size, smallest first."""
        return self.prefill_chunks + (self.prefill_chunk,)

    def chunk_for(self, tokens: int) -> int:
        """The chunk size that prefills the next `tokens` prompt tokens: the smallest holding them all, else
        the largest."""
        return next((c for c in self.chunk_buckets if c >= tokens), self.prefill_chunk)

    def chunk_key(self, size: int) -> int:
        """GraphKey.chunk of a prefill graph of `size` tokens (0 for prefill_chunk itself)."""
        return 0 if size == self.prefill_chunk else size

    @property
    def spare_slots(self) -> int:
        """Cache slots past the context: a padded prefill chunk, and commits up to D past the root."""
        return max(self.prefill_chunk, self.max_depth + 1)

    @property
    def slots(self) -> int:
        return self.max_context + self.spare_slots

    def context_bucket(self, needed: int) -> int:
        """The smallest context bucket holding `needed` committed slots."""
        for c in self.ctx_buckets:
            if c >= needed:
                return c
        raise InputError(f"{needed} tokens of context exceed the plan's max_context {self.max_context}")

    def batch_bucket(self, rows: int) -> int:
        """The smallest batch bucket holding `rows` sequences."""
        for b in self.batch_buckets:
            if b >= rows:
                return b
        raise InputError(f"{rows} sequences exceed the largest batch bucket {self.batch_buckets[-1]}")

    def variant_for(self, wanted: str) -> str:
        """The compiled sampling variant that serves `wanted`: itself, else the next more general one
        (greedy rows run exactly on the plain and filtered graphs, plain rows on the filtered one)."""
        for v in VARIANTS[VARIANTS.index(wanted):]:
            if v in self.variants:
                return v
        raise InputError(f"sampling variant {wanted!r} is not in the plan {self.variants}; "
                         f"recompile with --variants including it")

    def to_json(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "trees"}
        d["speculative"] = dataclasses.asdict(self.speculative) if self.speculative else None
        d["batch_buckets"], d["variants"] = list(self.batch_buckets), list(self.variants)
        d["prefill_chunks"] = list(self.prefill_chunks)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Plan":
        d = dict(d)
        if d.get("speculative") is not None:
            d["speculative"] = SpeculativeConfig.parse(d["speculative"])
        d["batch_buckets"], d["variants"] = tuple(d["batch_buckets"]), tuple(d["variants"])
        d["prefill_chunks"] = tuple(d.get("prefill_chunks", ()))
        return cls(**d)
