"""EAGLE-1/2 draft head (SafeAILab/EAGLE `cnets.py`): one Llama decoder layer over `fc(cat(embedding, hidden))`.

The head predicts the target's next token from two inputs per position: the token and the target's
hidden state (after its final norm) that pairs with it. Entry p of the head's cache holds
(token x_{p+1}, target hidden h_p) at position p, and its output predicts x_{p+2} -- the alignment
EAGLE trains with (`input_ids[:, 1:]` against `hidden_states[:, :-1]`).

Upstream details kept here, checked against `eagle/model/cnets1.py`:
- `fc = Linear(2H, H, bias=True)` over `cat(inputs_embeds, hidden_states)`, the embedding first;
  a config.json `"bias": false` drops the bias.
- the decoder layer at index 0 has no `input_layernorm` (attention reads the fc output directly);
  `post_attention_layernorm` and the MLP are a plain Llama layer's.
- no final norm: the layer output goes straight into the target's LM head.

The head shares the target's token embedding, LM head and RoPE tables (registered as submodules and
buffers, never copied), so a head file holds only fc and the layer. An optional reduced draft
vocabulary (EAGLE-3's d2t idea) computes logits against a subset of the LM head's rows and scatters
them into a full-vocabulary tensor, so callers keep full-vocabulary token ids.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor, nn

from specair.models import memory
from specair.models.config import ModelConfig, read_json_object
from specair.models.errors import ModelFormatError
from specair.models.llama import AttentionInputs, Block, ModelOutput, Transformer, full_vocab_weight, vocab_logits

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


class DraftHead(nn.Module):
    """What EAGLE heads share: one decoder layer fed by `layer_inputs(tokens, input_hidden)`, run with the
    target's pure, static-shape contract, and a one-layer cache."""

    config: ModelConfig
    rope_cos: Tensor
    rope_sin: Tensor

    def layer_inputs(self, tokens: Tensor, input_hidden: Tensor) -> tuple[Tensor, ...]:
        raise NotImplementedError

    def logits(self, hidden: Tensor, reduced: bool = False) -> Tensor:
        raise NotImplementedError

    def forward(self, tokens: Tensor, positions: Tensor, cache_len: Tensor, k_cache: Tensor, v_cache: Tensor,
                tree_mask: Tensor | None = None, logits_index: Tensor | None = None, prev_k: Tensor | None = None,
                prev_v: Tensor | None = None, *, input_hidden: Tensor) -> ModelOutput:
        """`Transformer.forward`'s contract (pure: reads the cache, returns the new K/V [1, B, Hkv, T, D]) with
        input_hidden [B, T, F], the target state paired with each token (or a parent node's output). The
        output's `hidden` is the layer output (what a child node takes as its input_hidden; not normed);
        logits [B, n, V]."""
        C = k_cache.shape[3]
        x = self.layer_inputs(tokens, input_hidden)
        cos = self.rope_cos[positions].unsqueeze(2)
        sin = self.rope_sin[positions].unsqueeze(2)
        # The target's mask builder reads only `config` (sliding window), which the head shares.
        mask = Transformer._mask(self, positions, cache_len, C, tree_mask, x[-1].dtype)  # type: ignore[arg-type]
        hidden, k, v = self.layers[0](*x, cos, sin, k_cache[0], v_cache[0], mask,
                                      None if prev_k is None else prev_k[0], None if prev_v is None else prev_v[0],
                                      AttentionInputs(cache_len, tree_mask, self.config.sliding_window, positions,
                                                      (self.rope_cos, self.rope_sin)))
        picked = hidden
        if logits_index is not None:
            picked = hidden.gather(1, logits_index.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
        return ModelOutput(self.logits(picked), hidden, k.unsqueeze(0), v.unsqueeze(0))

    def empty_cache(self, batch: int, slots: int, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
        """A zeroed K and V cache [1, batch, Hkv, slots, D] in the head's dtype (on the CPU committed on write)."""
        c = self.config
        shape = (1, batch, c.num_kv_heads, slots, c.head_dim)
        return memory.zeros(shape, self.dtype, device), memory.zeros(shape, self.dtype, device)


class EagleHead(DraftHead):
    """An EAGLE-1/2 head over a target `Transformer`. `forward` has the target's pure, static-shape contract
    plus `input_hidden` (the hidden state paired with each token)."""

    def __init__(self, target: Transformer, config: ModelConfig | None = None, *, fc_bias: bool = True,
                 draft_vocab: Tensor | None = None, empty: bool = False) -> None:
        """config: the head's shapes (default: the target's with one layer); only intermediate_size, the
        head counts, attention_bias and rms_norm_eps may differ from the target's. empty=True builds the
        head's own weights on the meta device, for loaders that `load_state_dict(..., assign=True)`."""
        super().__init__()
        tc = target.config
        c = replace(tc if config is None else config, num_layers=1)
        if c.hidden_size != tc.hidden_size:
            raise ModelFormatError(f"EAGLE head hidden size {c.hidden_size} != target hidden size {tc.hidden_size}")
        if c.head_dim != tc.head_dim:
            raise ModelFormatError(f"EAGLE head head_dim {c.head_dim} != target head_dim {tc.head_dim} "
                                   "(the head uses the target's RoPE tables)")
        if c.num_heads % c.num_kv_heads:
            raise ModelFormatError(f"EAGLE head: {c.num_heads} query heads are not a multiple of "
                                   f"{c.num_kv_heads} KV heads")
        # The head reads the target's vocabulary, RoPE and (no) sliding window.
        self.config = replace(c, vocab_size=tc.vocab_size, max_position_embeddings=tc.max_position_embeddings,
                              rope_theta=tc.rope_theta, rope_scaling=tc.rope_scaling, sliding_window=tc.sliding_window)
        H = c.hidden_size
        device = torch.device("meta") if empty else target.tok_embeddings.weight.device
        with torch.device(device):
            self.fc = nn.Linear(2 * H, H, bias=fc_bias)
            layer = Block(self.config)
            layer.attention_norm = nn.Identity()  # cnets: layer 0 has no input_layernorm
            self.layers = nn.ModuleList([layer])
        self.fc.to(target.dtype)
        self.layers.to(target.dtype)
        # Shared with the target as submodules (as the layer-skip draft shares them): graph modules and
        # backends see one tensor under two names; nothing is copied.
        self.tok_embeddings = target.tok_embeddings
        self.output = target.output
        self.register_buffer("rope_cos", target.rope_cos, persistent=False)
        self.register_buffer("rope_sin", target.rope_sin, persistent=False)
        self.set_draft_vocab(draft_vocab)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def own_parameters(self) -> list[nn.Parameter]:
        """The head's trainable weights (fc and the decoder layer), without the shared target weights."""
        return [*self.fc.parameters(), *self.layers.parameters()]

    def set_draft_vocab(self, ids: Tensor | None) -> None:
        """Restrict logits to the full-vocabulary ids `ids` [Vd] (None: the whole vocabulary)."""
        if ids is None:
            self.register_buffer("draft_vocab", None)
            self.register_buffer("draft_lm_weight", None, persistent=False)
            return
        weight = self._full_lm_weight()
        self.register_buffer("draft_vocab", check_draft_vocab(ids, self.config.vocab_size, "EAGLE head").to(
            weight.device))
        # A gathered copy of Vd LM-head rows, so each pass multiplies by Vd rows instead of gathering them.
        self.register_buffer("draft_lm_weight", weight.detach().index_select(0, self.draft_vocab), persistent=False)

    def _full_lm_weight(self) -> Tensor:
        return full_vocab_weight(self._lm_holder())

    def _lm_holder(self) -> nn.Module:
        return self.tok_embeddings if self.output is None else self.output

    def logits(self, hidden: Tensor, reduced: bool = False) -> Tensor:
        """LM-head logits of head outputs hidden [..., H]: [..., V] (entries outside the draft vocabulary at
        the dtype's finfo.min), or with reduced=True [..., Vd] over the draft vocabulary (for training)."""
        return lm_logits(hidden, self._lm_holder(), self.draft_vocab, self.draft_lm_weight, reduced)

    def layer_inputs(self, tokens: Tensor, input_hidden: Tensor) -> tuple[Tensor]:
        """What the decoder layer takes before its RoPE tables: fc(cat(embedding, hidden))."""
        emb = self.tok_embeddings(tokens).to(input_hidden.dtype)
        return (self.fc(torch.cat([emb, input_hidden], dim=-1)),)

# ---- helpers shared by the draft-head modules ----

def check_draft_vocab(ids: Tensor, vocab_size: int, what: str) -> Tensor:
    """Validate a draft vocabulary: 1-D integer ids, unique, in [0, vocab_size). Returns them as int64."""
    if not isinstance(ids, Tensor) or ids.dim() != 1 or ids.is_floating_point() or ids.numel() == 0:
        raise ModelFormatError(f"{what}: draft_vocab must be a non-empty 1-D integer tensor")
    ids = ids.to(torch.long)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ModelFormatError(f"{what}: draft_vocab ids must be in [0, {vocab_size})")
    if ids.unique().numel() != ids.numel():
        raise ModelFormatError(f"{what}: draft_vocab has duplicate ids")
    return ids


def lm_logits(hidden: Tensor, holder: nn.Module, draft_vocab: Tensor | None, draft_weight: Tensor | None,
              reduced: bool = False) -> Tensor:
    """hidden [..., H] against the LM head `holder` holds (`vocab_logits`), or only against the draft
    vocabulary's rows (a full copy, so no rank gathers them), scattered into full-vocabulary logits filled
    with finfo.min (so top-k, argmax and softmax never pick a token outside it)."""
    if draft_vocab is None:
        return vocab_logits(hidden, holder)
    small = hidden @ draft_weight.t()
    return small if reduced else scatter_vocab(small, draft_vocab, getattr(holder, "vocab_size", holder.weight.shape[0]))


def scatter_vocab(small: Tensor, draft_vocab: Tensor, vocab_size: int) -> Tensor:
    """Draft-vocabulary logits [..., Vd] as full-vocabulary logits [..., V]: entry draft_vocab[i] holds
    small[..., i], every other token finfo.min."""
    full = torch.full((*small.shape[:-1], vocab_size), torch.finfo(small.dtype).min, dtype=small.dtype,
                      device=small.device)
    return full.scatter(-1, draft_vocab.expand(small.shape), small)


def resolve_weights_file(path: str | os.PathLike, default_name: str, what: str) -> Path:
    """The safetensors file of a head: `path` itself (a .safetensors file) or `default_name` inside a directory
    (else its only .safetensors file). Pickles are refused, with how to convert them."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelFormatError(f"{p}: no such file or directory")
    if p.is_file():
        if p.suffix in PICKLE_SUFFIXES:
            raise ModelFormatError(_pickle_message(p, what))
        return p
    if (p / default_name).is_file():
        return p / default_name
    found = sorted(p.glob("*.safetensors"))
    if len(found) == 1:
        return found[0]
    if len(found) > 1:
        raise ModelFormatError(f"{p}: several .safetensors files and no {default_name}; pass the file itself")
    pickles = sorted(f for f in p.iterdir() if f.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ModelFormatError(_pickle_message(pickles[0], what))
    raise ModelFormatError(f"{p}: no {default_name} (a {what} directory holds {default_name} and config.json)")


def _pickle_message(p: Path, what: str) -> str:
    return (f"{p}: a PyTorch pickle; specair refuses pickles (loading one can run code). Convert the {what} to "
            f"safetensors where you trust the file: python -c \"import torch, safetensors.torch as st; "
            f"st.save_file({{k: v.contiguous() for k, v in torch.load('{p.name}', map_location='cpu', "
            f"weights_only=True).items()}}, '{p.stem}.safetensors')\"")


def read_safetensors(path: Path) -> dict[str, Tensor]:
    """All tensors of a safetensors file, with a clear error for a pickle or a corrupt file."""
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as e:  # SafetensorError, OSError
        try:
            with open(path, "rb") as f:
                magic = f.read(2)
        except OSError:
            magic = b""
        # torch.save writes a zip archive (PK) or, in the legacy format, a pickle (protocol byte 0x80).
        if magic[:2] == b"PK" or magic[:1] == b"\x80":
            raise ModelFormatError(_pickle_message(path, "checkpoint")) from None
        raise ModelFormatError(f"{path}: corrupt or truncated safetensors file ({e})") from None


def read_config(directory: Path) -> dict | None:
    """config.json next to a head's weights, or None where there is none."""
    f = directory / "config.json"
    if not f.is_file():
        return None
    return read_json_object(f)


def save_safetensors(tensors: dict[str, Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write tensors (each cloned contiguous: safetensors refuses shared storage) to path."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}, str(path),
              metadata=metadata)


def expect_shape(sd: dict[str, Tensor], key: str, shape: tuple[int, ...], source: str, why: str = "") -> Tensor:
    if key not in sd:
        raise ModelFormatError(f"{source}: missing tensor {key}")
    t = sd[key]
    if tuple(t.shape) != shape:
        raise ModelFormatError(f"{source}: tensor {key} has shape {tuple(t.shape)}, expected {shape}{why}")
    return t


# ---- SafeAILab layout ----

_LAYER = "layers.0."


def save_eagle(head: EagleHead, directory: str | os.PathLike) -> None:
    """Write `config.json` and `model.safetensors` in SafeAILab's key layout (plus `draft_vocab` when set)."""
    d = Path(directory)
    c = head.config
    layer = head.layers[0]
    q, k, v = layer.attention.wqkv.weight.split([c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
                                                 c.num_kv_heads * c.head_dim])
    gate, up = layer.feed_forward.w13.weight.chunk(2)
    sd = {"fc.weight": head.fc.weight,
          _LAYER + "self_attn.q_proj.weight": q, _LAYER + "self_attn.k_proj.weight": k,
          _LAYER + "self_attn.v_proj.weight": v, _LAYER + "self_attn.o_proj.weight": layer.attention.wo.weight,
          _LAYER + "mlp.gate_proj.weight": gate, _LAYER + "mlp.up_proj.weight": up,
          _LAYER + "mlp.down_proj.weight": layer.feed_forward.w2.weight,
          _LAYER + "post_attention_layernorm.weight": layer.ffn_norm.weight}
    if head.fc.bias is not None:
        sd["fc.bias"] = head.fc.bias
    if c.attention_bias:
        sizes = [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        for name, b in zip("qkv", layer.attention.wqkv.bias.split(sizes), strict=True):
            sd[_LAYER + f"self_attn.{name}_proj.bias"] = b
    if head.draft_vocab is not None:
        sd["draft_vocab"] = head.draft_vocab
    cfg = c.to_hf()
    cfg.update({"num_hidden_layers": 1, "bias": head.fc.bias is not None, "specair_head": "eagle",
                "draft_vocab_size": None if head.draft_vocab is None else int(head.draft_vocab.numel())})
    d.mkdir(parents=True, exist_ok=True)
    save_safetensors(sd, d / "model.safetensors", metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")


def load_eagle(path: str | os.PathLike, target: Transformer) -> EagleHead:
    """An EAGLE-1/2 head from a SafeAILab-layout checkpoint: a directory (model.safetensors, config.json
    optional) or a .safetensors file. Shapes are checked against the target; weights take its dtype."""
    f = resolve_weights_file(path, "model.safetensors", "EAGLE head")
    src = str(f)
    sd = read_safetensors(f)
    if any(k.startswith("midlayer.") for k in sd) or "d2t" in sd:
        raise ModelFormatError(f"{src}: an EAGLE-3 checkpoint (midlayer.*, d2t); specair loads EAGLE-1/2 heads")
    sd = {k.removeprefix("ea_layer."): t for k, t in sd.items()}
    cfg = read_config(f.parent) or {}
    tc = target.config
    H, D = tc.hidden_size, tc.head_dim
    if "fc.weight" not in sd:
        raise ModelFormatError(f"{src}: no fc.weight; not an EAGLE-1/2 head (keys: {', '.join(sorted(sd)[:4])}, ...)")
    if cfg.get("hidden_size", H) != H or tuple(sd["fc.weight"].shape) != (H, 2 * H):
        raise ModelFormatError(f"{src}: head for hidden size {cfg.get('hidden_size', sd['fc.weight'].shape[0])} "
                               f"(fc.weight {tuple(sd['fc.weight'].shape)}), target hidden size is {H}: "
                               "the head was trained for another model")
    att = _LAYER + "self_attn."
    for key in (att + "q_proj.weight", att + "k_proj.weight", _LAYER + "mlp.gate_proj.weight"):
        if key not in sd:
            raise ModelFormatError(f"{src}: missing tensor {key}")
        if sd[key].dim() != 2 or sd[key].shape[1] != H:
            raise ModelFormatError(f"{src}: tensor {key} has shape {tuple(sd[key].shape)}, expected (*, {H})")
    q_rows, kv_rows = sd[att + "q_proj.weight"].shape[0], sd[att + "k_proj.weight"].shape[0]
    if q_rows % D or kv_rows % D or not kv_rows or (q_rows // D) % (kv_rows // D):
        raise ModelFormatError(f"{src}: q/k projections with {q_rows}/{kv_rows} rows do not fit the target's "
                               f"head_dim {D}")
    n_heads, n_kv = q_rows // D, kv_rows // D
    for key, want in (("num_attention_heads", n_heads), ("num_key_value_heads", n_kv)):
        if key in cfg and cfg[key] is not None and int(cfg[key]) != want:
            raise ModelFormatError(f"{src}: config.json says {key}={cfg[key]}, the weights imply {want} "
                                   f"(with the target's head_dim {D})")
    inter = sd[_LAYER + "mlp.gate_proj.weight"].shape[0]
    if "vocab_size" in cfg and cfg["vocab_size"] is not None and int(cfg["vocab_size"]) != tc.vocab_size:
        raise ModelFormatError(f"{src}: head for a vocabulary of {cfg['vocab_size']}, target has {tc.vocab_size}")
    attention_bias = att + "q_proj.bias" in sd
    c = replace(tc, num_layers=1, num_heads=n_heads, num_kv_heads=n_kv, intermediate_size=inter,
                attention_bias=attention_bias, rms_norm_eps=float(cfg.get("rms_norm_eps", tc.rms_norm_eps)))
    shapes = {
        att + "v_proj.weight": (n_kv * D, H), att + "o_proj.weight": (H, n_heads * D),
        _LAYER + "mlp.gate_proj.weight": (inter, H), _LAYER + "mlp.up_proj.weight": (inter, H),
        _LAYER + "mlp.down_proj.weight": (H, inter), _LAYER + "post_attention_layernorm.weight": (H,),
    }
    for key, shape in shapes.items():
        expect_shape(sd, key, shape, src)
    if "fc.bias" in sd:
        expect_shape(sd, "fc.bias", (H,), src)
    if attention_bias:
        for name, rows in (("q", n_heads * D), ("k", n_kv * D), ("v", n_kv * D)):
            expect_shape(sd, att + f"{name}_proj.bias", (rows,), src)
    if "embed_tokens.weight" in sd:  # SafeAILab heads carry a copy of the target's embedding; the target's is used
        expect_shape(sd, "embed_tokens.weight", (tc.vocab_size, H), src, " (the target's embedding)")
    known = set(shapes) | {"fc.weight", "fc.bias", "embed_tokens.weight", "draft_vocab", att + "q_proj.weight",
                           att + "k_proj.weight"} | {att + f"{n}_proj.bias" for n in "qkv"}
    unknown = sorted(set(sd) - known)
    if unknown:
        raise ModelFormatError(f"{src}: unexpected tensors {', '.join(unknown[:3])}; an EAGLE-1/2 head has one "
                               "decoder layer without input_layernorm")

    head = EagleHead(target, c, fc_bias="fc.bias" in sd, empty=True)
    dt = target.dtype
    ours = {"fc.weight": sd["fc.weight"].to(dt),
            "layers.0.attention.wqkv.weight": torch.cat([sd[att + f"{n}_proj.weight"] for n in "qkv"]).to(dt),
            "layers.0.attention.wo.weight": sd[att + "o_proj.weight"].to(dt),
            "layers.0.feed_forward.w13.weight": torch.cat([sd[_LAYER + "mlp.gate_proj.weight"],
                                                           sd[_LAYER + "mlp.up_proj.weight"]]).to(dt),
            "layers.0.feed_forward.w2.weight": sd[_LAYER + "mlp.down_proj.weight"].to(dt),
            "layers.0.ffn_norm.weight": sd[_LAYER + "post_attention_layernorm.weight"].to(dt)}
    if "fc.bias" in sd:
        ours["fc.bias"] = sd["fc.bias"].to(dt)
    if attention_bias:
        ours["layers.0.attention.wqkv.bias"] = torch.cat([sd[att + f"{n}_proj.bias"] for n in "qkv"]).to(dt)
    device = target.tok_embeddings.weight.device
    ours = {k: t.to(device) for k, t in ours.items()}
    head.fc.load_state_dict({k[3:]: v for k, v in ours.items() if k.startswith("fc.")}, strict=True, assign=True)
    head.layers.load_state_dict({k[7:]: v for k, v in ours.items() if k.startswith("layers.")}, strict=True,
                                assign=True)
    head.set_draft_vocab(sd.get("draft_vocab"))
    return head.eval().requires_grad_(False)
