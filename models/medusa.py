"""Medusa-1 heads (FasterDecoding/Medusa `medusa_model.py`): per head `[ResBlock]×L` then `Linear(H, V)`.

ResBlock(x) = x + SiLU(W x + b). Head h reads the target's last hidden state (after its final norm)
at the position whose LM-head output is the next token x_{t+1}, and predicts x_{t+2+h}.

Checkpoints: `medusa_lm_head.safetensors` with keys `{h}.{l}.linear.weight`, `{h}.{l}.linear.bias`
and `{h}.{L}.weight` (the per-head output Linear), optionally prefixed `medusa_head.`; config.json
with `medusa_num_heads` / `medusa_num_layers` where present. A checkpoint without the `{h}.{L}.weight`
keys has its heads' output TIED to the target's LM head (specair's own heads: a 49152x576 fp16 Linear
per head would be 56 MB), optionally restricted to a reduced draft vocabulary as the EAGLE head can be.

The heads' weights are stacked ([num_heads, L, H, H]) so all heads run as one batched matmul per layer.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specair.models.eagle import (check_draft_vocab, lm_logits, read_config, read_safetensors,
                                  resolve_weights_file, save_safetensors)
from specair.models.errors import ModelFormatError
from specair.models.llama import Transformer, full_vocab_weight

WEIGHTS_NAME = "medusa_lm_head.safetensors"
_UNTIED_VOCAB = "a draft vocabulary restricts the shared (tied) LM head; untied heads have their own"


class MedusaHeads(nn.Module):
    """`num_heads` Medusa heads of `num_layers` ResBlocks each over the target's hidden states."""

    def __init__(self, target: Transformer, num_heads: int, num_layers: int, *, untied: bool = False,
                 draft_vocab: Tensor | None = None, empty: bool = False) -> None:
        """untied=True gives every head its own output Linear [V, H] (FasterDecoding's layout); otherwise the
        output is the target's LM head, shared, optionally restricted to `draft_vocab` [Vd] full-vocabulary ids.
        ResBlocks start as the identity (zero weight and bias), so an untrained head equals the LM head.
        empty=True builds the weights on the meta device, for loaders."""
        super().__init__()
        if num_heads < 1 or num_layers < 0:
            raise ModelFormatError(f"Medusa needs num_heads >= 1 and num_layers >= 0, got {num_heads}, {num_layers}")
        if untied and draft_vocab is not None:
            raise ModelFormatError(_UNTIED_VOCAB)
        c = target.config
        self.num_heads, self.num_layers = num_heads, num_layers
        self.hidden_size, self.vocab_size = c.hidden_size, c.vocab_size
        H = c.hidden_size
        device = torch.device("meta") if empty else target.tok_embeddings.weight.device
        kw = {"device": device, "dtype": target.dtype}
        self.res_weight = nn.Parameter(torch.zeros(num_heads, num_layers, H, H, **kw))  # [out, in] per block
        self.res_bias = nn.Parameter(torch.zeros(num_heads, num_layers, H, **kw))
        self.out_weight = nn.Parameter(torch.empty(num_heads, c.vocab_size, H, **kw)) if untied else None
        if untied and not empty:
            with torch.no_grad():
                self.out_weight.copy_(full_vocab_weight(target.lm_holder).expand(num_heads, -1, -1))  # Medusa's initialisation
        # The target's LM head, shared as submodules (never copied).
        self.tok_embeddings = target.tok_embeddings
        self.output = target.output
        self.set_draft_vocab(draft_vocab)

    @property
    def tied(self) -> bool:
        return self.out_weight is None

    @property
    def dtype(self) -> torch.dtype:
        return self.res_bias.dtype

    def own_parameters(self) -> list[nn.Parameter]:
        """The heads' trainable weights, without the shared target weights."""
        return [p for p in (self.res_weight, self.res_bias, self.out_weight) if p is not None]

    def set_draft_vocab(self, ids: Tensor | None) -> None:
        """Restrict a tied head's logits to full-vocabulary ids `ids` [Vd] (None: the whole vocabulary)."""
        if ids is None:
            self.register_buffer("draft_vocab", None)
            self.register_buffer("draft_lm_weight", None, persistent=False)
            return
        if not self.tied:
            raise ModelFormatError(_UNTIED_VOCAB)
        weight = self._shared_lm_weight()
        self.register_buffer("draft_vocab", check_draft_vocab(ids, self.vocab_size, "Medusa heads").to(weight.device))
        self.register_buffer("draft_lm_weight", weight.detach().index_select(0, self.draft_vocab), persistent=False)

    def _shared_lm_weight(self) -> Tensor:
        return full_vocab_weight(self._lm_holder())

    def _lm_holder(self) -> nn.Module:
        return self.tok_embeddings if self.output is None else self.output

    def features(self, hidden: Tensor) -> Tensor:
        """The ResBlocks of every head: hidden [..., H] -> [..., num_heads, H]."""
        lead = hidden.shape[:-1]
        x = hidden.reshape(1, -1, self.hidden_size).expand(self.num_heads, -1, -1)  # [NH, N, H]
        for layer in range(self.num_layers):
            y = x @ self.res_weight[:, layer].transpose(1, 2) + self.res_bias[:, layer].unsqueeze(1)
            x = x + F.silu(y)
        return x.transpose(0, 1).reshape(*lead, self.num_heads, self.hidden_size)

    def logits(self, features: Tensor, reduced: bool = False) -> Tensor:
        """Output projection of the first n heads' features [..., n, H] -> [..., n, V] (or [..., n, Vd] over the
        draft vocabulary with reduced=True, for training)."""
        if self.tied:
            return lm_logits(features, self._lm_holder(), self.draft_vocab, self.draft_lm_weight, reduced)
        lead, n = features.shape[:-2], features.shape[-2]  # n <= num_heads: the first n heads
        x = features.reshape(-1, n, self.hidden_size).transpose(0, 1)  # [n, N, H]
        out = x @ self.out_weight[:n].transpose(1, 2)  # [n, N, V]
        return out.transpose(0, 1).reshape(*lead, n, self.vocab_size)

    def forward(self, hidden: Tensor) -> Tensor:
        """hidden [..., H] (the target's normed hidden state) -> logits [..., num_heads, V]."""
        return self.logits(self.features(hidden))


