"""What int4 costs a float checkpoint: perplexity on a shipped text (the Gettysburg Address and the Preamble of
the US Constitution, public domain) with every linear layer as specair's int4 kernel computes it, against the
float weights.

The int4 side is the float model with each linear weight replaced by its int4 rounding (the values the kernel
holds: Q4_K's shape where K is a multiple of 256, else Q4_1; `compile/quantize.int4_values`) and each
activation row rounded to int8 per block of 32 as the kernel rounds it, so it is the kernel's product up to
float32 summation order. Weights a GGUF file stores quantized are read as stored and cost nothing against
that file, so only float weights count.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specair.compile.quantize import int4_values
from specair.models.llama import GGUF_PARTS, Transformer

TEXT = Path(__file__).parent / "data" / "quality.txt"
_ROWS = 8192  # rows rounded at a time: the rounding works in float64


def int4_weight(w: Tensor) -> Tensor:
    """w [N, K] as the int4 kernel holds it (`int4_values`), a chunk of rows at a time."""
    out = torch.empty_like(w, dtype=torch.float32)
    for r0 in range(0, w.shape[0], _ROWS):
        out[r0:r0 + _ROWS] = int4_values(w[r0:r0 + _ROWS])
    return out


def int8_rows(x: Tensor) -> Tensor:
    """x [..., K] rounded as the kernel reads activations: int8 per block of 32, scale amax / 127."""
    b = x.reshape(*x.shape[:-1], -1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax.clamp_min(torch.finfo(x.dtype).tiny), torch.zeros_like(amax))
    return (torch.round(b * inv).clamp(-127, 127) * (amax / 127.0)).reshape(x.shape)


def _nll(model: Transformer, ids: Tensor, lm_weight: Tensor, int4: bool) -> float:
    k, v = model.empty_cache(1, 1)
    T = ids.shape[1]
    out = model(ids, torch.arange(T)[None], torch.zeros(1, dtype=torch.long), k, v)
    hidden = out.hidden[0, :-1]
    logits = (int8_rows(hidden) if int4 else hidden) @ lm_weight.t()
    return F.cross_entropy(logits.double(), ids[0, 1:]).item()


def int4_cost(model: Transformer, tokenizer: Any, max_tokens: int = 512) -> dict[str, Any] | None:
    """Perplexity of the shipped text under the float weights and under int4 as the kernel computes it, or None
    when every linear weight is stored quantized (nothing is rounded) or there is no tokenizer to read the text."""
    if tokenizer is None or model.feature_layers:
        return None
    linears = [m for m in model.layers.modules() if isinstance(m, nn.Linear)]
    lm = model.lm_holder.weight
    if all(getattr(m.weight, GGUF_PARTS, None) for m in linears) and getattr(lm, GGUF_PARTS, None):
        return None
    ids = torch.tensor([tokenizer.encode(TEXT.read_text(encoding="utf-8"))[:max_tokens]])
    with torch.no_grad():
        base = _nll(model, ids, lm, int4=False)

        def int4_forward(mod: nn.Linear, x: Tensor) -> Tensor:
            w = mod.weight if getattr(mod.weight, GGUF_PARTS, None) else int4_weight(mod.weight)
            return F.linear(int8_rows(x), w, mod.bias)

        for m in linears:
            m.forward = functools.partial(int4_forward, m)
        try:
            lm4 = lm if getattr(lm, GGUF_PARTS, None) else int4_weight(lm)
            quant = _nll(model, ids, lm4, int4=True)
        finally:
            for m in linears:
                del m.forward
    return {"text": TEXT.name, "tokens": int(ids.shape[1]), "perplexity_float": math.exp(base),
            "perplexity_int4": math.exp(quant)}
