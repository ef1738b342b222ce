"""Tree verify: the target scores every node of a token tree in one pass (SpecInfer; vLLM's
multi-query scorer generalised to trees), and the batch-expansion alternative (one row per path).
"""

from __future__ import annotations

import torch
from torch import Tensor

from specair.models.llama import ModelOutput, Transformer


def tree_verify(model: Transformer, tree_tokens: Tensor, depth: Tensor, tree_mask: Tensor, root_pos: Tensor,
                k_cache: Tensor, v_cache: Tensor, ctx: int) -> ModelOutput:
    """Target logits, hidden states and K/V for all T nodes of a tree.

    tree_tokens [B, T] (node 0 = the last accepted token, not yet in the cache); depth [T] or [B, T];
    tree_mask [1 or B, T, T] (a node sees its ancestors and itself); root_pos [B] = committed length.
    Nodes sit at position root_pos + depth; the cache is only read.
    """
    positions = root_pos.unsqueeze(1) + depth
    return model(tree_tokens, positions, root_pos, k_cache[..., :ctx, :], v_cache[..., :ctx, :], tree_mask=tree_mask)


def leaf_paths(paths: Tensor, children: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """For a static tree: its root-to-leaf paths [P, D+1] (-1 padded), and for every node the leaf
    path containing it and its index in that path (both [T]), so per-path results map back to nodes."""
    leaves = (children < 0).all(dim=1).nonzero().flatten()
    lp = paths[leaves]
    T = paths.shape[0]
    where = torch.zeros(T, dtype=torch.long)
    index = torch.zeros(T, dtype=torch.long)
    for p in range(lp.shape[0] - 1, -1, -1):  # build-time loop over a static template
        for d, node in enumerate(lp[p].tolist()):
            if node >= 0:
                where[node], index[node] = p, d
    return lp, where, index


def expanded_verify(model: Transformer, tree_tokens: Tensor, leaf_path: Tensor, node_path: Tensor,
                    node_index: Tensor, root_pos: Tensor, k_cache: Tensor, v_cache: Tensor, ctx: int) -> ModelOutput:
    """The same result as tree_verify, computed as one causal row per root-to-leaf path (vLLM's
    batch-expansion scorer, for attention kernels without tree masks). Each row needs its own copy of
    the context, which is what makes this the slower scorer on long contexts.
    """
    B = tree_tokens.shape[0]
    P, W = leaf_path.shape
    rows = tree_tokens[:, leaf_path.clamp(min=0)].reshape(B * P, W)
    positions = (root_pos.unsqueeze(1) + torch.arange(W, device=rows.device)).repeat_interleave(P, dim=0)
    kc = k_cache[..., :ctx, :].repeat_interleave(P, dim=1)
    vc = v_cache[..., :ctx, :].repeat_interleave(P, dim=1)
    out = model(rows, positions, root_pos.repeat_interleave(P), kc, vc)
    flat = node_path * W + node_index  # node → (path, index) in the [P*W] flattening of a batch row
    L, _, H, _, D = out.new_k.shape
    return ModelOutput(
        out.logits.view(B, P * W, -1)[:, flat],
        out.hidden.view(B, P * W, -1)[:, flat],
        out.new_k.view(L, B, P, H, W, D).permute(0, 1, 3, 2, 4, 5).reshape(L, B, H, P * W, D)[:, :, :, flat],
        out.new_v.view(L, B, P, H, W, D).permute(0, 1, 3, 2, 4, 5).reshape(L, B, H, P * W, D)[:, :, :, flat],
    )
