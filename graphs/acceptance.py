"""Acceptance samplers for token trees (a chain is the tree with one child per node).

Shared inputs: tree_tokens [B, T] (node 0 = root = last accepted token), target_logits [B, T, V]
(the target's logits AT each node, i.e. the distribution of its children), and the tree's index
buffers per row: children [B, T, W] / paths [B, T, D+1] (static templates expand theirs to B).
Sampling parameters are per-row tensors [B]; randomness comes in as uniforms. Rows are independent.

Every method accepts the longest root path of acceptable nodes, then the target's token at its last
node. Greedy and exact acceptance let the target decide a token at each node (its argmax, or its sample)
and accept a node holding what its parent decided. With `accept_exact` the target's token at depth d is
drawn from the uniform of position root + d + 1, so the result is the token plain decoding would have
sampled at every position: speculation changes how many passes that takes, never what comes out.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .sampling import request_probs, sample


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


def _longest_path(ok: Tensor, decided: Tensor, tree_tokens: Tensor, paths: Tensor) -> AcceptResult:
    """Accept the longest root path whose nodes are all ok (ties: lowest node id); then the token the
    target decided at its last node (decided [B, T])."""
    B, T, Dp1 = paths.shape
    ids = torch.arange(T, device=paths.device)
    # The root is always accepted; column T stands for the -1 padding, also ok.
    ok = torch.cat([ok | (ids == 0), torch.ones_like(ok[:, :1])], 1)
    path_ok = ok.gather(1, torch.where(paths < 0, T, paths).view(B, T * Dp1)).view(B, T, Dp1).all(-1)
    depth = (paths >= 0).sum(-1) - 1
    # A unique score per node, so the choice never depends on how argmax breaks ties.
    best = torch.where(path_ok, depth * T + (T - 1 - ids), -1).argmax(-1)
    path = paths.gather(1, best.view(B, 1, 1).expand(B, 1, Dp1)).squeeze(1)
    bonus = decided.gather(1, best[:, None]).squeeze(1)
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
    decided = target_logits.argmax(-1)
    return _longest_path(tree_tokens == decided.gather(1, _parent_ids(paths)), decided, tree_tokens, paths)


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
    return _longest_path(ok, target_logits.argmax(-1), tree_tokens, paths)


def accept_exact(tree_tokens: Tensor, target_logits: Tensor, paths: Tensor, uniforms: Tensor, temperature: Tensor,
                 top_k: Tensor, top_p: Tensor, variant: str = "filtered") -> AcceptResult:
    """Exact sampling: the target samples every node's next token (inverse CDF of request_probs, argmax for
    temperature-0 rows) from the uniform of that token's position, and a node is accepted iff its token is
    the sample at its parent. The output is the target's own sample at every position, so it follows the
    target's distribution whatever was proposed, and equals plain decoding's tokens for the same uniforms.

    uniforms [B, D+1]: column d decides the tokens at depth d + 1 (position root_pos + d + 1).
    variant (static): as `sample`'s. For candidates chosen deterministically (top-k trees, n-gram) the
    chance of accepting a node equals multi-draft rejection sampling's (SpecInfer); a draft that samples
    its token from the same uniform is accepted with the overlap of the two inverse CDFs' intervals.
    """
    B, T, V = target_logits.shape
    depth = (paths >= 0).sum(-1) - 1
    u = uniforms.gather(1, depth)
    flat = [x.repeat_interleave(T) for x in (temperature, top_k, top_p)]
    decided = sample(target_logits.reshape(B * T, V), *flat, u.reshape(B * T), variant).view(B, T)
    return _longest_path(tree_tokens == decided.gather(1, _parent_ids(paths)), decided, tree_tokens, paths)
