"""Draft multi-step loops for a draft model: k steps unrolled in one graph.

Each loop starts with a fixed-width catch-up: the draft's cache lacks the tokens accepted in the
previous step and the bonus token (the new root), so they run as one padded chunk. Drafted tokens
then write their K/V into scratch slots past the root (root_slot + node id); the next catch-up
overwrites them, so rejected branches are never read again.

Every loop returns the tree tokens [B, T] (node 0 = root) and draft_probs [B, T, V]: for node i the
distribution its token was proposed from (what exact rejection sampling divides by). Top-k candidates
are chosen deterministically, so their proposal is one-hot on the token itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from specair.graphs.kv import commit_kv
from specair.graphs.sampling import request_probs, sample_from_probs
from specair.graphs.steps import prefill_chunk
from specair.graphs.tree import TreeTemplate
from specair.models.llama import Transformer


def _catch_up(draft: Transformer, catch_tokens: Tensor, n_catch: Tensor, draft_len: Tensor, k_cache: Tensor,
              v_cache: Tensor, ctx: int) -> tuple[Tensor, Tensor, Tensor]:
    """Commit the catch-up chunk; return the root's draft logits [B, V], the root token [B] and its slot [B]."""
    logits, _ = prefill_chunk(draft, catch_tokens, draft_len, n_catch, k_cache, v_cache, ctx)
    root = catch_tokens.gather(1, (n_catch - 1).unsqueeze(1)).squeeze(1)
    return logits, root, draft_len + n_catch - 1


def draft_chain(draft: Transformer, catch_tokens: Tensor, n_catch: Tensor, draft_len: Tensor, k_cache: Tensor,
                v_cache: Tensor, k: int, temperature: Tensor, top_k: Tensor, top_p: Tensor, uniforms: Tensor,
                ctx: int, filtered: bool = True) -> tuple[Tensor, Tensor]:
    """k tokens sampled one after another from the draft (argmax where temperature is 0).

    catch_tokens [B, W] with n_catch [B] real ones (the last is the root), draft_len [B] tokens already
    in the draft cache, uniforms [B, k]. Returns tree tokens [B, k+1] and draft_probs [B, k+1, V].
    """
    logits, root, slot = _catch_up(draft, catch_tokens, n_catch, draft_len, k_cache, v_cache, ctx)
    tokens, probs = [root], [torch.zeros_like(logits)]
    for i in range(k):
        q = request_probs(logits, temperature, top_k, top_p, filtered)
        tok = sample_from_probs(q, uniforms[:, i])
        tokens.append(tok)
        probs.append(q)
        if i + 1 < k:
            pos = slot + 1 + i
            out = draft(tok.unsqueeze(1), pos.unsqueeze(1), pos, k_cache[..., :ctx, :], v_cache[..., :ctx, :])
            commit_kv(k_cache, v_cache, out.new_k, out.new_v, pos.unsqueeze(1))
            logits = out.logits[:, 0]
    return torch.stack(tokens, 1), torch.stack(probs, 1)


def _scratch_mask(anc: Tensor, root_slot: Tensor, C: int) -> Tensor:
    """Past mask [B, F, C] for F new nodes: committed slots (through the root) plus the scratch slots
    of each node's strict ancestors. anc [B, F, M] marks ancestors by node id (slot = root_slot + id)."""
    slots = torch.arange(C, device=anc.device)
    rel = slots.view(1, C) - root_slot.view(-1, 1)  # [B, C] node id stored in each slot
    M = anc.shape[-1]
    in_tree = (rel > 0) & (rel < M)
    seen = anc.gather(2, rel.clamp(0, M - 1).unsqueeze(1).expand(-1, anc.shape[1], -1))
    return (rel <= 0).unsqueeze(1) | (in_tree.unsqueeze(1) & seen)


def _feed_nodes(draft: Transformer, tokens: Tensor, node_ids: Tensor, depth: int, anc: Tensor, root_slot: Tensor,
                k_cache: Tensor, v_cache: Tensor, ctx: int) -> Tensor:
    """Run F tree nodes (same depth) through the draft; commit their K/V to scratch; return logits [B, F, V]."""
    B, Fn = tokens.shape
    positions = (root_slot + depth).unsqueeze(1).expand(B, Fn)
    eye = torch.eye(Fn, dtype=torch.bool, device=tokens.device).unsqueeze(0)
    out = draft(tokens, positions, root_slot, k_cache[..., :ctx, :], v_cache[..., :ctx, :], tree_mask=eye,
                past_mask=_scratch_mask(anc, root_slot, ctx))
    commit_kv(k_cache, v_cache, out.new_k, out.new_v, root_slot.unsqueeze(1) + node_ids)
    return out.logits


