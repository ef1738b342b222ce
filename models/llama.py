"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2) with a static-shape, graph-friendly forward.

The forward never writes the KV cache: it reads the committed prefix (a view of the cache sliced to a
context bucket), attends over it plus the T new tokens, and returns the new tokens' K/V. The caller
commits the K/V it keeps (all of a prefill chunk; only the accepted path of a speculative tree), so a
rejected draft never touches the cache, and attention never copies the cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor, nn

from specair.models import memory, shm_collectives  # noqa: F401 (shm_collectives registers torch.ops.specair)
from specair.models.config import ModelConfig
from specair.models.errors import ModelFormatError


class ModelOutput(NamedTuple):
    logits: Tensor  # [B, n, V] at `logits_index` (n = T when it is None)
    hidden: Tensor  # [B, T, F]: after the final norm (F = H; what EAGLE and Medusa heads read), or a feature view's
    # layer inputs side by side (F = H x their count; what EAGLE-3 reads), see `with_features`
    new_k: Tensor  # [L, B, Hkv, T, D]
    new_v: Tensor  # [L, B, Hkv, T, D]


def static_shape(t: Tensor) -> tuple[int, ...]:
    """t's shape as Python ints, unrecorded: every graph's shapes are static, so a trace may bake them in."""
    state = torch._C._get_tracing_state()
    torch._C._set_tracing_state(None)
    try:
        return tuple(int(d) for d in t.shape)
    finally:
        torch._C._set_tracing_state(state)


def rope_inv_freq(config: ModelConfig, dtype: torch.dtype) -> Tensor:
    """Inverse RoPE frequencies, with linear or Llama-3 scaling applied as transformers does."""
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        inv = torch.where(medium, smoothed, scaled)
    return inv


# Table rows past the model's context: a fused kernel (onnxruntime's GroupQueryAttention) wants the table to
# cover the whole cache buffer plus a step's tokens, and the buffer has spare slots past the context.
ROPE_MARGIN = 1024


