"""Acceptance samplers for token trees (a chain is the tree with one child per node).

Shared inputs: tree_tokens [B, T] (node 0 = root = last accepted token), target_logits [B, T, V]
(the target's logits AT each node, i.e. the distribution of its children), and the tree's index
buffers per row: children [B, T, W] / paths [B, T, D+1] (static templates expand theirs to B).
Sampling parameters are per-row tensors [B]; randomness comes in as uniforms. Rows are independent.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .sampling import request_probs, sample_from_probs


class AcceptResult(NamedTuple):
    num_accepted: Tensor  # [B] long: draft tokens accepted (0..D), the bonus not counted
    tokens: Tensor  # [B, D+1] long: accepted draft tokens, then the bonus/recovered token at num_accepted; -1 after
    node_ids: Tensor  # [B, D+1] long: root (0) and the accepted nodes; -1 after num_accepted + 1 entries


def _result(tree_tokens: Tensor, path: Tensor, num_accepted: Tensor, last_token: Tensor) -> AcceptResult:
    """Tokens of an accepted path [B, D+1] (root first, -1 padded) followed by the bonus/recovered token."""
    nxt = torch.cat([path[:, 1:], torch.full_like(path[:, :1], -1)], 1)
    drafted = tree_tokens.gather(1, nxt.clamp(min=0))
    j = torch.arange(path.shape[1], device=path.device)
    n = num_accepted[:, None]
    tokens = torch.where(j < n, drafted, torch.where(j == n, last_token[:, None], -1))
    return AcceptResult(num_accepted, tokens, path)


def _longest_path(ok: Tensor, target_logits: Tensor, tree_tokens: Tensor, paths: Tensor) -> AcceptResult:
    """Accept the longest root path whose nodes are all ok (ties: lowest node id); then the target argmax."""
    B, T, Dp1 = paths.shape
    ids = torch.arange(T, device=paths.device)
    # The root is always accepted; column T stands for the -1 padding, also ok.
    ok = torch.cat([ok | (ids == 0), torch.ones_like(ok[:, :1])], 1)
    path_ok = ok.gather(1, torch.where(paths < 0, T, paths).view(B, T * Dp1)).view(B, T, Dp1).all(-1)
    depth = (paths >= 0).sum(-1) - 1
    # A unique score per node, so the choice never depends on how argmax breaks ties.
    best = torch.where(path_ok, depth * T + (T - 1 - ids), -1).argmax(-1)
    path = paths.gather(1, best.view(B, 1, 1).expand(B, 1, Dp1)).squeeze(1)
    bonus = target_logits.argmax(-1).gather(1, best[:, None]).squeeze(1)
    return _result(tree_tokens, path, depth.gather(1, best[:, None]).squeeze(1), bonus)


def _parent_ids(paths: Tensor) -> Tensor:
    """The parent of every node [B, T] read off its path (the root gets itself)."""
    depth = (paths >= 0).sum(-1) - 1
    return paths.gather(2, (depth - 1).clamp(min=0)[..., None]).squeeze(-1)


def accept_greedy(tree_tokens: Tensor, target_logits: Tensor, paths: Tensor) -> AcceptResult:
    """Greedy verification: the longest root path whose every token is the target's argmax at its parent.

    Ties between equally long paths (only possible with duplicate sibling tokens) go to the lowest node
    id. The bonus token is the target's argmax at the last accepted node.
    """
    ok = tree_tokens == target_logits.argmax(-1).gather(1, _parent_ids(paths))
    return _longest_path(ok, target_logits, tree_tokens, paths)


def accept_typical(
    tree_tokens: Tensor,
    target_logits: Tensor,
    paths: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
    filtered: bool = True,
) -> AcceptResult:
    """Typical acceptance (Medusa §3.3.1, vLLM TypicalAcceptanceSampler). LOSSY by design.

    A node's token x is acceptable iff p(x) > min(posterior_threshold, posterior_alpha * exp(-H)), where p
    is the target distribution at its parent (after temperature/top-k/top-p; one-hot argmax for
    temperature-0 rows, which makes this exactly greedy acceptance) and H its entropy. The accepted path
    is the longest root path of acceptable tokens (ties: lowest node id; Medusa breaks them by
    likelihood), followed by the target's argmax at its last node (vLLM's recovered token). The output
    does not follow the target's distribution: it trades exactness for longer accepted runs.
    posterior_threshold / posterior_alpha are compile-time constants (a new value means a new graph);
    filtered=False (static) skips top-k/top-p for requests that use neither.
    """
    p = request_probs(target_logits, temperature, top_k, top_p, filtered)
    # Entropy as in vLLM (model_executor/layers/typical_acceptance_sampler.py, _evaluate_accepted_tokens)
    # and Medusa (medusa/model/utils.py, evaluate_posterior): H = -sum p log(p + 1e-5), natural log.
    entropy = -(p * torch.log(p + 1e-5)).sum(-1)
    threshold = (posterior_alpha * torch.exp(-entropy)).clamp(max=posterior_threshold)  # [B, T]
    B, T, V = p.shape
    parent = _parent_ids(paths)
    # p at each node's parent, read at the node's own token.
    p_tok = p.reshape(B, T * V).gather(1, parent * V + tree_tokens.clamp(0, V - 1))
    ok = p_tok > threshold.gather(1, parent)
    return _longest_path(ok, target_logits, tree_tokens, paths)


def accept_rejection(
    tree_tokens: Tensor,
    target_logits: Tensor,
    draft_probs: Tensor | None,
    children: Tensor,
    uniforms: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    *,
    max_depth: int | None = None,
    return_probs: bool = False,
    filtered: bool = True,
) -> AcceptResult | tuple[AcceptResult, Tensor, Tensor]:
    """Exact speculative sampling on trees: SpecInfer-style multi-step speculative sampling (MSS).

    draft_probs [B, T, V]: q_i, the distribution node i's token was proposed from (for a sampled node,
    the draft's distribution at its parent; for a deterministically chosen top-k candidate, one-hot of
    its token; pass None when every node was chosen deterministically: the one-hot q is then implied by
    the tokens, never materialised). The output follows the target distribution p (request_probs: temperature, top-k, top-p;
    one-hot argmax at temperature 0, where this reduces to greedy) exactly, provided each sibling is
    drawn from its q_i independently of earlier siblings (i.i.d. samples, or fixed candidates with
    one-hot q). Testing siblings independently against the unmodified p would be biased.

    Walk from the root with p_cur = p[root]. At each depth, try the current node's children in rank
    order: child x accepted iff u < min(1, p_cur(x) / q(x)); on rejection p_cur <- normalize(max(0,
    p_cur - q)) for the next sibling. The first accepted child becomes current (p_cur <- p[child]);
    if none is accepted, stop. The last token is sampled from p_cur. A chain (W = 1) is classic
    speculative sampling: residual on the first rejection, bonus when all k are accepted.

    uniforms [B, T+1]: column i (i >= 1) is node i's accept test, column T the final sample.
    filtered=False (static) skips top-k/top-p for requests that use neither.
    max_depth: the tree's depth D (static), which sets the output width D + 1; default T - 1, exact
    for a chain and an upper bound for any tree (pass template.max_depth for trees).
    With return_probs, also returns accept_prob [B, T] (the min(1, p_cur/q) used at each visited node,
    0 elsewhere) and final_probs [B, V] (the distribution the last token was sampled from).
    """
    B, T, V = target_logits.shape
    W = children.shape[-1]
    D = T - 1 if max_depth is None else max_depth
    p = request_probs(target_logits, temperature, top_k, top_p, filtered)
    dt = p.dtype
    q_all = None if draft_probs is None else draft_probs.to(dt)
    u_all = uniforms.to(dt)
    tok = tree_tokens.clamp(0, V - 1)
    ids = torch.arange(T, device=p.device)
    # Below this mass a residual is rounding noise (p_cur == q exactly): keep p_cur. The bias this can
    # add is at most the threshold, since rejection happens with probability = the residual's mass.
    tiny = 64 * torch.finfo(dt).eps

    def row(x: Tensor, node: Tensor) -> Tensor:  # x [B, T, V] at node [B] -> [B, V]
        return x.gather(1, node.view(B, 1, 1).expand(B, 1, V)).squeeze(1)

    cur = torch.zeros(B, dtype=torch.long, device=p.device)
    p_cur = p[:, 0]
    alive = torch.ones(B, dtype=torch.bool, device=p.device)
    accept_prob = torch.zeros(B, T, dtype=dt, device=p.device)
    path = [cur]
    for _ in range(D):
        kids = children.gather(1, cur.view(B, 1, 1).expand(B, 1, W)).squeeze(1)  # [B, W]
        moved = torch.zeros_like(alive)
        nxt = cur
        for j in range(W):
            child = kids[:, j]
            valid = alive & ~moved & (child >= 0)
            c = child.clamp(min=0)
            x = tok.gather(1, c[:, None])
            px = p_cur.gather(1, x).squeeze(1)
            if q_all is None:  # q = one-hot(x): accept with p(x); the residual is p_cur without x
                a = px.clamp(max=1)
                resid = p_cur.scatter(1, x, 0.0)
            else:
                q = row(q_all, c)
                qx = q.gather(1, x).squeeze(1)
                # q(x) == 0 means x could not have been proposed; accept it iff the target allows it.
                a = torch.where(qx > 0, (px / qx.clamp(min=torch.finfo(dt).tiny)).clamp(max=1), (px > 0).to(dt))
                resid = (p_cur - q).clamp(min=0)
            acc = valid & (u_all.gather(1, c[:, None]).squeeze(1) < a)
            accept_prob = torch.where((ids == c[:, None]) & valid[:, None], a[:, None], accept_prob)
            mass = resid.sum(-1, keepdim=True)
            rejected = (valid & ~acc)[:, None] & (mass > tiny)
            p_cur = torch.where(rejected, resid / mass.clamp(min=tiny), p_cur)
            p_cur = torch.where(acc[:, None], row(p, c), p_cur)
            nxt = torch.where(acc, c, nxt)
            moved = moved | acc
        path.append(torch.where(moved, nxt, -1))
        cur = nxt
        alive = alive & moved
    path_t = torch.stack(path, 1)
    num_accepted = (path_t >= 0).sum(-1) - 1
    last = sample_from_probs(p_cur, u_all[:, T])
    result = _result(tree_tokens, path_t, num_accepted, last)
    if return_probs:
        return result, accept_prob, p_cur
    return result
