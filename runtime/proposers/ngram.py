"""N-gram prompt lookup (vLLM `ngram`, HF `prompt_lookup_num_tokens`): propose the tokens that followed the
latest earlier occurrence of the sequence's last n tokens, n from `max_n` down to `min_n`.

The index is built as tokens arrive, so a proposal is a dictionary lookup per n, never a scan of the context.
Proposals are made on the host (no draft graph) and are deterministic: the verify graph reads their
one-hot draft distribution off the tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from specair.compile.spec_config import SpeculativeConfig, TreeShape
from specair.models.errors import InputError
from specair.runtime.proposers.base import Proposal, Proposer, Step, register
from specair.runtime.scheduler import Seq


class NgramIndex:
    """For each n in [min_n, max_n]: n-gram → where the tokens after its latest occurrence start."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}

    def extend(self, tokens: list[int]) -> None:
        """Append tokens. An n-gram enters the index only once a token follows it, so the sequence's own
        suffix is never its own match."""
        for t in tokens:
            end = len(self.tokens)  # the n-grams ending just before `t` now have a continuation at `end`
            for n, table in self.tables.items():
                if end >= n:
                    table[tuple(self.tokens[end - n:end])] = end
            self.tokens.append(t)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the longest matching suffix's latest earlier occurrence ([] if none)."""
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(self.tokens) < n:
                continue
            start = self.tables[n].get(tuple(self.tokens[-n:]))
            if start is not None:
                return self.tokens[start:start + k]
        return []


@register
class Ngram(Proposer):
    method = "ngram"
    native = "ngram"

    @classmethod
    def check_config(cls, raw: dict[str, Any]) -> dict[str, Any]:
        # A one-token match is mostly chance; from two tokens on, a proposal is worth its verify pass.
        hi = raw.get("prompt_lookup_max") or 4
        lo = raw.get("prompt_lookup_min") or min(2, hi)
        if lo > hi:
            raise InputError(f"'prompt_lookup_min' ({lo}) exceeds 'prompt_lookup_max' ({hi})")
        return {**raw, "prompt_lookup_min": lo, "prompt_lookup_max": hi}

    @classmethod
    def check_tree(cls, config: SpeculativeConfig, tree: TreeShape) -> None:
        if tree.kind != "chain":
            raise InputError("method 'ngram' proposes a chain; drop 'tree'")

    @classmethod
    def config_defaults(cls, model: str | None) -> dict[str, Any]:
        # On CPU each verify row past the first costs ~0.3 of a decode step: a fourth draft token, accepted
        # on ~1 in 5 proposing steps, no longer pays.
        return {"num_speculative_tokens": 3}

    def start(self, seq: Seq) -> None:
        seq.draft = NgramIndex(self.spec.prompt_lookup_min, self.spec.prompt_lookup_max)

    def _lookup(self, rows: list[Seq]) -> list[list[int]]:
        for s in rows:  # the index catches up with the tokens the sequence gained since
            s.draft.extend(s.tokens[len(s.draft.tokens):])
        return [s.draft.propose(self.plan.max_depth) for s in rows]

    def can_speculate(self, rows: list[Seq]) -> bool:
        return any(self._lookup(rows))

    def propose(self, step: Step) -> Proposal:
        # Looked up again, not kept from can_speculate: a tensor-parallel worker is told the driver's decision
        # instead of asking, and must propose from its own rows.
        D = step.tree.depth
        tokens = torch.zeros(step.B, D + 1, dtype=torch.long)
        for i, prop in enumerate(self._lookup(step.rows)):
            tokens[i, 1:1 + min(len(prop), D)] = torch.tensor(prop[:D], dtype=torch.long)
        tokens = tokens.to(self.device)
        tokens[:, 0] = step.root
        return Proposal(tokens)
