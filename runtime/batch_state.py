"""Batch state: persistent per-row tensors on the device that every step's graphs read.

Row i holds the running sequence in row i: its last token (not in the cache yet), its committed length,
its sampling parameters. Rows past the running ones hold inert padding (token 0, length 0, greedy).
Steps advance the tokens and lengths on the device from their own outputs, so nothing is rebuilt from
host lists per step; only rows that join, leave or move are written from the host.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specair.compile.catalog import uniform_dtype
from specair.runtime.scheduler import Seq


class BatchState:
    def __init__(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device, self.udtype = dtype, device, uniform_dtype(dtype)
        with torch.inference_mode():
            z = torch.zeros(num_slots, dtype=torch.long, device=device)
            self.tokens, self.positions, self.top_k = z.clone(), z.clone(), z.clone()
            self.active = torch.zeros(num_slots, dtype=torch.bool, device=device)
            self.temperature = torch.zeros(num_slots, dtype=dtype, device=device)
            self.top_p = torch.ones(num_slots, dtype=dtype, device=device)
        self._fields = (self.tokens, self.positions, self.top_k, self.active, self.temperature, self.top_p)

    def set_row(self, i: int, s: Seq) -> None:
        """Row i now holds sequence s."""
        p = s.params
        for t, v in zip(self._fields, (s.tokens[-1], s.committed, p.top_k, True, float(p.temperature), float(p.top_p))):
            t[i] = v

    def clear_row(self, i: int) -> None:
        for t, v in zip(self._fields, (0, 0, 0, False, 0.0, 1.0)):
            t[i] = v

    def move_row(self, src: int, dst: int) -> None:
        for t in self._fields:
            t[dst] = t[src]

    def sampling(self, B: int) -> dict[str, Tensor]:
        return {"temperature": self.temperature[:B], "top_k": self.top_k[:B], "top_p": self.top_p[:B]}

    def advance(self, next_tokens: Tensor, num_new: Tensor | int) -> None:
        """After a step over the first B rows: each running row's last token is next_tokens [B] and its
        committed length grew by num_new ([B] or an int: the tokens that entered its cache)."""
        B = next_tokens.shape[0]
        active = self.active[:B]
        self.tokens[:B] = torch.where(active, next_tokens, self.tokens[:B])
        self.positions[:B] += active * num_new

    def uniforms(self, rows: list[Seq], B: int, n: int | None = None) -> Tensor:
        """The uniforms of the next n positions of each running row [B, n] ([B] when n is None); zeros for
        greedy rows (argmax reads none) and after the running rows."""
        u = torch.zeros(B, n or 1, dtype=self.udtype)
        for i, s in enumerate(rows):
            if not s.sampling.greedy:
                u[i] = s.sampling.uniforms(len(s.tokens), n or 1)
        return (u if n else u[:, 0]).to(self.device, non_blocking=True)
