"""Draft multi-step loops for a draft model: k steps unrolled in one pure graph.

Each loop starts with a fixed-width catch-up: the draft's cache lacks the tokens accepted in the
previous step and the bonus token (the new root), so they run as one padded chunk. The loop keeps
the K/V of the catch-up and of every drafted node as a growing "previous tokens" segment that later
steps attend to through a tree mask, and writes nothing: it returns the catch-up's K/V for the
caller to commit, and drafted nodes' K/V are simply dropped (accepted ones come back in the next
catch-up), so rejected branches never reach the cache.

Every loop returns the tree tokens [B, T] (node 0 = root). A chain samples each token with the
uniform the target will sample that position with; tree candidates are the draft's top-k.

An EAGLE head drafts through the same loops when given `catch_hidden` [B, W, H], the target hidden
state paired with each catch-up token (entry p of the head's cache holds token x_{p+1} with target
hidden h_p). Drafted nodes have no target hidden state, so each takes the head's own output feature
at its parent instead (EAGLE's feature extrapolation); a depth-1 node's parent output is the head's
output at the last real catch-up entry (the root). An EAGLE-3 head's catch_hidden is the target's
fused features [B, W, 3H], and its drafted nodes take its own outputs [.., H] the same way.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specair.graphs.sampling import request_probs, sample_from_probs
from specair.graphs.steps import prefill_chunk
from specair.graphs.tree import TreeBuffers, TreeTemplate
from specair.models.eagle import EagleHead
from specair.models.eagle3 import Eagle3Head
from specair.models.llama import Transformer

Draft = Transformer | EagleHead | Eagle3Head


class _Step:
    """The state shared by a draft loop's passes after the catch-up."""

    def __init__(self, draft: Draft, catch_tokens: Tensor, n_catch: Tensor, draft_len: Tensor,
                 k_cache: Tensor, v_cache: Tensor, ctx: int, catch_hidden: Tensor | None = None) -> None:
        self.draft, self.draft_len, self.ctx = draft, draft_len, ctx
        self.k_cache, self.v_cache = k_cache, v_cache
        self.logits, hidden, self.catch_k, self.catch_v = prefill_chunk(draft, catch_tokens, draft_len, n_catch,
                                                                        k_cache, v_cache, ctx, catch_hidden)
        self.root = catch_tokens.gather(1, (n_catch - 1).unsqueeze(1)).squeeze(1)
        # A hidden-state draft (EAGLE): the root's output feature, which its children take as input.
        self.reads_hidden = catch_hidden is not None
        self.root_hidden = None
        if self.reads_hidden:
            last = (n_catch - 1).view(-1, 1, 1).expand(-1, 1, hidden.shape[-1])
            self.root_hidden = hidden.gather(1, last).squeeze(1)  # [B, H]
        self.root_pos = draft_len + n_catch - 1
        W = catch_tokens.shape[1]
        self.catch_valid = torch.arange(W, device=catch_tokens.device) < n_catch.unsqueeze(1)  # [B, W]
        self.prev_k, self.prev_v = self.catch_k, self.catch_v

    def feed(self, tokens: Tensor, depth: int, sees_prev: Tensor,
             parent_hidden: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Run F nodes of one depth [B, F]; sees_prev [B, F, E'] marks which drafted nodes so far each
        one sees (the catch-up is always visible); parent_hidden [B, F, H] is the parents' output
        feature (hidden-state drafts only). Appends their K/V; returns logits [B, F, V] and the
        nodes' hidden outputs [B, F, H]."""
        B, Fn = tokens.shape
        seen = torch.cat([self.catch_valid.unsqueeze(1).expand(B, Fn, -1), sees_prev,
                          torch.eye(Fn, dtype=torch.bool, device=tokens.device).expand(B, Fn, Fn)], dim=-1)
        positions = (self.root_pos + depth).unsqueeze(1).expand(B, Fn)
        extra = {"input_hidden": parent_hidden} if self.reads_hidden else {}
        out = self.draft(tokens, positions, self.draft_len, self.k_cache[..., :self.ctx, :],
                         self.v_cache[..., :self.ctx, :], tree_mask=seen, prev_k=self.prev_k, prev_v=self.prev_v,
                         **extra)
        self.prev_k = torch.cat([self.prev_k, out.new_k], dim=3)
        self.prev_v = torch.cat([self.prev_v, out.new_v], dim=3)
        return out.logits, out.hidden


def draft_chain(draft: Draft, catch_tokens: Tensor, n_catch: Tensor, draft_len: Tensor, k_cache: Tensor,
                v_cache: Tensor, k: int, temperature: Tensor, top_k: Tensor, top_p: Tensor, uniforms: Tensor,
                ctx: int, filtered: bool = True, *,
                catch_hidden: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """k tokens sampled one after another from the draft (argmax where temperature is 0).

    catch_tokens [B, W] with n_catch [B] real ones (the last is the root), draft_len [B] tokens already
    in the draft cache, uniforms [B, k]: the uniforms of the positions drafted, the ones the target will
    sample those positions with (the closer the two distributions, the likelier the same token);
    catch_hidden [B, W, H] for an EAGLE head (see the module docstring). Returns tree tokens [B, k+1] and
    the catch-up's K/V [L, B, Hkv, W, D] (for slots draft_len + 0..W-1).
    """
    s = _Step(draft, catch_tokens, n_catch, draft_len, k_cache, v_cache, ctx, catch_hidden)
    B = catch_tokens.shape[0]
    logits, tokens = s.logits, [s.root]
    hidden = None if s.root_hidden is None else s.root_hidden.unsqueeze(1)
    for i in range(k):
        tok = sample_from_probs(request_probs(logits, temperature, top_k, top_p, filtered), uniforms[:, i])
        tokens.append(tok)
        if i + 1 < k:
            chain = torch.ones(B, 1, i, dtype=torch.bool, device=tok.device)
            out, hidden = s.feed(tok.unsqueeze(1), i + 1, chain, hidden)
            logits = out[:, 0]
    return torch.stack(tokens, 1), s.catch_k, s.catch_v


def draft_static_tree(draft: Draft, catch_tokens: Tensor, n_catch: Tensor, draft_len: Tensor,
                      k_cache: Tensor, v_cache: Tensor, template: TreeTemplate, ctx: int,
                      buffers: TreeBuffers | None = None, *,
                      catch_hidden: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Fill a static tree template level by level: node i is the ranks[i]-th most likely token of the
    draft at its parent. One draft pass per level (the last level is never fed).

    `buffers`: the template's buffers on the graph's device (default: on the CPU); catch_hidden
    [B, W, H] for an EAGLE head. Returns tree tokens [B, T] and the catch-up's K/V.
    """
    s = _Step(draft, catch_tokens, n_catch, draft_len, k_cache, v_cache, ctx, catch_hidden)
    B, V = s.logits.shape
    buf = buffers or template.buffers()
    parents, ranks, anc = buf.parents, buf.ranks, buf.ancestor_mask
    T, width = template.num_nodes, max(template.ranks) + 1
    tokens = s.root.new_zeros(B, T)
    tokens[:, 0] = s.root
    node_logits = s.logits.new_zeros(B, T, V)
    node_logits[:, 0] = s.logits
    node_hidden = None
    if s.root_hidden is not None:
        node_hidden = s.root_hidden.new_zeros(B, T, s.root_hidden.shape[-1])
        node_hidden[:, 0] = s.root_hidden
    for d in range(1, len(buf.levels)):
        nodes = buf.levels[d]
        cand = node_logits[:, parents[nodes]].topk(width, dim=-1).indices  # [B, F, width]
        tokens[:, nodes] = cand.gather(2, ranks[nodes].view(1, -1, 1).expand(B, -1, 1)).squeeze(2)
        if d + 1 < len(buf.levels):
            # BFS order: the nodes fed so far are ids 1..first-1, in order, after the catch-up.
            first = sum(level.shape[0] for level in buf.levels[:d])
            sees = anc[nodes, 1:first].unsqueeze(0).expand(B, -1, -1)
            parent_hidden = None if node_hidden is None else node_hidden[:, parents[nodes]]
            out, hidden = s.feed(tokens[:, nodes], d, sees, parent_hidden)
            node_logits[:, nodes] = out
            if node_hidden is not None:
                node_hidden[:, nodes] = hidden
    return tokens, s.catch_k, s.catch_v


def draft_topk_tree(draft: Draft, catch_tokens: Tensor, n_catch: Tensor, draft_len: Tensor,
                    k_cache: Tensor, v_cache: Tensor, depth: int, topk: int, num_nodes: int,
                    ctx: int, *, catch_hidden: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A per-row dynamic tree (SpecInfer / EAGLE-2): expand the best `topk` frontier nodes by cumulative
    log-probability for `depth` levels, then keep the global best `num_nodes` candidates.

    Candidates get ids in creation order, so a parent's id is below its children's; a child's score
    never exceeds its parent's, and a stable sort breaks ties towards lower ids, so the kept set is
    closed under parents. catch_hidden [B, W, H] for an EAGLE head. Returns tree tokens [B, N+1],
    parents [B, N+1] (-1 at the root) and the catch-up's K/V.
    """
    s = _Step(draft, catch_tokens, n_catch, draft_len, k_cache, v_cache, ctx, catch_hidden)
    B = s.logits.shape[0]
    K = topk
    M = 1 + K + (depth - 1) * K * K  # root + every candidate ever created
    dev = s.logits.device
    logp, tok = s.logits.log_softmax(-1).topk(K, dim=-1)  # depth-1 candidates: ids 1..K
    cand_tok, cand_score, cand_parent = [tok], [logp], [torch.zeros(B, K, dtype=torch.long, device=dev)]
    front_ids = torch.arange(1, K + 1, device=dev).expand(B, K)
    front_tok, front_score = tok, logp
    anc = torch.zeros(B, K, 0, dtype=torch.bool, device=dev)  # which fed nodes each frontier node descends from
    # The frontier's parents' output features (hidden-state drafts): all depth-1 nodes hang off the root.
    front_parent_hidden = None if s.root_hidden is None else s.root_hidden.unsqueeze(1).expand(B, K, -1)
    next_id = K + 1
    for d in range(1, depth):
        out, hidden = s.feed(front_tok, d, anc, front_parent_hidden)
        child_logp, child_tok = out.log_softmax(-1).topk(K, dim=-1)  # [B, K, K]
        scores = (front_score.unsqueeze(-1) + child_logp).reshape(B, K * K)
        ids = torch.arange(next_id, next_id + K * K, device=dev).expand(B, -1)
        cand_tok.append(child_tok.reshape(B, K * K))
        cand_score.append(scores)
        cand_parent.append(front_ids.repeat_interleave(K, dim=1))
        # The frontier just fed becomes part of its children's ancestry.
        self_anc = torch.cat([anc, torch.eye(K, dtype=torch.bool, device=dev).expand(B, K, K)], dim=-1)
        best = scores.topk(K, dim=-1).indices
        front_ids = ids.gather(1, best)
        front_tok = child_tok.reshape(B, K * K).gather(1, best)
        front_score = scores.gather(1, best)
        anc = self_anc.gather(1, (best // K).unsqueeze(-1).expand(-1, -1, self_anc.shape[-1]))
        if front_parent_hidden is not None:
            front_parent_hidden = hidden.gather(1, (best // K).unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
        next_id += K * K
    all_tok = torch.cat([s.root.unsqueeze(1)] + cand_tok, 1)  # [B, M] indexed by candidate id
    all_score = torch.cat([torch.zeros(B, 1, dtype=logp.dtype, device=dev)] + cand_score, 1)
    all_parent = torch.cat([torch.full((B, 1), -1, dtype=torch.long, device=dev)] + cand_parent, 1)
    order = all_score.sort(dim=-1, descending=True, stable=True).indices[:, : num_nodes + 1]
    # Root (id 0, score 0) first, then by id: parents before children. Sorted as float and indexed in
    # int32 because Ascend ATC's TopK and ScatterElements take no int64.
    keep = order.float().sort(dim=-1).values.long()
    new_index = torch.full((B, M), -1, dtype=torch.int32, device=dev)
    new_index.scatter_(1, keep, torch.arange(num_nodes + 1, dtype=torch.int32, device=dev).expand(B, -1))
    parent_ids = all_parent.gather(1, keep)
    parents = torch.where(parent_ids < 0, parent_ids, new_index.gather(1, parent_ids.clamp(min=0)).long())
    tokens = all_tok.gather(1, keep)
    return tokens, parents, s.catch_k, s.catch_v
