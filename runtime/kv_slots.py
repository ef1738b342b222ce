"""KV slots: the rows of the KV caches (the target's, and a proposer's own) on the backend's device.

Rows 0..n-1 hold the n running sequences; the caches have the smallest batch bucket ≥ n rows (padding
rows compute on zeros and nothing reads what they write). Prompts are prefilled into one-row scratch
caches, then copied into a row. Graphs read caches (and may write the step's own K/V past the committed length, which stays unread);
`commit` writes the K/V a step keeps.

With a static-buffer backend (CUDA graphs, aclgraph) every bucket's caches are allocated once and bound
to the graphs before any is built, so graphs read them in place (all buckets together hold
sum(buckets) rows); a bucket change copies only the used context of the running rows. Elsewhere a
bucket change allocates the new bucket's caches and frees the old ones.

Memory follows the work. On the CPU every cache is a mapping whose pages are committed on first write
(models/memory.py), so graphs of any backend take caches of the plan's full context while a row holds memory
only for the slots written to it: its context plus the few a step writes past it. A row handed to another
sequence, a freed row and the prefill scratch after its prompt moved into a row give their pages back, and a
bucket change copies each row's own used slots only. On other devices, where graphs take caches of any
length (eager), each row holds the context bucket of the longest running sequence plus the spare slots, and
the caches are reallocated (the used slots copied, the old set freed) when the batch bucket or that context
bucket changes: up as sequences grow, down when the longest leaves; the prefill scratch grows with its prompt
the same way. Compiled graphs with a fixed cache shape there keep the full slot count.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from specair.compile.graph_def import GraphKey
from specair.compile.plan import Plan
from specair.graphs.kv import commit_kv
from specair.models import memory

Caches = tuple[Tensor, Tensor]
PROMPT_PREFILL = {"target": "prefill", "draft": "draft_prefill"}  # the graph kind that fills each role's scratch


class KVSlots:
    """Caches by role ("target", "draft") for the current batch bucket, plus one-row prefill scratch."""

    def __init__(self, models: dict[str, Any], plan: Plan, device: torch.device, graphs: Any,
                 persistent: bool, any_length: bool = False) -> None:
        self.models, self.plan, self.device, self.persistent = models, plan, device, persistent
        self.on_demand = device.type == "cpu" and not persistent  # pages committed on write: full-size caches
        self.any_length = any_length and not persistent and not self.on_demand
        self.B = 0
        self.cap = 0  # slots per row of the current caches
        with torch.inference_mode():  # like every graph input: compiled graphs guard on the tensor kind
            self.scratch_cap = self._alloc_slots(1)
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

    def _alloc_slots(self, context: int) -> int:
        """Slots per row the caches are allocated with for `context` committed tokens: their context bucket
        (what graphs read) plus the spare slots a step commits past it where graphs take any length, else
        the plan's full slot count."""
        plan = self.plan
        if not self.any_length:
            return plan.slots
        return min(plan.slots, plan.context_bucket(min(max(context, 1), plan.max_context)) + plan.spare_slots)

    def slots_held(self, context: int) -> int:
        """Slots of memory a row holds at most with `context` committed tokens: on demand, those tokens plus
        the spare slots a step writes past them; else its allocation."""
        if self.on_demand:
            return min(self.plan.slots, max(context, 1) + self.plan.spare_slots)
        return self._alloc_slots(context)

    def bytes_for(self, lengths: Sequence[int], prompt: int) -> int:
        """Bytes the caches would hold at most with rows at these longest contexts, plus the prefill scratch
        for a `prompt`-token prompt (what admission under a KV budget counts)."""
        B = self.plan.batch_bucket(len(lengths))
        rows = (sum(map(self.slots_held, lengths)) + (B - len(lengths)) * self.slots_held(1) if self.on_demand
                else B * self.slots_held(max(lengths)))
        return (rows + self.slots_held(prompt)) * self.slot_bytes

    def resize(self, rows: int, lengths: Sequence[int], context: int = 1) -> None:
        """Hold `rows` rows (the smallest batch bucket holding them) with room for `context` committed tokens,
        keeping the first min(rows, B) rows' used slots (`lengths`, one per kept row). Memory is reallocated
        only when the bucket or the slot count changes (the slot count shrinks once the work fits in half of
        it)."""
        B, cap = self.plan.batch_bucket(max(rows, 1)), self._alloc_slots(max([context, *lengths]))
        if B == self.B and self.cap >= cap and not (self.any_length and self.cap >= 2 * cap):
            return
        lengths = [min(n, cap, self.cap) for n in lengths[:min(rows, B, self.B)]]
        for role, m in self.models.items():
            new = self._pool[role, B] if self.persistent else m.empty_cache(B, cap, self.device)
            self.caches[role] = _copy_used(self.caches[role], new, lengths)
        self.B, self.cap = B, cap

    def release(self) -> None:
        """No sequence runs: free the row caches and the prefill scratch's memory (where memory follows the
        work)."""
        if self.any_length or self.on_demand:
            self.caches = {r: None for r in self.models}
            self.B = self.cap = 0
            self.fit_scratch(0)
            self._release_scratch()

    def fit_scratch(self, start: int) -> None:
        """Size the prefill scratch for a chunk after `start` prompt tokens, keeping those."""
        cap, used = self._alloc_slots(start), start
        if not self.any_length or self.scratch_cap == cap:
            return
        for role, m in self.models.items():
            self.scratch[role] = _copy_used(self.scratch[role], m.empty_cache(1, cap, self.device),
                                            [min(used, cap, self.scratch_cap)])
        self.scratch_cap = cap

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot of one row over every role."""
        return sum(2 * k.numel() // k.shape[3] * k.element_size() for k, _ in self.scratch.values())

    def held_bytes(self) -> int:
        """Bytes of memory the caches and the scratch hold now (measured where pages are committed on
        demand)."""
        tensors = [t for caches in (*self.caches.values(), *self.scratch.values()) if caches is not None
                   for t in caches]
        if self.on_demand:
            return memory.resident_bytes(tensors)
        return sum(t.numel() * t.element_size() for t in tensors)

    def insert(self, row: int, length: int) -> None:
        """Copy a prefilled prompt's `length` slots from the scratch caches into `row`; the row's slots past
        them and the scratch give their memory back."""
        for role in self.models:
            for c, sc in zip(self.caches[role], self.scratch[role]):
                c[:, row, :, :length] = sc[:, 0, :, :length]
                memory.release(c, row, length)
        self._release_scratch()

    def read_scratch(self, start: int, end: int) -> dict[str, Caches]:
        """A copy of the prefill scratch's slots [start, end) by role: (k, v) [L, Hkv, end - start, D]."""
        return {role: tuple(c[:, 0, :, start:end].clone() for c in caches) for role, caches in self.scratch.items()}

    def write_scratch(self, start: int, blocks: dict[str, Caches]) -> None:
        """Write slots from `start` of the prefill scratch (what `read_scratch` returned)."""
        for role, pair in blocks.items():
            for c, b in zip(self.scratch[role], pair):
                c[:, 0, :, start:start + b.shape[2]] = b

    def move(self, src: int, dst: int, used: int) -> None:
        """Copy row src's first `used` slots into row dst (whose slots past them give their memory back)."""
        for role in self.models:
            for c in self.caches[role]:
                c[:, dst, :, :used] = c[:, src, :, :used]
                memory.release(c, dst, used)

    def free(self, row: int) -> None:
        """Row `row` holds no sequence any more: its memory goes back."""
        for role in self.models:
            for c in self.caches[role]:
                memory.release(c, row)

    def _release_scratch(self) -> None:
        for caches in self.scratch.values():
            for c in caches:
                memory.release(c, 0)


def _copy_used(old: Caches | None, new: Caches, lengths: Sequence[int]) -> Caches:
    """`new` holding row i's first lengths[i] slots of `old` (the only copy a resize makes): each row its
    own, so no row writes (and commits memory for) slots it does not use."""
    if old is not None:
        for n, o in zip(new, old):
            for i, used in enumerate(lengths):
                n[:, i, :, :used] = o[:, i, :, :used]
    return new
