"""Prefill-chunk and decode-step graphs of the target (and of a draft model).

Every shape is static: the chunk width, the batch and the context bucket `ctx` (how much of the cache
attention reads) are fixed per compiled graph; lengths and positions arrive as tensors. Graphs only
read the cache and return the new K/V; the caller commits them (`graphs.kv`), so every graph is a
pure function that any backend can capture.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specair.graphs.sampling import sample
from specair.models.llama import Transformer


def prefill_chunk(model: Transformer, tokens: Tensor, cache_len: Tensor, n_valid: Tensor,
                  k_cache: Tensor, v_cache: Tensor, ctx: int,
                  input_hidden: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A chunk tokens [B, Tc] (first n_valid [B] real, the rest padding) after cache_len [B].

    Returns the logits [B, V] at each row's last real token, the hidden states of the whole chunk
    [B, Tc, H] (EAGLE heads read every position), and the chunk's K/V [L, B, Hkv, Tc, D] for slots
    cache_len + 0..Tc-1. Committing the padding's K/V is harmless: it lands past the new length,
    where the mask hides it until real tokens overwrite it. `input_hidden` [B, Tc, H] feeds a model
    that reads hidden states (an EAGLE head); plain decoders take none.
    """
    Tc = tokens.shape[1]
    positions = (cache_len.unsqueeze(1) + torch.arange(Tc, device=tokens.device)).clamp(
        max=model.config.max_position_embeddings - 1)
    last = (n_valid - 1).clamp(min=0).unsqueeze(1)
    extra = {} if input_hidden is None else {"input_hidden": input_hidden}
    out = model(tokens, positions, cache_len, k_cache[..., :ctx, :], v_cache[..., :ctx, :], logits_index=last,
                **extra)
    return out.logits[:, 0], out.hidden, out.new_k, out.new_v


def decode_step(model: Transformer, tokens: Tensor, cache_len: Tensor, k_cache: Tensor, v_cache: Tensor,
                temperature: Tensor, top_k: Tensor, top_p: Tensor, uniform: Tensor,
                ctx: int, variant: str = "filtered") -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """One autoregressive step: tokens [B] at slot cache_len [B] → (next tokens [B], logits [B, V],
    hidden [B, H], new_k, new_v [L, B, Hkv, 1, D]). `variant` is the static sampling variant (see `sample`)."""
    out = model(tokens.unsqueeze(1), cache_len.unsqueeze(1), cache_len,
                k_cache[..., :ctx, :], v_cache[..., :ctx, :])
    logits = out.logits[:, 0]
    return sample(logits, temperature, top_k, top_p, uniform, variant), logits, out.hidden[:, 0], out.new_k, out.new_v
