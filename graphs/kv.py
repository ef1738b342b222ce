"""KV commit: write the K/V of kept tokens into the cache at their (contiguous) slots."""

from __future__ import annotations

import torch
from torch import Tensor


def commit_kv(k_cache: Tensor, v_cache: Tensor, new_k: Tensor, new_v: Tensor, slots: Tensor) -> None:
    """Scatter new_k/new_v [L, B, Hkv, T, D] into the caches [L, B, Hkv, S, D] at slots [B, T], in place.

    Slots differ per row, so this is a scatter, not a slice copy; only T entries per row are written.
    """
    L, B, H, T, D = new_k.shape
    index = slots.view(1, B, 1, T, 1).expand(L, B, H, T, D)
    k_cache.scatter_(3, index, new_k)
    v_cache.scatter_(3, index, new_v)