def draft_static_tree(draft: Transformer, catch_tokens: Tensor, n_catch: Tensor, draft_len: Tensor,
                      k_cache: Tensor, v_cache: Tensor, template: TreeTemplate, ctx: int) -> tuple[Tensor, Tensor]:
    """Fill a static tree template level by level: node i is the ranks[i]-th most likely token of the
    draft at its parent. One draft pass per level (the last level is never fed).

    Returns tree tokens [B, T] and one-hot draft_probs [B, T, V].
    """
    logits, root, root_slot = _catch_up(draft, catch_tokens, n_catch, draft_len, k_cache, v_cache, ctx)
    B, V = logits.shape
    buf = template.buffers()
    parents, ranks, levels, T = buf.parents, buf.ranks, buf.levels, template.num_nodes
    width = max(template.ranks) + 1
    tokens = root.new_zeros(B, T)
    tokens[:, 0] = root
    node_logits = logits.new_zeros(B, T, V)
    node_logits[:, 0] = logits
    strict_anc = buf.ancestor_mask & ~torch.eye(T, dtype=torch.bool, device=parents.device)
    for d in range(1, len(levels)):
        nodes = levels[d]
        cand = node_logits[:, parents[nodes]].topk(width, dim=-1).indices  # [B, F, width]
        tokens[:, nodes] = cand.gather(2, ranks[nodes].view(1, -1, 1).expand(B, -1, 1)).squeeze(2)
        if d + 1 < len(levels):
            anc = strict_anc[nodes].unsqueeze(0).expand(B, -1, -1)
            node_logits[:, nodes] = _feed_nodes(draft, tokens[:, nodes], nodes, d, anc, root_slot,
                                                k_cache, v_cache, ctx)
    return tokens, F.one_hot(tokens, V).to(logits.dtype)


def draft_topk_tree(draft: Transformer, catch_tokens: Tensor, n_catch: Tensor, draft_len: Tensor,
                    k_cache: Tensor, v_cache: Tensor, depth: int, topk: int, num_nodes: int,
                    ctx: int) -> tuple[Tensor, Tensor, Tensor]:
    """A per-row dynamic tree (SpecInfer / EAGLE-2): expand the best `topk` frontier nodes by cumulative
    log-probability for `depth` levels, then keep the global best `num_nodes` candidates.

    Candidates get ids in creation order, so a parent's id is below its children's; a child's score
    never exceeds its parent's, and a stable sort breaks ties towards lower ids, so the kept set is
    closed under parents. Returns tree tokens [B, N+1], parents [B, N+1] (-1 at the root) and one-hot
    draft_probs [B, N+1, V].
    """
    logits, root, root_slot = _catch_up(draft, catch_tokens, n_catch, draft_len, k_cache, v_cache, ctx)
    B, V = logits.shape
    K = topk
    M = 1 + K + (depth - 1) * K * K  # root + every candidate ever created
    dev = logits.device
    logp, tok = logits.log_softmax(-1).topk(K, dim=-1)  # depth-1 candidates: ids 1..K
    cand_tok, cand_score, cand_parent = [tok], [logp], [torch.zeros(B, K, dtype=torch.long, device=dev)]
    front_ids = torch.arange(1, K + 1, device=dev).expand(B, K)
    front_tok, front_score = tok, logp
    anc = torch.zeros(B, K, M, dtype=torch.bool, device=dev)  # strict ancestors, by candidate id
    next_id = K + 1
    for d in range(1, depth):
        out = _feed_nodes(draft, front_tok, front_ids, d, anc, root_slot, k_cache, v_cache, ctx)
        child_logp, child_tok = out.log_softmax(-1).topk(K, dim=-1)  # [B, K, K]
        scores = (front_score.unsqueeze(-1) + child_logp).reshape(B, K * K)
        ids = torch.arange(next_id, next_id + K * K, device=dev).expand(B, -1)
        cand_tok.append(child_tok.reshape(B, K * K))
        cand_score.append(scores)
        cand_parent.append(front_ids.repeat_interleave(K, dim=1))
        # Self-inclusive ancestors of the frontier become the strict ancestors of its children.
        self_anc = anc | F.one_hot(front_ids, M).bool()
        best = scores.topk(K, dim=-1).indices
        front_ids = ids.gather(1, best)
        front_tok = child_tok.reshape(B, K * K).gather(1, best)
        front_score = scores.gather(1, best)
        anc = self_anc.gather(1, (best // K).unsqueeze(-1).expand(-1, -1, M))
        next_id += K * K
    all_tok = torch.cat([root.unsqueeze(1)] + cand_tok, 1)  # [B, M] indexed by candidate id
    all_score = torch.cat([torch.zeros(B, 1, dtype=logp.dtype, device=dev)] + cand_score, 1)
    all_parent = torch.cat([torch.full((B, 1), -1, dtype=torch.long, device=dev)] + cand_parent, 1)
    order = all_score.sort(dim=-1, descending=True, stable=True).indices[:, : num_nodes + 1]
    keep = order.sort(dim=-1).values  # root (id 0, score 0) first, then by id: parents before children
    new_index = torch.full((B, M), -1, dtype=torch.long, device=dev)
    new_index.scatter_(1, keep, torch.arange(num_nodes + 1, device=dev).expand(B, -1))
    parent_ids = all_parent.gather(1, keep)
    parents = torch.where(parent_ids < 0, parent_ids, new_index.gather(1, parent_ids.clamp(min=0)))
    tokens = all_tok.gather(1, keep)
    return tokens, parents, F.one_hot(tokens, V).to(logits.dtype)
