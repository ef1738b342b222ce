"""Tree verify: the target scores every node of a token tree in one pass (SpecInfer; vLLM's
multi-query scorer generalised to trees), the batch-expansion alternative (one row per path), and the
verify→accept graph that the runtime dispatches: scoring and acceptance fused, so logits stay inside.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specair.graphs.acceptance import accept_exact, accept_greedy, accept_typical
from specair.graphs.tree import TreeBuffers, buffers_from_parents
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


def verify_and_accept(target: Transformer, tree_tokens: Tensor, root_pos: Tensor, k_cache: Tensor,
                      v_cache: Tensor, parents: Tensor | None = None, uniforms: Tensor | None = None, temperature: Tensor | None = None, top_k: Tensor | None = None,
                      top_p: Tensor | None = None, *, ctx: int, acceptance: str, max_depth: int, max_width: int,
                      tree: TreeBuffers | None = None, expansion: tuple[Tensor, Tensor, Tensor] | None = None,
                      filtered: bool = True, posterior_threshold: float = 0.09,
                      posterior_alpha: float = 0.3, chain: bool = False) -> tuple[Tensor, ...]:
    """Score a token tree and accept from it in one graph, so the target's logits never leave it.

    tree_tokens [B, T] (node 0 = root); root_pos [B]; a static tree's buffers come as `tree` (on the
    graph's device), a per-row tree as `parents` [B, T]; `expansion` (static trees only) scores one
    causal row per leaf path instead of the tree mask. `acceptance` (static) is "greedy", "typical" or
    "exact": exact needs uniforms [B, D+1] (column d: the position root_pos + d + 1) and the sampling
    tensors [B]. `chain`: the
    static tree is one path, so attention is plain causal and the K/V returned are every node's own at
    its own slot, which on the accepted prefix is the accepted path's (the slots after it are past the
    committed length, where nothing reads).

    Returns num_accepted [B], tokens [B, D+1] (accepted, then the bonus; -1 after), node_ids [B, D+1],
    and the accepted path's hidden states [B, D+1, H] and K/V [L, B, Hkv, D+1, Dh] for slots root_pos + 0..D.
    """
    B, T = tree_tokens.shape
    if parents is not None:
        depth, mask, _, paths = buffers_from_parents(parents, max_depth, max_width)
    else:
        depth, mask, paths = tree.depth, tree.ancestor_mask.unsqueeze(0), tree.paths.expand(B, *tree.paths.shape)
    if expansion is not None:
        out = expanded_verify(target, tree_tokens, *expansion, root_pos, k_cache, v_cache, ctx)
    else:
        out = tree_verify(target, tree_tokens, depth, None if chain else mask, root_pos, k_cache, v_cache, ctx)
    if acceptance == "greedy":
        res = accept_greedy(tree_tokens, out.logits, paths)
    elif acceptance == "typical":
        res = accept_typical(tree_tokens, out.logits, paths, temperature, top_k, top_p, posterior_threshold,
                             posterior_alpha, filtered)
    else:
        res = accept_exact(tree_tokens, out.logits, paths, uniforms, temperature, top_k, top_p,
                           "filtered" if filtered else "plain")
    nodes = res.node_ids.clamp(min=0)
    hidden = out.hidden.gather(1, nodes.unsqueeze(-1).expand(-1, -1, out.hidden.shape[-1]))
    if chain and expansion is None:
        return res.num_accepted, res.tokens, res.node_ids, hidden, out.new_k, out.new_v
    L, _, H, _, D = out.new_k.shape
    index = nodes.view(1, B, 1, -1, 1).expand(L, B, H, nodes.shape[1], D)
    return res.num_accepted, res.tokens, res.node_ids, hidden, out.new_k.gather(3, index), out.new_v.gather(3, index)
