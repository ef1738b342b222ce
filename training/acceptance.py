"""Offline greedy acceptance on held-out distilled sequences.

The distilled answer is exactly the target's own greedy continuation, so a draft chain started at
position p is accepted for as many leading tokens as match that continuation; the verify step then adds
one token of its own (the bonus). For each chain start we record, per depth d = 1..k, whether the true
token was the draft's top-1 (chain) or within its top-w (a full w-ary tree of depth k contains the true
path exactly when every depth is a top-w hit). Inputs along the true path are the true tokens, which is
what the draft sees whenever the earlier tokens were accepted, so these counts are exact for chains and
full trees; a pruned tree (EAGLE-2's top-N rerank, a sparse static template) lands between the two.

Averaging over every position is not what the engine measures: it starts a chain only where the previous
step ended, which is just after a rejected draft (or its bonus token), and those positions are harder than
the average one. `walk` replays each held-out answer the engine's way -- start at the answer's first
position, accept, jump past the accepted tokens and the bonus, repeat -- and its tau is the one the
engine reports on the same sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class AcceptanceCounter:
    """Accumulates per-depth hit ranks over chain starts: rank[i, d] is the rank of the true token at depth
    d among the draft's candidates (0 = its argmax)."""

    depth: int
    widths: tuple[int, ...] = (1, 2, 4, 8)
    ranks: list[Tensor] = field(default_factory=list)
    walks: dict[int, list[int]] = field(default_factory=dict)  # width -> [steps, tokens]

    def add(self, ranks: Tensor) -> None:
        """ranks [N, depth] int: the true token's rank at each depth for N chain starts."""
        if ranks.numel():
            self.ranks.append(ranks.reshape(-1, self.depth).to(torch.int32).cpu())

    def add_walk(self, ranks: Tensor) -> None:
        """ranks [n, depth]: one sequence's chain starts at consecutive positions, in order; walk them as the
        engine steps (each step keeps its accepted drafts plus the bonus token)."""
        for w in self.widths:
            accepted = (ranks < w).to(torch.int32).cumprod(dim=1).sum(1).tolist()
            i, steps, tokens = 0, 0, 0
            while i < len(accepted):
                steps += 1
                tokens += accepted[i] + 1
                i += accepted[i] + 1
            walk = self.walks.setdefault(w, [0, 0])
            walk[0] += steps
            walk[1] += tokens

    def result(self) -> dict:
        """acceptance_by_position (P(first d drafts accepted), d = 1..depth), tau_chain (1 + mean accepted,
        bonus included), and per tree width w the full-tree tau and acceptance (tree_w{w})."""
        ranks = torch.cat(self.ranks) if self.ranks else torch.zeros(0, self.depth, dtype=torch.int32)
        out: dict = {"chain_starts": int(ranks.shape[0]), "depth": self.depth}
        for w in self.widths:
            accepted = (ranks < w).to(torch.int32).cumprod(dim=1)  # [N, depth]: still accepted at depth d
            by_pos = accepted.float().mean(0) if ranks.shape[0] else torch.zeros(self.depth)
            entry = {"acceptance_by_position": [round(float(a), 4) for a in by_pos],
                     "tau": round(1.0 + float(by_pos.sum()), 4)}
            if w == 1:
                out["acceptance_by_position"] = entry["acceptance_by_position"]
                out["tau_chain"] = entry["tau"]
                # Per-depth hit rate given the earlier depths were hits (the usual "acceptance rate").
                cond = [float(by_pos[0])] + [float(by_pos[d] / by_pos[d - 1]) if by_pos[d - 1] > 0 else 0.0
                                             for d in range(1, self.depth)]
                out["conditional_acceptance"] = [round(c, 4) for c in cond]
            else:
                out[f"tree_w{w}"] = entry
        if self.walks:
            out["walk"] = {("tau_chain" if w == 1 else f"tau_tree_w{w}"): round(t / max(n, 1), 4)
                           for w, (n, t) in sorted(self.walks.items())}
        return out


def true_token_rank(logits: Tensor, target: Tensor) -> Tensor:
    """Rank of `target` [...] in `logits` [..., V] (0 = argmax; ties count against the target). Targets < 0
    (outside a reduced vocabulary) get rank V."""
    V = logits.shape[-1]
    safe = target.clamp(min=0)
    t_logit = logits.gather(-1, safe.unsqueeze(-1))
    rank = (logits > t_logit).sum(-1)
    return torch.where(target < 0, torch.full_like(rank, V), rank)


def chain_starts(lengths: Tensor, prompt_lens: Tensor, T: int, depth: int, offset: int) -> Tensor:
    """[B, T] mask of chain starts p whose `depth` targets (token indices p + offset + d, d = 0..depth-1) are
    all real answer tokens."""
    p = torch.arange(T)
    first = p + offset
    last = first + depth - 1
    return (first >= prompt_lens.unsqueeze(1)) & (last < lengths.unsqueeze(1))
