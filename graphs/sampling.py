"""Sampling with per-row parameters as tensors and randomness as an input (no RNG ops in graphs).

The random number that decides a token depends only on the request's seed and that token's position
(`position_uniforms`), never on the step, the batch or whether the step speculates: a seeded request
samples the same tokens whatever runs beside it.

`filtered` is a static choice of graph variant: top-k/top-p need a sort over the vocabulary, which
costs more than the rest of sampling together, so requests that use neither run the variant without it.
A backend may capture the filters as one op of its own (`use_filter`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from specair.models.llama import KernelSlot

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser (uint64 arithmetic wraps)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def position_uniforms(seed: int, positions: np.ndarray, dtype: torch.dtype) -> Tensor:
    """The uniforms in [0, 1) that decide the tokens at `positions` of a request with this seed.

    Counter-based: the SplitMix64 stream keyed by the mixed seed, read at each position, so any token's
    draw is available without the ones before it. float32 keeps 24 random bits and float64 53, so the
    value is exact in its dtype and never rounds up to 1. runtime/native/engine.cpp computes the same.
    """
    key = _mix64(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))
    with np.errstate(over="ignore"):
        z = _mix64(key + np.asarray(positions, dtype=np.uint64) * _GOLDEN)
    bits = 53 if dtype == torch.float64 else 24
    return torch.from_numpy((z >> np.uint64(64 - bits)).astype(np.float64) * 2.0 ** -bits).to(dtype)


# The top-k/top-p filter `logits_to_probs` applies: its own sort, unless a backend swaps in a kernel for a
# capture (`use_filter`).
_FILTER = KernelSlot()


def use_filter(kernel: Callable[[Tensor, Tensor, Tensor], Tensor] | None) -> contextlib.AbstractContextManager[None]:
    """Filter float32 rows through `kernel(x, top_k, top_p)` while the block runs (None: the sort): x [B, ..., V]
    temperature-scaled logits, top_k and top_p [B] as `logits_to_probs` takes them; it returns the filtered
    distribution [B, ..., V]."""
    return _FILTER.use(kernel)


def logits_to_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor,
                    filtered: bool = True) -> Tensor:
    """Probabilities [..., V] after temperature, then top-k, then top-p (the order of transformers and vLLM).

    logits [B, ..., V]; temperature, top_k, top_p [B] (top_k <= 0 and top_p >= 1 disable the filters;
    filtered=False skips them altogether). A temperature-0 row gets the distribution at temperature
    1e-5; use `request_probs` for the exact one-hot of greedy rows.
    """
    V = logits.shape[-1]
    extra = (1,) * (logits.dim() - 1)
    t = temperature.clamp(min=1e-5).view(-1, *extra)
    x = (logits / t).float() if logits.dtype in (torch.float16, torch.bfloat16) else logits / t
    if not filtered:
        return x.softmax(dim=-1)
    if _FILTER.fn is not None and x.dtype == torch.float32:
        # Rows without filters get the plain variant's softmax, so a batch's filtering never touches them.
        unfiltered = ((top_k <= 0) & (top_p >= 1)).view(-1, *extra)
        return torch.where(unfiltered, x.softmax(dim=-1), _FILTER.fn(x, top_k, top_p.to(x.dtype)))
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V)).view(-1, *extra)
    p_max = top_p.view(-1, *extra).to(x.dtype)
    sorted_x, order = x.sort(dim=-1, descending=True)
    ranks = torch.arange(V, device=logits.device)
    sorted_x = sorted_x.masked_fill(ranks >= k, float("-inf"))
    p = sorted_x.softmax(dim=-1)
    # Keep a token while the mass strictly above it is below top_p: the smallest set reaching top_p. The top
    # token stays whatever top_p is (one below float32's range arrives as 0).
    keep = ((p.cumsum(dim=-1) - p) < p_max) | (ranks == 0)
    p = sorted_x.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    return torch.zeros_like(p).scatter(-1, order, p)


def request_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor,
                  filtered: bool = True) -> Tensor:
    """The distribution a request samples from [B, ..., V]: one-hot on the argmax for temperature-0
    rows, else `logits_to_probs`. Both the target's and the draft's distributions are this."""
    probs = logits_to_probs(logits, temperature, top_k, top_p, filtered)
    greedy = F.one_hot(logits.argmax(-1), logits.shape[-1]).to(probs.dtype)
    return torch.where((temperature == 0).view(-1, *(1,) * (logits.dim() - 1)), greedy, probs)


def sample_from_probs(probs: Tensor, uniform: Tensor) -> Tensor:
    """Inverse-CDF sampling: probs [..., V], uniform [...] in [0, 1) → token ids [...]."""
    cdf = probs.cumsum(dim=-1)
    u = uniform.unsqueeze(-1).to(cdf.dtype) * cdf[..., -1:]
    return (cdf <= u).sum(dim=-1).clamp(max=probs.shape[-1] - 1)


def sample(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, uniform: Tensor,
           variant: str = "filtered") -> Tensor:
    """Next tokens [B] from logits [B, V]: argmax where temperature is 0, else a sample.

    variant (static): "greedy" (every row has temperature 0: argmax only), "plain" (temperature only),
    "filtered" (temperature, top-k, top-p).
    """
    greedy = logits.argmax(dim=-1)
    if variant == "greedy":
        return greedy
    probs = logits_to_probs(logits, temperature, top_k, top_p, filtered=variant == "filtered")
    return torch.where(temperature > 0, sample_from_probs(probs, uniform), greedy)


def sampling_variant(temperatures: list[float], top_ks: list[int], top_ps: list[float]) -> str:
    """The cheapest `sample` variant that serves every row (a host-side choice, made per step)."""
    if all(t == 0 for t in temperatures):
        return "greedy"
    if all(k <= 0 for k in top_ks) and all(p >= 1 for p in top_ps):
        return "plain"
    return "filtered"
