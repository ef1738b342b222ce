"""Proposal graphs of draft heads that read the target's hidden state: Medusa trees and MLPSpeculator chains.

Both run after the target has produced the root (the bonus token) and the hidden state at the position
that produced it; neither keeps a cache. Like the draft loops (`graphs.draft`), each returns the tree
tokens [B, T] (node 0 = root): Medusa's candidates are the heads' top-k, the MLPSpeculator chain samples
each token with the uniform of its position.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specair.graphs.sampling import request_probs, sample_from_probs
from specair.graphs.tree import TreeBuffers, TreeTemplate
from specair.models.medusa import MedusaHeads
from specair.models.mlp_speculator import MLPSpeculator


def medusa_tree(heads: MedusaHeads, hidden: Tensor, root: Tensor, template: TreeTemplate,
                buffers: TreeBuffers | None = None) -> Tensor:
    """Fill a static tree from Medusa heads (Medusa's tree_choices semantics): a node at depth d >= 1 with
    rank r is the r-th most likely token of head d-1 at the root's hidden state, whatever its parent.

    hidden [B, H]: the target's hidden state that produced root [B]; `buffers`: the template's buffers on
    the graph's device (default: on the CPU). Returns tree tokens [B, T].
    """
    depth = template.max_depth
    if depth > heads.num_heads:
        raise ValueError(f"tree {template.name!r} is {depth} deep; the Medusa checkpoint has {heads.num_heads} heads")
    buf = buffers or template.buffers()
    width = max(template.ranks) + 1
    logits = heads.logits(heads.features(hidden)[:, :depth])  # [B, depth, V]: only the heads the tree uses
    cand = logits.topk(width, dim=-1).indices.flatten(1)  # [B, depth * width]
    pick = (buf.depth[1:] - 1) * width + buf.ranks[1:]  # node i -> (head depth_i - 1, rank_i)
    return torch.cat([root.unsqueeze(1), cand[:, pick]], dim=1)


def mlp_speculator_chain(spec: MLPSpeculator, hidden: Tensor, root: Tensor, k: int, temperature: Tensor,
                         top_k: Tensor, top_p: Tensor, uniforms: Tensor, filtered: bool = True) -> Tensor:
    """k tokens proposed stage by stage, each sampled as `graphs.draft.draft_chain` samples (argmax where
    temperature is 0) and fed to the next stage.

    hidden [B, H]: the target's hidden state that produced root [B]; uniforms [B, k] of the positions
    drafted. Returns tree tokens [B, k+1].
    """
    if not 1 <= k <= spec.n_predict:
        raise ValueError(f"the MLPSpeculator proposes 1..{spec.n_predict} tokens, asked for {k}")
    state, last = spec.prepare(hidden), root
    tokens = [root]
    for i in range(k):
        state, logits = spec.step(i, state, last)
        last = sample_from_probs(request_probs(logits, temperature, top_k, top_p, filtered), uniforms[:, i])
        tokens.append(last)
    return torch.stack(tokens, 1)
