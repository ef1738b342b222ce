"""KV slots: the rows of the KV caches (the target's, and a proposer's own) on the backend's device.

Rows 0..n-1 hold the n running sequences; the caches have the smallest batch bucket ≥ n rows (padding
rows compute on zeros and nothing reads what they write). Prompts are prefilled into one-row scratch
caches, then copied into a row. Graphs read caches (and may write the step's own K/V past the committed length, which stays unread);
`commit` writes the K/V a step keeps.

With a static-buffer backend (CUDA graphs, aclgraph) every bucket's caches are allocated once and bound
to the graphs before any is built, so graphs read them in place (all buckets together hold
sum(buckets) rows); a bucket change copies only the used context of the running rows. Elsewhere a
bucket change allocates the new bucket's caches and frees the old ones.

Memory follows the work where graphs take caches of any length (eager): each row holds the context bucket
of the longest running sequence plus the spare slots, not the plan's maximum context, and the caches are
reallocated (the used slots copied, the old set freed) when the batch bucket or that context bucket
changes: up as sequences grow, down when the longest leaves. The prefill scratch grows with its prompt
the same way. Compiled graphs with a fixed cache shape keep the full slot count.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from specair.compile.graph_def import GraphKey
from specair.compile.plan import Plan
from specair.graphs.kv import commit_kv

Caches = tuple[Tensor, Tensor]
PROMPT_PREFILL = {"target": "prefill", "draft": "draft_prefill"}  # the graph kind that fills each role's scratch


class KVSlots:
    """Caches by role ("target", "draft") for the current batch bucket, plus one-row prefill scratch."""

    def __init__(self, models: dict[str, Any], plan: Plan, device: torch.device, graphs: Any,
                 persistent: bool, any_length: bool = False) -> None:
        self.models, self.plan, self.device, self.persistent = models, plan, device, persistent
        self.any_length = any_length and not persistent
        self.B = 0
        self.cap = 0  # slots per row of the current caches
        with torch.inference_mode():  # like every graph input: compiled graphs guard on the tensor kind
            self.scratch_cap = self.cap_for(1)
            self.scratch = {r: m.empty_cache(1, self.scratch_cap, device) for r, m in models.items()}
            self.caches: dict[str, Caches | None] = {r: None for r in models}
            self._pool: dict[tuple[str, int], Caches] = {}
            if persistent:
                for r, m in models.items():
                    for b in plan.batch_buckets:
                        self._pool[r, b] = m.empty_cache(b, plan.slots, device)
                        for name, t in zip(("k_cache", "v_cache"), self._pool[r, b]):
                            graphs.bind(name, t, r)
                # The scratch caches feed only the prompt-prefill graphs.
                for r in models:
                    for c in plan.ctx_buckets:
                        for t in plan.chunk_buckets:
                            for name, cache in zip(("k_cache", "v_cache"), self.scratch[r]):
                                graphs.bind(name, cache, r, GraphKey(PROMPT_PREFILL[r], 1, c, chunk=plan.chunk_key(t)))

    def __getitem__(self, role: str) -> dict[str, Tensor]:
        """The current bucket's caches of a role, as graph inputs."""
        k, v = self.caches[role]
        return {"k_cache": k, "v_cache": v}

    def scratch_inputs(self, role: str) -> dict[str, Tensor]:
        k, v = self.scratch[role]
        return {"k_cache": k, "v_cache": v}

    def commit(self, role: str, new_k: Tensor | None, new_v: Tensor | None, slots: Tensor,
               scratch: bool = False) -> None:
        """Write new K/V [L, B, Hkv, T, D] at slots [B, T] of the role's caches (or its scratch). None: the
        graph already wrote them there (a backend's in-place attention, see backends/base.py)."""
        if new_k is None:
            return
        commit_kv(*(self.scratch[role] if scratch else self.caches[role]), new_k, new_v, slots)

    def cap_for(self, context: int) -> int:
        """Slots per row for `context` committed tokens: their context bucket (what graphs read) plus the spare
        slots a step commits past it."""
        plan = self.plan
        if not self.any_length:
            return plan.slots
        return min(plan.slots, plan.context_bucket(min(max(context, 1), plan.max_context)) + plan.spare_slots)

    def resize(self, rows: int, used: int, context: int = 1) -> None:
        """Hold `rows` rows (the smallest batch bucket holding them) with room for `context` committed tokens,
        keeping the first min(rows, B) rows' `used` slots. Memory is reallocated only when the bucket or the
        slot count changes (the slot count shrinks once the work fits in half of it)."""
        B, cap = self.plan.batch_bucket(max(rows, 1)), self.cap_for(context)
        cap = max(cap, self.cap_for(used))
        if B == self.B and self.cap >= cap and not (self.any_length and self.cap >= 2 * cap):
            return
        keep, used = min(rows, B, self.B), min(used, cap, self.cap)
        for role, m in self.models.items():
            new = self._pool[role, B] if self.persistent else m.empty_cache(B, cap, self.device)
            self.caches[role] = _copy_used(self.caches[role], new, keep, used)
        self.B, self.cap = B, cap

    def release(self) -> None:
        """No sequence runs: free the row caches and shrink the scratch (where memory follows the work)."""
        if self.any_length:
            self.caches = {r: None for r in self.models}
            self.B = self.cap = 0
            self.fit_scratch(0)

    def fit_scratch(self, start: int) -> None:
        """Size the prefill scratch for a chunk after `start` prompt tokens, keeping those."""
        cap, used = self.cap_for(start), start
        if not self.any_length or self.scratch_cap == cap:
            return
        for role, m in self.models.items():
            self.scratch[role] = _copy_used(self.scratch[role], m.empty_cache(1, cap, self.device), 1,
                                            min(used, cap, self.scratch_cap))
        self.scratch_cap = cap

    def nbytes(self) -> tuple[int, int]:
        """(bytes the caches and the scratch hold, bytes per slot of one row over every role)."""
        held = sum(t.numel() * t.element_size() for caches in (*self.caches.values(), *self.scratch.values())
                   if caches is not None for t in caches)
        per_slot = sum(2 * k.numel() // k.shape[3] * k.element_size() for k, _ in self.scratch.values())
        return held, per_slot

    def insert(self, row: int, length: int) -> None:
        """Copy a prefilled prompt's `length` slots from the scratch caches into `row`."""
        for role in self.models:
            for c, sc in zip(self.caches[role], self.scratch[role]):
                c[:, row, :, :length] = sc[:, 0, :, :length]

    def move(self, src: int, dst: int, used: int) -> None:
        """Copy row src's first `used` slots into row dst."""
        for role in self.models:
            for c in self.caches[role]:
                c[:, dst, :, :used] = c[:, src, :, :used]


def _copy_used(old: Caches | None, new: Caches, rows: int, used: int) -> Caches:
    """`new` holding the first `rows` rows' first `used` slots of `old` (the only copy a resize makes)."""
    if old is not None and rows and used:
        for n, o in zip(new, old):
            n[:, :rows, :, :used] = o[:, :rows, :, :used]
    return new
