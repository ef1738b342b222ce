"""Sampling with per-row parameters as tensors and randomness as an input (no RNG ops in graphs)."""

from __future__ import annotations

import torch
from torch import Tensor


def logits_to_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Probabilities [..., V] after temperature, then top-k, then top-p (the order of transformers and vLLM).

    logits [B, ..., V]; temperature, top_k, top_p [B] (top_k <= 0 and top_p >= 1 disable the filters).
    A row with temperature 0 gets the distribution at temperature 1e-5, which rounds to one-hot on
    the argmax; greedy callers take the argmax directly.
    """
    V = logits.shape[-1]
    extra = (1,) * (logits.dim() - 1)
    t = temperature.clamp(min=1e-5).view(-1, *extra)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V)).view(-1, *extra)
    p_max = top_p.view(-1, *extra).to(logits.dtype)
    x = (logits / t).float() if logits.dtype in (torch.float16, torch.bfloat16) else logits / t
    sorted_x, order = x.sort(dim=-1, descending=True)
    ranks = torch.arange(V, device=logits.device)
    sorted_x = sorted_x.masked_fill(ranks >= k, float("-inf"))
    p = sorted_x.softmax(dim=-1)
    # Keep a token while the mass strictly above it is below top_p: the smallest set reaching top_p.
    keep = (p.cumsum(dim=-1) - p) < p_max
    p = sorted_x.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    return torch.zeros_like(p).scatter(-1, order, p)


def sample_from_probs(probs: Tensor, uniform: Tensor) -> Tensor:
    """Inverse-CDF sampling: probs [..., V], uniform [...] in [0, 1) → token ids [...]."""
    cdf = probs.cumsum(dim=-1)
    u = uniform.unsqueeze(-1).to(cdf.dtype) * cdf[..., -1:]
    return (cdf <= u).sum(dim=-1).clamp(max=probs.shape[-1] - 1)


def sample(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, uniform: Tensor) -> Tensor:
    """Next tokens [B] from logits [B, V]: argmax where temperature is 0, else a filtered sample."""
    probs = logits_to_probs(logits, temperature, top_k, top_p)
    return torch.where(temperature > 0, sample_from_probs(probs, uniform), logits.argmax(dim=-1))
