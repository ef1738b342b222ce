"""EAGLE-3 draft head (SafeAILab/EAGLE `eagle/model/cnets.py`; vLLM `llama_eagle3.py`; `speculators`).

The head reads three of the target's features per position -- the residual stream entering a low, a middle
and a high layer (default 2, L//2, L-3), concatenated [.., 3H] -- fused to H by `fc`. Its one decoder layer
normalises the token embedding (`input_layernorm`) and the feature (`hidden_norm`) separately, concatenates
them (embedding first) into 2H-wide q/k/v projections, and adds the attention to the feature (the residual:
the feature before `hidden_norm`, or after it with `norm_before_residual`). Logits come from its own `norm`
and `lm_head` over a reduced draft vocabulary: draft index i is target token i + d2t[i].

Like EAGLE-1, entry p of the head's cache holds (token x_{p+1}, feature of position p) at position p. A drafted
node has no target feature: it takes its parent's layer output [.., H], which skips `fc` (the width tells
which input it is, statically). Trained with training-time test, the head learns to read its own outputs.

Two checkpoint layouts load (`load_eagle3`): SafeAILab's (`midlayer.*`, a Llama config.json with
`draft_vocab_size`) and the `speculators` one (`layers.0.*`, config.json with `speculators_model_type:
"eagle3"` and a `transformer_layer_config`), written by SpecForge and vLLM's tooling.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
import torch
from torch import Tensor, nn

from specair.models.config import ModelConfig
from specair.models.eagle import (DraftHead, check_draft_vocab, expect_shape, read_config, read_safetensors,
                                  resolve_weights_file, save_safetensors, scatter_vocab)
from specair.models.errors import ModelFormatError
from specair.models.llama import (AttentionInputs, Attention, FeedForward, RMSNorm, Transformer, rope_tables,
                                  static_shape)


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high layers: (2, L // 2, L - 3), as SafeAILab and vLLM pick them."""
    return tuple(sorted({min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)}))


class MidLayer(nn.Module):
    """EAGLE-3's decoder layer: norms on the embedding and the feature, 2H-wide q/k/v, a Llama MLP."""

    def __init__(self, c: ModelConfig, norm_before_residual: bool = False) -> None:
        super().__init__()
        H = c.hidden_size
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, c.rms_norm_eps)
        self.attention = Attention(c)
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.attention.wqkv = nn.Linear(2 * H, q_dim + 2 * kv_dim, bias=c.attention_bias)
        self.ffn_norm = RMSNorm(H, c.rms_norm_eps)
        self.feed_forward = FeedForward(c)

    def forward(self, emb: Tensor, h: Tensor, cos: Tensor, sin: Tensor, k_past: Tensor, v_past: Tensor,
                mask: Tensor, k_prev: Tensor | None, v_prev: Tensor | None,
                inputs: AttentionInputs | None = None) -> tuple[Tensor, Tensor, Tensor]:
        if self.norm_before_residual:
            h = self.hidden_norm(h)
            residual = h
        else:
            residual, h = h, self.hidden_norm(h)
        x = torch.cat([self.input_layernorm(emb), h], dim=-1)
        a, k, v = self.attention(x, cos, sin, k_past, v_past, mask, k_prev, v_prev, inputs)
        x = residual + a
        return x + self.feed_forward(self.ffn_norm(x)), k, v


