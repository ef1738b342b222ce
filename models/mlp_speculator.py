"""IBM's MLPSpeculator ("Accelerating Production LLMs with Combined Token/Embedding Speculators"), as vLLM
loads it (`vllm/model_executor/models/mlp_speculator.py` and `MLPSpeculatorConfig`).

Stage i of n_predict maps (state, last token) to (new state, logits):

    state = GELU(LN_i(proj_i(state) + emb_i(token) * emb_weight / state_weight));  logits = head_i(state)

with state_weight = 0.5 ** (0.5 / n_predict) and emb_weight = sqrt((1 - state_weight**2) * inner_dim / 2).
The first state is the target's hidden state (after its final norm) at the position that produced the
root token; with `scale_input` it is first normalised by an unscaled LN and divided by sqrt(2). LN is
vLLM's MLPSpeculatorLayerNorm: x * rsqrt(mean(x^2) + 1e-6) * weight + bias (no mean subtraction, no upcast).
GELU is the exact (erf) one. With `tie_weights`, all stages share emb/head/ln, and stages >= 1 share proj.

Checkpoints: config.json (n_predict, inner_dim, emb_dim, vocab_size, top_k_tokens_per_head,
tie_weights, scale_input) and model.safetensors with `emb.{i}.weight`, `proj.{i}.weight`,
`head.{i}.weight`, `ln.{i}.weight`, `ln.{i}.bias` (optionally prefixed `speculator.`). The `ln0` of
scale_input has no weights in vLLM, so none are stored.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specair.models.eagle import read_config, read_safetensors, resolve_weights_file, save_safetensors
from specair.models.errors import ModelFormatError
from specair.models.llama import Transformer

SQRT2 = 2 ** 0.5


class SpeculatorLayerNorm(nn.Module):
    """vLLM's MLPSpeculatorLayerNorm: RMS normalisation with an optional elementwise scale and shift."""

    def __init__(self, dim: int, affine: bool = True, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None
        self.bias = nn.Parameter(torch.zeros(dim)) if affine else None

    def forward(self, x: Tensor) -> Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x if self.weight is None else x * self.weight + self.bias


class MLPSpeculator(nn.Module):
    """n_predict MLP stages over the target's hidden state and the last token's embedding."""

    def __init__(self, target: Transformer, n_predict: int, inner_dim: int = 0, *, tie_weights: bool = False,
                 scale_input: bool = False, top_k_tokens_per_head: list[int] | None = None,
                 empty: bool = False) -> None:
        """inner_dim 0 means the target's hidden size (vLLM's convention). empty=True builds the weights on
        the meta device, for loaders."""
        super().__init__()
        if n_predict < 1:
            raise ModelFormatError(f"MLPSpeculator needs n_predict >= 1, got {n_predict}")
        if tie_weights and n_predict < 2:
            raise ModelFormatError("MLPSpeculator: tie_weights needs n_predict >= 2 (weights are tied between stages)")
        c = target.config
        self.n_predict, self.emb_dim, self.vocab_size = n_predict, c.hidden_size, c.vocab_size
        self.inner_dim = inner_dim or c.hidden_size
        self.tie_weights, self.scale_input = tie_weights, scale_input
        self.top_k_tokens_per_head = list(top_k_tokens_per_head or [1] * n_predict)
        if len(self.top_k_tokens_per_head) != n_predict:
            raise ModelFormatError(f"MLPSpeculator: top_k_tokens_per_head has {len(self.top_k_tokens_per_head)} "
                                   f"entries for n_predict={n_predict}")
        inner, V = self.inner_dim, self.vocab_size
        device = torch.device("meta") if empty else target.tok_embeddings.weight.device
        with torch.device(device):
            if tie_weights:
                emb, head, ln = nn.Embedding(V, inner), nn.Linear(inner, V, bias=False), SpeculatorLayerNorm(inner)
                proj_tied = nn.Linear(inner, inner, bias=False)
                self.emb = nn.ModuleList([emb] * n_predict)
                self.proj = nn.ModuleList([nn.Linear(self.emb_dim, inner, bias=False)] + [proj_tied] * (n_predict - 1))
                self.head = nn.ModuleList([head] * n_predict)
                self.ln = nn.ModuleList([ln] * n_predict)
            else:
                self.emb = nn.ModuleList(nn.Embedding(V, inner) for _ in range(n_predict))
                self.proj = nn.ModuleList(nn.Linear(self.emb_dim if i == 0 else inner, inner, bias=False)
                                          for i in range(n_predict))
                self.head = nn.ModuleList(nn.Linear(inner, V, bias=False) for _ in range(n_predict))
                self.ln = nn.ModuleList(SpeculatorLayerNorm(inner) for _ in range(n_predict))
        self.ln0 = SpeculatorLayerNorm(self.emb_dim, affine=False) if scale_input else None
        self.state_weight = 0.5 ** (0.5 / n_predict)
        self.emb_weight = math.sqrt((1 - self.state_weight ** 2) * (inner / 2))
        self.to(target.dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.head[0].weight.dtype

    def prepare(self, hidden: Tensor) -> Tensor:
        """The first stage's input state from the target's hidden state [..., H]."""
        return self.ln0(hidden) / SQRT2 if self.ln0 is not None else hidden

    def step(self, i: int, state: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Stage i: state [..., H or inner] and the last tokens [...] -> (new state [..., inner], logits [..., V])."""
        z = self.emb[i](tokens)
        s = self.proj[i](state) + z * (self.emb_weight / self.state_weight)
        s = F.gelu(self.ln[i](s))
        return s, self.head[i](s)

    def forward(self, hidden: Tensor, tokens: Tensor) -> Tensor:
        """Teacher-forced logits of every stage: hidden [B, H], tokens [B, n] (tokens[:, 0] the root, tokens[:, i]
        the token stage i reads), n <= n_predict -> logits [B, n, V] (stage i predicts the token after tokens[:, i])."""
        state, out = self.prepare(hidden), []
        for i in range(tokens.shape[1]):
            state, logits = self.step(i, state, tokens[:, i])
            out.append(logits)
        return torch.stack(out, 1)


def _unique_keys(spec: MLPSpeculator) -> dict[str, Tensor]:
    """Every stored tensor once (tied stages store index 0, and proj.1 for the shared later projections)."""
    n = 1 if spec.tie_weights else spec.n_predict
    sd: dict[str, Tensor] = {}
    for i in range(n):
        sd[f"emb.{i}.weight"] = spec.emb[i].weight
        sd[f"head.{i}.weight"] = spec.head[i].weight
        sd[f"ln.{i}.weight"] = spec.ln[i].weight
        sd[f"ln.{i}.bias"] = spec.ln[i].bias
    for i in range(2 if spec.tie_weights else spec.n_predict):
        sd[f"proj.{i}.weight"] = spec.proj[i].weight
    return sd


def save_mlp_speculator(spec: MLPSpeculator, directory: str | os.PathLike) -> None:
    """Write config.json (MLPSpeculatorConfig's fields) and model.safetensors in vLLM's key layout."""
    d = Path(directory)
    cfg = {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator",
           "vocab_size": spec.vocab_size, "emb_dim": spec.emb_dim, "inner_dim": spec.inner_dim,
           "n_predict": spec.n_predict, "top_k_tokens_per_head": spec.top_k_tokens_per_head,
           "n_candidates": 5, "tie_weights": spec.tie_weights, "scale_input": spec.scale_input}
    d.mkdir(parents=True, exist_ok=True)
    save_safetensors(_unique_keys(spec), d / "model.safetensors", metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")


def load_mlp_speculator(path: str | os.PathLike, target: Transformer) -> MLPSpeculator:
    """An MLPSpeculator from a directory with config.json and model.safetensors (IBM / vLLM layout), or a
    .safetensors file with config.json beside it. Shapes are checked against the target."""
    f = resolve_weights_file(path, "model.safetensors", "MLPSpeculator")
    src = str(f)
    cfg = read_config(f.parent)
    if cfg is None:
        raise ModelFormatError(f"{f.parent}: no config.json; an MLPSpeculator needs it (n_predict, inner_dim, "
                               "tie_weights, scale_input cannot all be read from the weights)")
    try:
        n_predict = int(cfg["n_predict"])
        emb_dim = int(cfg.get("emb_dim", cfg.get("hidden_size", target.config.hidden_size)))
        inner_dim = int(cfg.get("inner_dim") or 0)
        vocab = int(cfg.get("vocab_size", target.config.vocab_size))
        tie, scale = bool(cfg.get("tie_weights", False)), bool(cfg.get("scale_input", False))
        top_k = cfg.get("top_k_tokens_per_head")
    except KeyError as e:
        raise ModelFormatError(f"{f.parent / 'config.json'}: lacks required field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ModelFormatError(f"{f.parent / 'config.json'}: invalid value ({e})") from None
    H, V = target.config.hidden_size, target.config.vocab_size
    if emb_dim != H:
        raise ModelFormatError(f"{src}: speculator for hidden size {emb_dim}, the target's is {H}")
    if vocab != V:
        raise ModelFormatError(f"{src}: speculator for a vocabulary of {vocab}, the target has {V}")
    if top_k is not None and len(top_k) != n_predict:
        top_k = None  # unused by vLLM too; do not refuse a checkpoint over it
    sd = {k.removeprefix("speculator."): t for k, t in read_safetensors(f).items()}
    spec = MLPSpeculator(target, n_predict, inner_dim, tie_weights=tie, scale_input=scale,
                         top_k_tokens_per_head=top_k, empty=True)
    wanted = {k: tuple(t.shape) for k, t in _unique_keys(spec).items()}
    for key, shape in wanted.items():
        if key not in sd:
            raise ModelFormatError(f"{src}: missing tensor {key}")
        if tuple(sd[key].shape) != shape:
            raise ModelFormatError(f"{src}: tensor {key} has shape {tuple(sd[key].shape)}, config.json and the "
                                   f"target imply {shape}")
    extra = sorted(set(sd) - set(wanted))
    if tie:  # tied stages may be stored under every index; they must then be the same tensors
        for key in list(extra):
            kind, i, rest = key.split(".", 2) if key.count(".") >= 2 else (key, "", "")
            base = f"{kind}.{1 if kind == 'proj' else 0}.{rest}"
            if i.isdigit() and base in wanted:
                if not torch.equal(sd[key], sd[base]):
                    raise ModelFormatError(f"{src}: tie_weights is set but {key} differs from {base}")
                extra.remove(key)
    if extra:
        warnings.warn(f"{src}: ignoring {len(extra)} unknown tensors, e.g. {extra[0]}", stacklevel=2)
    dt, dev = target.dtype, target.tok_embeddings.weight.device
    modules = dict(spec.named_modules())
    for key in wanted:
        mod_name, attr = key.rsplit(".", 1)
        setattr(modules[mod_name], attr, nn.Parameter(sd[key].to(dtype=dt, device=dev), requires_grad=False))
    return spec.eval().requires_grad_(False)
