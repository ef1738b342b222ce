"""Prefill-chunk and decode-step graphs of the target (and of a draft model): forward + KV commit.

Every shape is static: the chunk width, the batch and the context bucket `ctx` (how much of the cache
attention reads) are fixed per compiled graph; lengths and positions arrive as tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specair.graphs.kv import commit_kv
from specair.graphs.sampling import sample
from specair.models.llama import Transformer


def prefill_chunk(model: Transformer, tokens: Tensor, cache_len: Tensor, n_valid: Tensor,
                  k_cache: Tensor, v_cache: Tensor, ctx: int) -> tuple[Tensor, Tensor]:
    """Append a chunk tokens [B, Tc] (first n_valid [B] real, the rest padding) after cache_len [B].

    Returns the logits [B, V] and hidden state [B, H] at each row's last real token. Padding K/V lands
    in slots past the new length, where the mask hides it until real tokens overwrite it; the caller
    keeps Tc spare slots at the end of the cache for it.
    """
    Tc = tokens.shape[1]
    slots = cache_len.unsqueeze(1) + torch.arange(Tc, device=tokens.device)
    positions = slots.clamp(max=model.config.max_position_embeddings - 1)
    last = (n_valid - 1).clamp(min=0).unsqueeze(1)
    out = model(tokens, positions, cache_len, k_cache[..., :ctx, :], v_cache[..., :ctx, :], logits_index=last)
    commit_kv(k_cache, v_cache, out.new_k, out.new_v, slots)
    hidden = out.hidden.gather(1, last.unsqueeze(-1).expand(-1, -1, out.hidden.shape[-1]))
    return out.logits[:, 0], hidden[:, 0]


def decode_step(model: Transformer, tokens: Tensor, cache_len: Tensor, k_cache: Tensor, v_cache: Tensor,
                temperature: Tensor, top_k: Tensor, top_p: Tensor, uniform: Tensor,
                ctx: int, variant: str = "filtered") -> tuple[Tensor, Tensor]:
    """One autoregressive step: tokens [B] at slot cache_len [B] → (next tokens [B], logits [B, V]).
    `variant` is the static sampling variant (see `sample`)."""
    out = model(tokens.unsqueeze(1), cache_len.unsqueeze(1), cache_len,
                k_cache[..., :ctx, :], v_cache[..., :ctx, :])
    commit_kv(k_cache, v_cache, out.new_k, out.new_v, cache_len.unsqueeze(1))
    logits = out.logits[:, 0]
    return sample(logits, temperature, top_k, top_p, uniform, variant), logits