class Eagle3Head(DraftHead):
    """An EAGLE-3 head over a target `Transformer`: `EagleHead`'s contract (pure, static shapes), with
    input_hidden either the target's features [B, T, 3Ht] or the head's own layer outputs [B, T, H]."""

    def __init__(self, target: Transformer, config: ModelConfig | None = None, *,
                 feature_layers: tuple[int, ...] | None = None, draft_vocab: Tensor | None = None,
                 fc_bias: bool = False, norm_before_residual: bool = False, own_embedding: bool = False,
                 empty: bool = False) -> None:
        """config: the head's layer (default: the target's shapes, one layer); its hidden size may differ
        from the target's. draft_vocab: the target ids of the draft vocabulary, in lm_head row order (None:
        the whole vocabulary). own_embedding: the head carries an embedding of its own (the checkpoint
        has one) instead of sharing the target's."""
        super().__init__()
        tc = target.config
        c = replace(tc if config is None else config, num_layers=1, vocab_size=tc.vocab_size,
                    max_position_embeddings=max(tc.max_position_embeddings,
                                                (config or tc).max_position_embeddings))
        if c.num_heads % c.num_kv_heads:
            raise ModelFormatError(f"EAGLE-3 head: {c.num_heads} query heads are not a multiple of "
                                   f"{c.num_kv_heads} KV heads")
        self.config = c
        self.feature_layers = tuple(feature_layers or default_feature_layers(tc.num_layers))
        H, Ht = c.hidden_size, tc.hidden_size
        if len(self.feature_layers) * Ht == H:
            raise ModelFormatError("EAGLE-3 head: the fused feature width equals the head's hidden size, so "
                                   "target features and the head's own could not be told apart")
        Vd = tc.vocab_size if draft_vocab is None else int(draft_vocab.numel())
        device = torch.device("meta") if empty else target.tok_embeddings.weight.device
        with torch.device(device):
            self.fc = nn.Linear(len(self.feature_layers) * Ht, H, bias=fc_bias)
            self.layers = nn.ModuleList([MidLayer(c, norm_before_residual)])
            self.norm = RMSNorm(H, c.rms_norm_eps)
            self.lm_head = nn.Linear(H, Vd, bias=False)
            own = nn.Embedding(tc.vocab_size, H) if own_embedding or H != Ht else None
        self.to(target.dtype)
        self.own_embedding = own is not None
        self.tok_embeddings = own.to(target.dtype) if own is not None else target.tok_embeddings
        # The head's RoPE follows its own config (SafeAILab heads keep HF's defaults), over the target's positions.
        cos, sin = rope_tables(c, target.dtype)
        self.register_buffer("rope_cos", cos.to(device if not empty else "cpu"), persistent=False)
        self.register_buffer("rope_sin", sin.to(device if not empty else "cpu"), persistent=False)
        self.register_buffer("draft_vocab", None if draft_vocab is None else
                             check_draft_vocab(draft_vocab, tc.vocab_size, "EAGLE-3 head"))

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def norm_before_residual(self) -> bool:
        return self.layers[0].norm_before_residual

    def own_parameters(self) -> list[nn.Parameter]:
        """The head's trainable weights (its embedding stays frozen, as in EAGLE-3's training)."""
        return [*self.fc.parameters(), *self.layers.parameters(), *self.norm.parameters(), *self.lm_head.parameters()]

    def logits(self, hidden: Tensor, reduced: bool = False) -> Tensor:
        """Logits of layer outputs hidden [..., H]: [..., V] over the target's vocabulary (outside the draft
        vocabulary at finfo.min), or with reduced=True [..., Vd] in lm_head order (for training)."""
        small = self.lm_head(self.norm(hidden))
        if reduced or self.draft_vocab is None:
            return small
        return scatter_vocab(small, self.draft_vocab, self.config.vocab_size)

    def layer_inputs(self, tokens: Tensor, input_hidden: Tensor) -> tuple[Tensor, Tensor]:
        """What the decoder layer takes before its RoPE tables: the embedding and the feature (target features
        fused by fc; the head's own outputs as they are)."""
        h = input_hidden.to(self.dtype)
        if static_shape(h)[-1] != self.config.hidden_size:
            h = self.fc(h)
        return self.tok_embeddings(tokens).to(h.dtype), h


# ---- checkpoints ----

_ATT = ("q", "k", "v")


