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


def commit_path(k_cache: Tensor, v_cache: Tensor, new_k: Tensor, new_v: Tensor, node_ids: Tensor,
                root_pos: Tensor) -> None:
    """Commit the accepted path of a verified tree: node_ids [B, D+1] (root first) → slots root_pos + 0..D.

    Entries past a row's accepted length carry some node's K/V into slots beyond the new committed
    length: the mask never reads them and the next commit overwrites them.
    """
    L, B, H, _, D = new_k.shape
    n = node_ids.shape[1]
    index = node_ids.clamp(min=0).view(1, B, 1, n, 1).expand(L, B, H, n, D)
    slots = root_pos.unsqueeze(1) + torch.arange(n, device=node_ids.device)
    commit_kv(k_cache, v_cache, new_k.gather(3, index), new_v.gather(3, index), slots)