def save_medusa(heads: MedusaHeads, directory: str | os.PathLike) -> None:
    """Write config.json and medusa_lm_head.safetensors in FasterDecoding's key layout (no `{h}.{L}.weight`
    for tied heads; `draft_vocab` when set)."""
    d = Path(directory)
    L = heads.num_layers
    sd: dict[str, Tensor] = {}
    for h in range(heads.num_heads):
        for layer in range(L):
            sd[f"{h}.{layer}.linear.weight"] = heads.res_weight[h, layer]
            sd[f"{h}.{layer}.linear.bias"] = heads.res_bias[h, layer]
        if not heads.tied:
            sd[f"{h}.{L}.weight"] = heads.out_weight[h]
    if heads.draft_vocab is not None:
        sd["draft_vocab"] = heads.draft_vocab
    cfg = {"medusa_num_heads": heads.num_heads, "medusa_num_layers": L, "hidden_size": heads.hidden_size,
           "vocab_size": heads.vocab_size, "tied_lm_head": heads.tied, "specair_head": "medusa",
           "draft_vocab_size": None if heads.draft_vocab is None else int(heads.draft_vocab.numel())}
    d.mkdir(parents=True, exist_ok=True)
    save_safetensors(sd, d / WEIGHTS_NAME, metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")


_KEY = re.compile(r"(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)")


def load_medusa(path: str | os.PathLike, target: Transformer) -> MedusaHeads:
    """Medusa heads from a FasterDecoding checkpoint: a directory holding medusa_lm_head.safetensors (and
    optionally config.json), or a .safetensors file. Shapes are checked against the target."""
    f = resolve_weights_file(path, WEIGHTS_NAME, "Medusa head")
    src = str(f)
    raw = read_safetensors(f)
    draft_vocab = raw.pop("draft_vocab", None)
    sd = {k.removeprefix("medusa_head."): t for k, t in raw.items()}
    parsed: dict[tuple[int, int, str], Tensor] = {}
    for k, t in sd.items():
        m = _KEY.fullmatch(k)
        if not m:
            raise ModelFormatError(f"{src}: unexpected tensor {k}; Medusa keys are {{h}}.{{l}}.linear.weight, "
                                   "{h}.{l}.linear.bias and {h}.{L}.weight (optionally prefixed medusa_head.)")
        parsed[int(m[1]), int(m[2]), m[3]] = t
    if not parsed:
        raise ModelFormatError(f"{src}: no Medusa head tensors")
    cfg = read_config(f.parent) or {}
    num_heads = 1 + max(h for h, _, _ in parsed)
    res_layers = {layer for _, layer, kind in parsed if kind.startswith("linear")}
    num_layers = 1 + max(res_layers) if res_layers else 0
    out_keys = {(h, layer) for h, layer, kind in parsed if kind == "weight"}
    for key, got in (("medusa_num_heads", num_heads), ("medusa_num_layers", num_layers)):
        if cfg.get(key) is not None and int(cfg[key]) != got:
            raise ModelFormatError(f"{src}: config.json says {key}={cfg[key]}, the tensors hold {got}")
    if any(layer != num_layers for _, layer in out_keys):
        raise ModelFormatError(f"{src}: output Linear keys must be {{h}}.{num_layers}.weight after {num_layers} "
                               f"ResBlocks, found {sorted(out_keys)[0]}")
    untied = bool(out_keys)
    if untied and len(out_keys) != num_heads:
        raise ModelFormatError(f"{src}: {len(out_keys)} of {num_heads} heads have an output Linear; all or none must")
    H, V = target.config.hidden_size, target.config.vocab_size
    if cfg.get("hidden_size") not in (None, H):
        raise ModelFormatError(f"{src}: heads for hidden size {cfg['hidden_size']}, the target's is {H}")
    weights, biases, outs = [], [], []
    for h in range(num_heads):
        for layer in range(num_layers):
            w, b = parsed.get((h, layer, "linear.weight")), parsed.get((h, layer, "linear.bias"))
            if w is None or b is None:
                raise ModelFormatError(f"{src}: missing tensor {h}.{layer}.linear.{'weight' if w is None else 'bias'}")
            if tuple(w.shape) != (H, H) or tuple(b.shape) != (H,):
                raise ModelFormatError(f"{src}: head {h} ResBlock {layer} has shapes {tuple(w.shape)}/"
                                       f"{tuple(b.shape)}, the target's hidden size {H} needs ({H}, {H})/({H},)")
            weights.append(w)
            biases.append(b)
        if untied:
            o = parsed[h, num_layers, "weight"]
            if tuple(o.shape) != (V, H):
                raise ModelFormatError(f"{src}: head {h} output has shape {tuple(o.shape)}, "
                                       f"the target needs ({V}, {H})")
            outs.append(o)
    heads = MedusaHeads(target, num_heads, num_layers, untied=untied, empty=True)
    dt, dev = target.dtype, target.tok_embeddings.weight.device
    state = {"res_weight": _stack(weights, (num_heads, num_layers, H, H), dt, dev),
             "res_bias": _stack(biases, (num_heads, num_layers, H), dt, dev)}
    if untied:
        state["out_weight"] = torch.stack(outs).to(dtype=dt, device=dev)
    for name, t in state.items():
        setattr(heads, name, nn.Parameter(t, requires_grad=False))
    heads.set_draft_vocab(draft_vocab)
    return heads.eval().requires_grad_(False)


def _stack(ts: list[Tensor], shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    if not ts:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.stack(ts).reshape(shape).to(dtype=dtype, device=device)
