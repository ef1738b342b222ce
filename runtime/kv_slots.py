"""KV slots: the rows of the KV caches (the target's, and a proposer's own) on the backend's device.

Rows 0..n-1 hold the n running sequences; the caches have the smallest batch bucket ≥ n rows (padding
rows compute on zeros and nothing reads what they write). Prompts are prefilled into one-row scratch
caches, then copied into a row. Graphs read caches (and may write the step's own K/V past the committed length, which stays unread);
`commit` writes the K/V a step keeps.

With a static-buffer backend (CUDA graphs, aclgraph) every bucket's caches are allocated once and bound
to the graphs before any is built, so graphs read them in place (all buckets together hold
sum(buckets) rows); a bucket change copies only the used context of the running rows. Elsewhere a
bucket change allocates the new bucket's caches and frees the old ones.
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
                 persistent: bool) -> None:
        self.models, self.plan, self.device, self.persistent = models, plan, device, persistent
        self.B = 0
        with torch.inference_mode():  # like every graph input: compiled graphs guard on the tensor kind
            self.scratch = {r: m.empty_cache(1, plan.slots, device) for r, m in models.items()}
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

    def resize(self, rows: int, used: int) -> None:
        """Switch to the smallest batch bucket holding `rows` rows, keeping the first min(rows, B) rows'
        `used` slots."""
        B = self.plan.batch_bucket(max(rows, 1))
        if B == self.B:
            return
        keep = min(rows, B, self.B)
        for role, m in self.models.items():
            old = self.caches[role]
            new = self._pool[role, B] if self.persistent else m.empty_cache(B, self.plan.slots, self.device)
            if old is not None and keep and used:
                for n, o in zip(new, old):
                    n[:, :keep, :, :used] = o[:, :keep, :, :used]
            self.caches[role] = new
        self.B = B

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