def rope_tables(config: ModelConfig, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin tables [max_positions + ROPE_MARGIN, head_dim / 2] (one entry per rotated pair, the layout
    fused rotary kernels take); float32 math like transformers, float64 for float64 models."""
    math_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    inv = rope_inv_freq(config, math_dtype)
    pos = torch.arange(config.max_position_embeddings + ROPE_MARGIN, dtype=math_dtype)
    freqs = torch.outer(pos, inv)
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, T, H, D]; cos/sin [B, T, 1, D/2] (rotate-half layout, as HF checkpoints store q/k). The same
    products and sums as transformers' x*cos + rotate_half(x)*sin over duplicated tables, so bit-equal."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class TensorParallel(NamedTuple):
    """One rank's place in a tensor-parallel group (its torch.distributed process group, rank and size) and,
    for CPU ranks on one host, the id of its shared-memory group (models/shm_collectives)."""

    group: Any
    rank: int
    world: int
    shm: int | None = None


def all_reduce(x: Tensor, tp: TensorParallel | None) -> Tensor:
    """The sum of every rank's x (a custom op or a functional collective, so graph captures keep it inside)."""
    if tp is None:
        return x
    if tp.shm is not None:
        return torch.ops.specair.shm_all_reduce(x, tp.shm)
    return funcol.all_reduce(x, "sum", tp.group)


def all_gather(x: Tensor, tp: TensorParallel) -> Tensor:
    """Every rank's x concatenated along dim 0, in rank order."""
    if tp.shm is not None:
        return torch.ops.specair.shm_all_gather(x, tp.shm, tp.world)
    return funcol.all_gather_single(x, 0, tp.group)


class Embedding(nn.Embedding):
    """nn.Embedding; under tensor parallelism (`tp` set by `build_model`), this rank's rows of the vocabulary from
    `vocab_start` on: tokens outside them embed as zeros and the ranks' embeddings are summed."""

    tp: TensorParallel | None = None
    vocab_start: int = 0

    def forward(self, tokens: Tensor) -> Tensor:
        if self.tp is None:
            return super().forward(tokens)
        local = tokens - self.vocab_start
        inside = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(torch.where(inside, local, 0), self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(x, self.tp)


def vocab_logits(hidden: Tensor, holder: nn.Module) -> Tensor:
    """hidden [..., H] @ holder.weight.T: logits over the whole vocabulary from the LM head's holder (the
    embedding when tied, else the output Linear); under tensor parallelism each rank's rows are gathered."""
    logits = hidden @ holder.weight.t()
    tp = getattr(holder, "tp", None)
    if tp is None:
        return logits
    full = all_gather(logits.movedim(-1, 0).contiguous(), tp)
    return full[:holder.vocab_size].movedim(0, -1)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dimension, normalising in at least float32 (as transformers does) so half-precision
    models stay accurate."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def swiglu(gate_up: Tensor) -> Tensor:
    """silu(gate) * up of a fused gate/up projection's output [..., 2F] (gate first)."""
    gate, up = gate_up.split(static_shape(gate_up)[-1] // 2, dim=-1)  # chunk() would export as shape arithmetic
    return F.silu(gate) * up


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        fn = _ROWWISE.fn
        return rms_norm(x, self.weight, self.eps) if fn is None else fn.rms_norm(x, self.weight, self.eps)


def attend(q: Tensor, k: Tensor, v: Tensor, k_past: Tensor, v_past: Tensor, mask: Tensor,
           k_prev: Tensor | None, v_prev: Tensor | None, scale: float) -> Tensor:
    """Grouped-query attention of T new tokens over a cache context and (optionally) earlier tokens of
    the step. q [B, T, H, D], k/v [B, T, Hkv, D] (RoPE applied); k_past/v_past [B, Hkv, C, D]; k_prev/
    v_prev [B, Hkv, E, D] or None; mask additive [B, 1, 1, T, C+E+T]; scale 1/sqrt(D) (a Python float:
    a traced shape would not be). Returns [B, T, H*D]."""
    B, T, H, D = q.shape
    Hkv = k.shape[2]
    G = H // Hkv
    # Group query heads by their KV head ([B, Hkv, G*T, D]) so GQA never repeats the cache.
    q = q.view(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D)
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    k_new = k if k_prev is None else torch.cat([k_prev, k], dim=2)
    v_new = v if v_prev is None else torch.cat([v_prev, v], dim=2)
    C, N = k_past.shape[2], k_new.shape[2]
    scores = torch.cat([q @ k_past.transpose(-1, -2), q @ k_new.transpose(-1, -2)], dim=-1)
    scores = scores.view(B, Hkv, G, T, C + N) * scale + mask
    soft_dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    p = scores.softmax(dim=-1, dtype=soft_dtype).to(q.dtype).view(B, Hkv, G * T, C + N)
    out = p[..., :C] @ v_past + p[..., C:] @ v_new
    return out.view(B, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, H * D)


class AttentionInputs(NamedTuple):
    """What a fused attention kernel needs beyond `attend`'s tensors: the committed length per row, the
    step's own visibility (tree or causal) among its T tokens before they become an additive mask, and
    the positions with the whole RoPE tables (a fused rotary kernel indexes them itself)."""

    cache_len: Tensor  # [B]
    tree_mask: Tensor | None  # [1 or B, T, T] bool; None: causal
    sliding_window: int | None
    positions: Tensor  # [B, T]
    rope: tuple[Tensor, Tensor]  # cos, sin [max_positions, D/2]


def rope_attend(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_past: Tensor, v_past: Tensor,
                mask: Tensor, k_prev: Tensor | None, v_prev: Tensor | None, scale: float,
                heads: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """RoPE, then `attend`, from the projections q [B, T, H*D], k/v [B, T, Hkv*D] (heads = (H, Hkv));
    returns the output [B, T, H*D] and the rotated k [B, T, Hkv, D]."""
    B, T, _ = q.shape
    H, Hkv = heads
    D = q.shape[-1] // H
    q = apply_rope(q.view(B, T, H, D), cos, sin)
    k = apply_rope(k.view(B, T, Hkv, D), cos, sin)
    return attend(q, k, v.view(B, T, Hkv, D), k_past, v_past, mask, k_prev, v_prev, scale), k


# The attention kernel every layer calls: `rope_attend`, unless a backend swaps in its own for a capture
# (`use_attention`); a replacement takes one more argument, the AttentionInputs.
class KernelSlot:
    """A function a backend swaps in for reference code while it captures a graph (`use`); None: the reference."""

    def __init__(self) -> None:
        self.fn: Callable[..., Any] | None = None

    @contextlib.contextmanager
    def use(self, fn: Callable[..., Any] | None) -> Iterator[None]:
        prev, self.fn = self.fn, fn
        try:
            yield
        finally:
            self.fn = prev


_ATTENTION = KernelSlot()
# The row-wise steps (an object with `rms_norm(x, weight, eps)` and `swiglu(gate_up)`), which a backend may
# capture as single operators (`use_rowwise`).
_ROWWISE = KernelSlot()


def use_rowwise(kernels: Any) -> contextlib.AbstractContextManager[None]:
    """Run RMSNorm and the SwiGLU activation through `kernels.rms_norm` and `kernels.swiglu` (computing what
    `rms_norm` and `swiglu` compute) while the block runs; backends use it to capture fused operators."""
    return _ROWWISE.use(kernels)


def use_attention(kernel) -> contextlib.AbstractContextManager[None]:
    """Run every Attention layer through `kernel(q, k, v, cos, sin, k_past, v_past, mask, k_prev, v_prev,
    scale, heads, inputs)` (it must compute what `rope_attend` computes) while the block runs; backends use
    it to capture a fused op."""
    return _ATTENTION.use(kernel)


class Attention(nn.Module):
    tp: TensorParallel | None = None

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.wqkv = nn.Linear(c.hidden_size, q_dim + 2 * kv_dim, bias=c.attention_bias)
        self.wo = nn.Linear(q_dim, c.hidden_size, bias=c.output_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, k_past: Tensor, v_past: Tensor,
                mask: Tensor, k_prev: Tensor | None, v_prev: Tensor | None,
                inputs: AttentionInputs | None = None) -> tuple[Tensor, Tensor, Tensor]:
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv, self.head_dim
        q, k, v = self.wqkv(x).split([H * D, Hkv * D, Hkv * D], dim=-1)
        if self.q_norm is not None:
            q = self.q_norm(q.view(B, T, H, D)).view(B, T, H * D)
            k = self.k_norm(k.view(B, T, Hkv, D)).view(B, T, Hkv * D)
        kernel, scale = _ATTENTION.fn, 1.0 / math.sqrt(D)
        args = (q, k, v, cos, sin, k_past, v_past, mask, k_prev, v_prev, scale, (H, Hkv))
        if kernel is None or inputs is None:  # without AttentionInputs (training), no kernel can replace it
            out, k = rope_attend(*args)
        else:
            out, k = kernel(*args, inputs)
        return all_reduce(self.wo(out), self.tp), k.transpose(1, 2), v.view(B, T, Hkv, D).transpose(1, 2)


class FeedForward(nn.Module):
    tp: TensorParallel | None = None

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.w13 = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.w2 = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        fn = _ROWWISE.fn
        h = self.w13(x)
        return all_reduce(self.w2(swiglu(h) if fn is None else fn.swiglu(h)), self.tp)


class Block(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.attention = Attention(c)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.feed_forward = FeedForward(c)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, k_past: Tensor, v_past: Tensor,
                mask: Tensor, k_prev: Tensor | None, v_prev: Tensor | None,
                inputs: AttentionInputs | None = None) -> tuple[Tensor, Tensor, Tensor]:
        a, k, v = self.attention(self.attention_norm(x), cos, sin, k_past, v_past, mask, k_prev, v_prev, inputs)
        x = x + a
        return x + self.feed_forward(self.ffn_norm(x)), k, v


class Transformer(nn.Module):
    """The decoder. `forward` is pure: static shapes in, static shapes out, no host syncs."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        c = config
        self.tok_embeddings = Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.output = None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.to(dtype)
        cos, sin = rope_tables(c, dtype)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.feature_layers: tuple[int, ...] = ()
        self.feature_final = False

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.weight.dtype

    @property
    def feature_size(self) -> int:
        """The width of `ModelOutput.hidden`: H, or H per feature layer (and the final state) of a feature view."""
        return self.config.hidden_size * max(1, len(self.feature_layers) + self.feature_final)

    @property
    def lm_holder(self) -> nn.Module:
        """The module whose weight is the LM head: the embedding when tied, else the output Linear."""
        return self.tok_embeddings if self.output is None else self.output

    def lm_head(self, hidden: Tensor) -> Tensor:
        return vocab_logits(hidden, self.lm_holder)

    def forward(self, tokens: Tensor, positions: Tensor, cache_len: Tensor, k_cache: Tensor, v_cache: Tensor,
                tree_mask: Tensor | None = None, logits_index: Tensor | None = None, prev_k: Tensor | None = None,
                prev_v: Tensor | None = None) -> ModelOutput:
        """Run T new tokens per row against the committed prefix (and, optionally, earlier tokens of
        the same step that are not in the cache).

        tokens, positions: [B, T] int64; cache_len: [B] committed tokens per row (cache slots
        0..cache_len-1 are valid); k_cache, v_cache: [L, B, Hkv, C, D], the cache sliced to a context
        bucket C; prev_k, prev_v: [L, B, Hkv, E, D], K/V of E earlier tokens of this step (a draft
        loop's catch-up and drafted nodes); tree_mask: [B or 1, T, E+T] bool, which of those E and the
        T new tokens each new token sees (causal over T when None); logits_index: [B, n] positions in
        T whose logits are wanted (all T when None).
        """
        B, T = tokens.shape
        C = k_cache.shape[3]
        x = self.tok_embeddings(tokens)
        cos = self.rope_cos[positions].unsqueeze(2)
        sin = self.rope_sin[positions].unsqueeze(2)
        mask = self._mask(positions, cache_len, C, tree_mask, x.dtype)
        att = AttentionInputs(cache_len, tree_mask, self.config.sliding_window, positions,
                              (self.rope_cos, self.rope_sin))
        new_k, new_v, features = [], [], []
        for i, layer in enumerate(self.layers):
            if i in self.feature_layers:
                features.append(x)
            x, k, v = layer(x, cos, sin, k_cache[i], v_cache[i], mask,
                            None if prev_k is None else prev_k[i], None if prev_v is None else prev_v[i], att)
            new_k.append(k)
            new_v.append(v)
        hidden = self.norm(x)
        picked = hidden
        if logits_index is not None:
            picked = hidden.gather(1, logits_index.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
        if self.feature_layers:
            hidden = torch.cat(features + [hidden] * self.feature_final, dim=-1)
        return ModelOutput(self.lm_head(picked), hidden, torch.stack(new_k), torch.stack(new_v))

    def _mask(self, positions: Tensor, cache_len: Tensor, C: int, tree_mask: Tensor | None,
              dtype: torch.dtype) -> Tensor:
        """Additive mask [B, 1, 1, T, C+E+T]: committed slots < cache_len, then the tree (or causal) mask."""
        B, T = positions.shape
        slots = torch.arange(C, device=positions.device)
        past = slots.view(1, 1, C) < cache_len.view(-1, 1, 1)
        if tree_mask is None:
            tree_mask = torch.ones(T, T, dtype=torch.bool, device=positions.device).tril().unsqueeze(0)
        new = tree_mask.expand(B, T, tree_mask.shape[-1])
        window = self.config.sliding_window
        if window is not None:
            # Slot index = position for committed tokens; this step's tokens are all inside the window
            # of each other whenever the lookahead is shorter than the window.
            past = past & (positions.unsqueeze(-1) - slots.view(1, 1, C) < window)
            if new.shape[-1] == T:
                new = new & (positions.unsqueeze(-1) - positions.unsqueeze(1) < window)
        allowed = torch.cat([past.expand(B, T, C), new], dim=-1)
        neg = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=positions.device)
        zero = torch.zeros((), dtype=dtype, device=positions.device)
        return torch.where(allowed, zero, neg)[:, None, None]

    def empty_cache(self, batch: int, slots: int, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
        """A zeroed K and V cache [L, batch, Hkv, slots, D] in the model's dtype (on the CPU committed on write)."""
        c = self.config  # under tensor parallelism, this rank's KV heads
        shape = (c.num_layers, batch, c.num_kv_heads, slots, c.head_dim)
        return memory.zeros(shape, self.dtype, device), memory.zeros(shape, self.dtype, device)


def build_model(config: ModelConfig, state_dict: dict[str, Tensor], dtype: torch.dtype = torch.float32,
                tp: TensorParallel | None = None, stored: dict[str, Any] | None = None) -> Transformer:
    """A Transformer from an HF-named state dict (see `truncated` for a layer-skip draft). With `tp`, the
    state dict holds this rank's parts (`shard_slice`: what `load_checkpoint(..., shard=)` reads, or
    `shard_state_dict` of a whole one) and the model is this rank's shard, its `config` this rank's heads.
    `stored` (a GGUF checkpoint's `Checkpoint.stored`): each linear weight, the LM head included, keeps its
    rows as the file stores them in the attribute GGUF_PARTS, for kernels that read them exactly."""
    layout = None if tp is None else shard_layout(config, tp.rank, tp.world)
    mine = config if layout is None else layout.config
    rows = config.vocab_size if layout is None else layout.vocab[1] - layout.vocab[0]
    with torch.device("meta"):
        model = Transformer(replace(mine, vocab_size=rows), dtype)
    model.config = mine
    sd = state_dict

    def get(name: str) -> Tensor:
        if name not in sd:
            raise ModelFormatError(f"checkpoint lacks tensor {name!r}")
        return sd[name].to(dtype)

    def vocab(name: str) -> Tensor:
        t = get(name)  # the last rank's rows past the vocabulary are zeros, sliced off when gathered
        return t if t.shape[0] == rows else torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])

    def cat(ts: list[Tensor]) -> Tensor:  # a lazily loaded checkpoint's placeholders stay placeholders
        if all(is_placeholder(t) for t in ts):
            return placeholder((sum(t.shape[0] for t in ts), *ts[0].shape[1:]), ts[0].dtype)
        return torch.cat(ts)

    ours: dict[str, Tensor] = {"tok_embeddings.weight": vocab("model.embed_tokens.weight"),
                               "norm.weight": get("model.norm.weight")}
    if not config.tie_word_embeddings:
        ours["output.weight"] = vocab("lm_head.weight") if "lm_head.weight" in sd else ours["tok_embeddings.weight"]
    for i in range(config.num_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        att = p + "self_attn."
        ours[o + "attention_norm.weight"] = get(p + "input_layernorm.weight")
        ours[o + "ffn_norm.weight"] = get(p + "post_attention_layernorm.weight")
        ours[o + "attention.wqkv.weight"] = cat([get(att + f"{n}_proj.weight") for n in "qkv"])
        if config.attention_bias:
            ours[o + "attention.wqkv.bias"] = torch.cat([get(att + f"{n}_proj.bias") for n in "qkv"])
        ours[o + "attention.wo.weight"] = get(att + "o_proj.weight")
        if config.output_bias:  # added once: every rank's row-parallel part is summed
            bias = get(att + "o_proj.bias")
            ours[o + "attention.wo.bias"] = bias if tp is None or tp.rank == 0 else torch.zeros_like(bias)
        if config.qk_norm:
            ours[o + "attention.q_norm.weight"] = get(att + "q_norm.weight")
            ours[o + "attention.k_norm.weight"] = get(att + "k_norm.weight")
        ours[o + "feed_forward.w13.weight"] = cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
        ours[o + "feed_forward.w2.weight"] = get(p + "mlp.down_proj.weight")
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for name, t in ours.items():
        if tuple(t.shape) != expected[name]:
            raise ModelFormatError(f"tensor for {name} has shape {tuple(t.shape)}, config implies {expected[name]}")
    model.load_state_dict(ours, strict=True, assign=True)
    cos, sin = rope_tables(config, dtype)
    model.rope_cos, model.rope_sin = cos, sin
    if stored and tp is None:
        _attach_stored(model, stored)
    if tp is not None:
        for block in model.layers:
            block.attention.tp = block.feed_forward.tp = tp
        for holder in (model.tok_embeddings, model.output):
            if holder is not None:
                holder.tp, holder.vocab_start, holder.vocab_size = tp, layout.vocab[0], config.vocab_size
    return model.eval().requires_grad_(False)



# The attribute of a linear weight that holds its rows as the checkpoint stores them: a list of
# models.checkpoint.StoredWeight, concatenated along the rows (a fused q/k/v or gate/up is several).
GGUF_PARTS = "gguf_parts"


def _attach_stored(model: Transformer, stored: dict[str, Any]) -> None:
    """Give each linear weight (and a tied LM head's table) its stored parts, by HF name in row order."""
    def attach(weight: Tensor, names: list[str]) -> None:
        parts = [stored.get(n) for n in names]
        if all(p is not None for p in parts):
            setattr(weight, GGUF_PARTS, parts)

    for i, block in enumerate(model.layers):
        p = f"model.layers.{i}."
        attach(block.attention.wqkv.weight, [p + f"self_attn.{n}_proj.weight" for n in "qkv"])
        attach(block.attention.wo.weight, [p + "self_attn.o_proj.weight"])
        attach(block.feed_forward.w13.weight, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"])
        attach(block.feed_forward.w2.weight, [p + "mlp.down_proj.weight"])
    attach(model.tok_embeddings.weight, ["model.embed_tokens.weight"])  # its rows, looked up as stored
    if model.output is not None:
        attach(model.output.weight, ["lm_head.weight" if "lm_head.weight" in stored else "model.embed_tokens.weight"])


def placeholder(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A tensor of `shape` that holds no memory (a zero-stride view of one zero): a linear weight that only
    compiled graphs read, from their own copies."""
    return torch.zeros((), dtype=dtype).expand(shape)


def is_placeholder(t: Tensor) -> bool:
    """Whether `t` is a `placeholder` (or any view of one element spread over several)."""
    return t.numel() > 1 and all(s == 0 for s in t.stride())


def release_compiled_weights(model: nn.Module) -> int:
    """Replace the weight of every nn.Linear under `model` by a placeholder of its shape that holds no memory (a
    zero-stride view of one zero): for a model whose linear layers only compiled graphs read, from their own
    copies (specair's int4 kernels). An embedding table goes too where its rows are stored blocks (GGUF_PARTS:
    the graphs look them up in their own copy); a float one stays. Returns the bytes freed."""
    freed, seen = 0, set()
    for m in model.modules():
        stored_table = isinstance(m, nn.Embedding) and getattr(m.weight, GGUF_PARTS, None)
        if (isinstance(m, nn.Linear) or stored_table) and id(m.weight) not in seen and not is_placeholder(m.weight):
            w = m.weight
            freed += w.numel() * w.element_size()
            m.weight = nn.Parameter(placeholder(w.shape, w.dtype).to(w.device), requires_grad=False)
            parts = getattr(w, GGUF_PARTS, None)
            if parts:  # what the weight is stored as stays known (its bytes per token), not its rows
                setattr(m.weight, GGUF_PARTS, [dataclasses.replace(p, raw=np.empty(0, np.uint8)) for p in parts])
            seen.add(id(m.weight))
    return freed


def with_features(model: Transformer, layers: tuple[int, ...], final: bool = False) -> Transformer:
    """The model, sharing its weights, with `ModelOutput.hidden` replaced by the inputs of `layers` (the
    residual stream before each of them), concatenated in that order: the low/middle/high features an
    EAGLE-3 head reads; with `final`, the usual normed hidden state follows them (what distillation records
    for every kind of head). Logits are unchanged."""
    L = model.config.num_layers
    layers = tuple(int(i) for i in layers)
    if not layers or any(not 0 <= i < L for i in layers) or len(set(layers)) != len(layers):
        raise ModelFormatError(f"feature layers must be distinct layer indices in 0..{L - 1}, got {list(layers)}")
    if list(layers) != sorted(layers):
        raise ModelFormatError(f"feature layers must be in increasing order, got {list(layers)}")
    if model.feature_layers == layers and model.feature_final == final:
        return model
    with torch.device("meta"):
        view = Transformer(model.config, model.dtype)
    view.tok_embeddings, view.norm, view.output = model.tok_embeddings, model.norm, model.output
    view.layers = model.layers
    view.rope_cos, view.rope_sin = model.rope_cos, model.rope_sin
    view.feature_layers, view.feature_final = layers, final
    return view.eval()


def truncated(model: Transformer, num_layers: int) -> Transformer:
    """The model's first `num_layers` layers with its own final norm and LM head, sharing its weights
    (the layer-skip / self-speculative draft)."""
    if not 0 < num_layers <= model.config.num_layers:
        raise ModelFormatError(f"num_layers must be in 1..{model.config.num_layers}, got {num_layers}")
    with torch.device("meta"):
        draft = Transformer(replace(model.config, num_layers=num_layers), model.dtype)
    draft.tok_embeddings, draft.norm, draft.output = model.tok_embeddings, model.norm, model.output
    draft.layers = nn.ModuleList(list(model.layers)[:num_layers])
    draft.rope_cos, draft.rope_sin = model.rope_cos, model.rope_sin
    return draft.eval()


def _split(n: int, world: int) -> list[int]:
    """n units over `world` ranks, the first ranks taking one more where it does not divide."""
    return [n // world + (r < n % world) for r in range(world)]


class ShardLayout(NamedTuple):
    """One rank's part of a model under tensor parallelism, as [start, stop) ranges: its KV groups (a KV head
    with its query heads), FFN units and vocabulary rows (ceil(V / world) per rank; the last rank's run past
    the vocabulary and are zeros), and `config`, the model as this rank sees it (its heads and FFN width)."""

    kv_groups: tuple[int, int]
    ffn: tuple[int, int]
    vocab: tuple[int, int]
    config: ModelConfig


def shard_layout(config: ModelConfig, rank: int, world: int) -> ShardLayout:
    """Rank `rank`'s part of a `config` model over `world` ranks. Attention: whole KV groups per rank,
    column-parallel QKV and row-parallel output; MLP: column-parallel gate/up, row-parallel down (one
    all-reduce after each row-parallel projection); embedding and LM head vocabulary-parallel (a summed
    embedding, gathered logits). Ranks may hold unequal shares (9 heads in 3 KV groups: 6 + 3 over two)."""
    c = config
    if c.num_kv_heads < world:
        raise ModelFormatError(f"tensor parallelism over {world} ranks needs at least {world} KV heads; the model "
                               f"has {c.num_kv_heads}")
    groups, ffn = _split(c.num_kv_heads, world), _split(c.intermediate_size, world)
    g0, f0, per = sum(groups[:rank]), sum(ffn[:rank]), -(-c.vocab_size // world)
    mine = replace(c, num_heads=groups[rank] * (c.num_heads // c.num_kv_heads), num_kv_heads=groups[rank],
                   intermediate_size=ffn[rank])
    return ShardLayout((g0, g0 + groups[rank]), (f0, f0 + ffn[rank]), (rank * per, (rank + 1) * per), mine)


def shard_slice(layout: ShardLayout, name: str, config: ModelConfig) -> tuple[int, int, int] | None:
    """(dim, start, stop): the part of HF-named checkpoint tensor `name` (of a `config` model) that the rank
    of `layout` keeps; None for a tensor every rank keeps whole (the norms)."""
    D, G = config.head_dim, config.num_heads // config.num_kv_heads
    (g0, g1), (f0, f1), (v0, v1), _ = layout
    kind = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else name
    if kind == "q_proj":
        return 0, g0 * G * D, g1 * G * D
    if kind in ("k_proj", "v_proj"):
        return 0, g0 * D, g1 * D
    if kind == "o_proj" and name.endswith("weight"):
        return 1, g0 * G * D, g1 * G * D
    if kind in ("gate_proj", "up_proj"):
        return 0, f0, f1
    if kind == "down_proj":
        return 1, f0, f1
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return 0, v0, min(v1, config.vocab_size)
    return None


def shard_state_dict(state_dict: dict[str, Tensor], config: ModelConfig, rank: int,
                     world: int) -> dict[str, Tensor]:
    """The parts of an HF-named state dict rank `rank` of `world` keeps (`shard_slice`), each a compact copy:
    a view would keep the whole tensor alive, and a column slice would be strided in every matmul."""
    layout = shard_layout(config, rank, world)
    out = {}
    for name, t in state_dict.items():
        part = shard_slice(layout, name, config)
        out[name] = t if part is None else t.narrow(part[0], part[1], part[2] - part[1]).clone()
    return out


def full_vocab_weight(holder: nn.Module) -> Tensor:
    """The LM head's weight [V, H] from its holder: under tensor parallelism every rank's rows, gathered
    (a collective, so every rank calls it at the same point: where a head copies rows of it at load)."""
    tp = getattr(holder, "tp", None)
    if tp is None:
        return holder.weight
    return all_gather(holder.weight.contiguous(), tp)[:holder.vocab_size]