def save_eagle3(head: Eagle3Head, directory: str | os.PathLike, speculative: dict | None = None) -> None:
    """Write `config.json` and `model.safetensors` in SafeAILab's EAGLE-3 layout (`midlayer.*`, `d2t`/`t2d`),
    with `eagle_aux_hidden_state_layer_ids` (vLLM's key) in the config."""
    d = Path(directory)
    c, layer = head.config, head.layers[0]
    sizes = [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
    m = "midlayer."
    sd = {"fc.weight": head.fc.weight, m + "input_layernorm.weight": layer.input_layernorm.weight,
          m + "hidden_norm.weight": layer.hidden_norm.weight,
          m + "post_attention_layernorm.weight": layer.ffn_norm.weight,
          m + "self_attn.o_proj.weight": layer.attention.wo.weight,
          m + "mlp.down_proj.weight": layer.feed_forward.w2.weight,
          "norm.weight": head.norm.weight, "lm_head.weight": head.lm_head.weight}
    for n, w in zip(_ATT, layer.attention.wqkv.weight.split(sizes), strict=True):
        sd[m + f"self_attn.{n}_proj.weight"] = w
    if layer.attention.wqkv.bias is not None:
        for n, b in zip(_ATT, layer.attention.wqkv.bias.split(sizes), strict=True):
            sd[m + f"self_attn.{n}_proj.bias"] = b
    gate, up = layer.feed_forward.w13.weight.chunk(2)
    sd[m + "mlp.gate_proj.weight"], sd[m + "mlp.up_proj.weight"] = gate, up
    if head.fc.bias is not None:
        sd["fc.bias"] = head.fc.bias
    V = c.vocab_size
    ids = torch.arange(V) if head.draft_vocab is None else head.draft_vocab.cpu()
    sd["d2t"] = ids - torch.arange(ids.numel())
    sd["t2d"] = torch.zeros(V, dtype=torch.bool).index_fill(0, ids, True)
    if head.own_embedding:
        sd["embed_tokens.weight"] = head.tok_embeddings.weight
    cfg = c.to_hf()
    cfg.update({"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
                "draft_vocab_size": int(ids.numel()), "eagle_aux_hidden_state_layer_ids": list(head.feature_layers),
                "norm_before_residual": head.norm_before_residual, "specair_head": "eagle3"})
    d.mkdir(parents=True, exist_ok=True)
    save_safetensors(sd, d / "model.safetensors", metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")


def _layer_ids(cfg: dict) -> list[int] | None:
    for where in (cfg, cfg.get("eagle_config") or {}, cfg.get("transformer_layer_config") or {}):
        ids = where.get("eagle_aux_hidden_state_layer_ids") if isinstance(where, dict) else None
        if ids is not None:
            if not (isinstance(ids, list) and all(isinstance(i, int) for i in ids)):
                raise ModelFormatError(f"eagle_aux_hidden_state_layer_ids must be a list of layer indices, got {ids!r}")
            return ids
    return None


def load_eagle3(path: str | os.PathLike, target: Transformer) -> Eagle3Head:
    """An EAGLE-3 head from a SafeAILab or `speculators` checkpoint: a directory (model.safetensors and
    config.json) or a .safetensors file beside its config.json. Shapes are checked against the target;
    weights take its dtype."""
    f = resolve_weights_file(path, "model.safetensors", "EAGLE-3 head")
    src = str(f)
    sd = read_safetensors(f)
    cfg = read_config(f.parent)
    if cfg is None:
        raise ModelFormatError(f"{src}: no config.json beside the weights (an EAGLE-3 head's shapes live there)")
    speculators = cfg.get("speculators_model_type") is not None
    if speculators and cfg["speculators_model_type"] != "eagle3":
        raise ModelFormatError(f"{src}: a speculators {cfg['speculators_model_type']!r} checkpoint, not eagle3")
    prefix = "layers.0." if speculators or any(k.startswith("layers.0.") for k in sd) else "midlayer."
    if prefix == "layers.0." and "fc.weight" in sd and "d2t" not in sd and "lm_head.weight" not in sd:
        raise ModelFormatError(f"{src}: an EAGLE-1/2 head (fc, layers.0, no lm_head or d2t); load it with method "
                               "'eagle'")
    if not any(k.startswith(prefix) for k in sd) or "fc.weight" not in sd:
        raise ModelFormatError(f"{src}: not an EAGLE-3 head (no fc.weight and {prefix}*; keys: "
                               f"{', '.join(sorted(sd)[:4])}, ...)")
    layer_cfg = cfg.get("transformer_layer_config") if speculators else cfg
    if not isinstance(layer_cfg, dict):
        raise ModelFormatError(f"{src}: config.json lacks transformer_layer_config (speculators layout)")
    try:
        c = ModelConfig.from_hf({**layer_cfg, "model_type": layer_cfg.get("model_type", "llama"),
                                 "vocab_size": layer_cfg.get("vocab_size", target.config.vocab_size)})
    except ModelFormatError as e:
        raise ModelFormatError(f"{src}: {e}") from None
    tc = target.config
    if c.vocab_size != tc.vocab_size:
        raise ModelFormatError(f"{src}: head for a vocabulary of {c.vocab_size}, target has {tc.vocab_size}: "
                               "it was trained for another model")
    layers = _layer_ids(cfg) or list(default_feature_layers(tc.num_layers))
    if any(not 0 <= i < tc.num_layers for i in layers):
        raise ModelFormatError(f"{src}: feature layers {layers} do not exist in the {tc.num_layers}-layer target")
    H, Ht, D = c.hidden_size, int(cfg.get("target_hidden_size") or tc.hidden_size), c.head_dim
    if Ht != tc.hidden_size:
        raise ModelFormatError(f"{src}: head for a target hidden size of {Ht}, the target's is {tc.hidden_size}")
    expect_shape(sd, "fc.weight", (H, len(layers) * Ht), src,
                 f" ({len(layers)} target features of {Ht}; the head was trained for another model?)")
    Vd = int(cfg.get("draft_vocab_size") or sd.get("lm_head.weight", torch.empty(tc.vocab_size, 0)).shape[0])
    q, kv = c.num_heads * D, c.num_kv_heads * D
    m = prefix
    shapes = {m + "input_layernorm.weight": (H,), m + "hidden_norm.weight": (H,),
              m + "post_attention_layernorm.weight": (H,), m + "self_attn.q_proj.weight": (q, 2 * H),
              m + "self_attn.k_proj.weight": (kv, 2 * H), m + "self_attn.v_proj.weight": (kv, 2 * H),
              m + "self_attn.o_proj.weight": (H, q), m + "mlp.gate_proj.weight": (c.intermediate_size, H),
              m + "mlp.up_proj.weight": (c.intermediate_size, H), m + "mlp.down_proj.weight": (H, c.intermediate_size),
              "norm.weight": (H,), "lm_head.weight": (Vd, H), "d2t": (Vd,)}
    for key, shape in shapes.items():
        expect_shape(sd, key, shape, src)
    bias = m + "self_attn.q_proj.bias" in sd
    if bias:
        for n, rows in zip(_ATT, (q, kv, kv), strict=True):
            expect_shape(sd, m + f"self_attn.{n}_proj.bias", (rows,), src)
    if "fc.bias" in sd:
        expect_shape(sd, "fc.bias", (H,), src)
    if "embed_tokens.weight" in sd:
        expect_shape(sd, "embed_tokens.weight", (tc.vocab_size, H), src)
    known = set(shapes) | {"fc.weight", "fc.bias", "t2d", "embed_tokens.weight"}
    known |= {m + f"self_attn.{n}_proj.bias" for n in _ATT}
    unknown = sorted(set(sd) - known)
    if unknown:
        raise ModelFormatError(f"{src}: unexpected tensors {', '.join(unknown[:3])}; an EAGLE-3 head has fc, one "
                               "decoder layer, norm, lm_head, d2t and t2d")
    d2t = sd["d2t"]
    if d2t.is_floating_point():
        raise ModelFormatError(f"{src}: d2t must hold integer offsets")
    ids = torch.arange(Vd) + d2t.to(torch.long)
    ids = check_draft_vocab(ids, tc.vocab_size, f"{src}: d2t")
    if "t2d" in sd:
        t2d = sd["t2d"]
        if tuple(t2d.shape) != (tc.vocab_size,):
            raise ModelFormatError(f"{src}: tensor t2d has shape {tuple(t2d.shape)}, expected ({tc.vocab_size},)")
        member = torch.zeros(tc.vocab_size, dtype=torch.bool).index_fill(0, ids, True)
        if not torch.equal(t2d.to(torch.bool), member):
            raise ModelFormatError(f"{src}: t2d and d2t disagree on which target tokens the draft vocabulary holds")
    full = Vd == tc.vocab_size and bool((ids == torch.arange(Vd)).all())
    nbr = bool(cfg.get("norm_before_residual", False))
    head = Eagle3Head(target, c, feature_layers=tuple(layers), draft_vocab=None if full else ids,
                      fc_bias="fc.bias" in sd, norm_before_residual=nbr,
                      own_embedding="embed_tokens.weight" in sd, empty=True)
    dt, device = target.dtype, target.tok_embeddings.weight.device
    ours = {"fc.weight": sd["fc.weight"],
            "layers.0.input_layernorm.weight": sd[m + "input_layernorm.weight"],
            "layers.0.hidden_norm.weight": sd[m + "hidden_norm.weight"],
            "layers.0.ffn_norm.weight": sd[m + "post_attention_layernorm.weight"],
            "layers.0.attention.wqkv.weight": torch.cat([sd[m + f"self_attn.{n}_proj.weight"] for n in _ATT]),
            "layers.0.attention.wo.weight": sd[m + "self_attn.o_proj.weight"],
            "layers.0.feed_forward.w13.weight": torch.cat([sd[m + "mlp.gate_proj.weight"],
                                                           sd[m + "mlp.up_proj.weight"]]),
            "layers.0.feed_forward.w2.weight": sd[m + "mlp.down_proj.weight"],
            "norm.weight": sd["norm.weight"], "lm_head.weight": sd["lm_head.weight"]}
    if bias:
        ours["layers.0.attention.wqkv.bias"] = torch.cat([sd[m + f"self_attn.{n}_proj.bias"] for n in _ATT])
    if "fc.bias" in sd:
        ours["fc.bias"] = sd["fc.bias"]
    if "embed_tokens.weight" in sd:
        ours["tok_embeddings.weight"] = sd["embed_tokens.weight"]
    for name, module in (("fc", head.fc), ("layers", head.layers), ("norm", head.norm), ("lm_head", head.lm_head),
                         ("tok_embeddings", head.tok_embeddings if "embed_tokens.weight" in sd else None)):
        if module is not None:
            module.load_state_dict({k[len(name) + 1:]: t.to(dt).to(device) for k, t in ours.items()
                                    if k.startswith(name + ".")}, strict=True, assign=True)
    head.rope_cos, head.rope_sin = head.rope_cos.to(device), head.rope_sin.to(device)
    if head.draft_vocab is not None:
        head.draft_vocab = head.draft_vocab.to(device)
    return head.eval().requires_grad_(False)
