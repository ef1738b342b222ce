"""KV commit: write the K/V of kept tokens into the cache at their (contiguous) slots."""

from __future__ import annotations

import torch
from torch import Tensor


def commit_kv(k_cache: Tensor, v_cache: Tensor, new_k: Tensor, new_v: Tensor, slots: Tensor) -> None:
    """Write new_k/new_v [L, B, Hkv, T, D] into the caches [L, B, Hkv, S, D] at slots [B, T], in place.

    Slots differ per row, so this is an indexed write, not a slice copy; only T entries per row are written.
    It indexes (row, slot) pairs of a [B, S, L, Hkv, D] view rather than scattering along S: torch's CPU
    `scatter_` takes a scalar path for bfloat16/float16 that cost ~0.5 s per decode step at 64 rows.
    """
    B, T = slots.shape
    rows = torch.arange(B, device=slots.device).view(B, 1).expand(B, T)
    for cache, new in ((k_cache, new_k), (v_cache, new_v)):
        cache.permute(1, 3, 0, 2, 4).index_put_((rows, slots), new.permute(1, 3, 0, 2, 4))
