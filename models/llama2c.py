"""karpathy/llama2.c checkpoints: the legacy `.bin` (7-int header, run.c) and the version-1 fp32 export (`ak42`)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from specair.models.checkpoint import Checkpoint, check_state_dict, file_sha256, interleaved_to_half
from specair.models.config import ModelConfig
from specair.models.errors import ModelFormatError

_MAGIC_V1 = 0x616B3432  # "ak42", export.py --version 1/2
_V1_HEADER = 256


def _read_header(path: Path) -> tuple[int, tuple[int, ...], bool | None]:
    """(offset of the first weight, the 7 params, shared classifier flag for v1 files or None for legacy)."""
    with open(path, "rb") as f:
        head = f.read(_V1_HEADER)
    if len(head) < 28:
        raise ModelFormatError(f"{path}: {len(head)} bytes; too short for a llama2.c checkpoint header")
    magic, version = np.frombuffer(head[:8], dtype="<u4")
    if magic == _MAGIC_V1:
        if version != 1:
            raise ModelFormatError(f"{path}: llama2.c export version {version} is not supported "
                                   "(specair reads the legacy format and version 1, fp32)")
        if len(head) < 37:
            raise ModelFormatError(f"{path}: truncated llama2.c version-1 header")
        params = tuple(int(x) for x in np.frombuffer(head[8:36], dtype="<i4"))
        return _V1_HEADER, params, bool(head[36])
    return 28, tuple(int(x) for x in np.frombuffer(head[:28], dtype="<i4")), None


def load_llama2c(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> Checkpoint:
    """Load a llama2.c checkpoint: q/k rows are reordered from its interleaved RoPE to HF rotate-half;
    no tokenizer (llama2.c keeps it in a separate `tokenizer.bin`)."""
    path = Path(path)
    offset, (dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len), shared = _read_header(path)
    if shared is None:  # legacy: a negative vocab size flags an unshared classifier
        shared, vocab = vocab > 0, abs(vocab)
    if min(dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len) <= 0 or dim % n_heads or n_heads % n_kv_heads \
            or (dim // n_heads) % 2:
        raise ModelFormatError(
            f"{path}: not a llama2.c checkpoint (header dim={dim} hidden_dim={hidden} n_layers={n_layers} "
            f"n_heads={n_heads} n_kv_heads={n_kv_heads} vocab_size={vocab} seq_len={seq_len})"
        )
    head_dim = dim // n_heads
    kv_dim = n_kv_heads * head_dim
    L = n_layers
    layer_shapes = {
        "wq": (L, dim, dim), "wk": (L, kv_dim, dim), "wv": (L, kv_dim, dim), "wo": (L, dim, dim),
        "w1": (L, hidden, dim), "w2": (L, dim, hidden), "w3": (L, hidden, dim),
    }
    if offset == _V1_HEADER:
        order = [("rms_att", (L, dim)), ("rms_ffn", (L, dim)), ("rms_final", (dim,)), ("tok", (vocab, dim)),
                 *layer_shapes.items()]
    else:
        order = [("tok", (vocab, dim)), ("rms_att", (L, dim)), *list(layer_shapes.items())[:4], ("rms_ffn", (L, dim)),
                 *list(layer_shapes.items())[4:], ("rms_final", (dim,)),
                 ("freq_real", (seq_len, head_dim // 2)), ("freq_imag", (seq_len, head_dim // 2))]
    if not shared:
        order.append(("wcls", (vocab, dim)))
    count = sum(int(np.prod(s)) for _, s in order)
    expected, actual = offset + 4 * count, path.stat().st_size
    if actual != expected:
        what = "truncated" if actual < expected else "longer than its header implies"
        raise ModelFormatError(
            f"{path}: {what} ({actual} bytes, header implies {expected}); not a complete llama2.c checkpoint")

    data = np.memmap(path, dtype="<f4", mode="r", offset=offset, shape=(count,))
    w: dict[str, torch.Tensor] = {}
    pos = 0
    for name, shape in order:
        n = int(np.prod(shape))
        w[name] = torch.from_numpy(np.array(data[pos:pos + n]).reshape(shape))
        pos += n
    del data

    sd = {"model.embed_tokens.weight": w["tok"], "model.norm.weight": w["rms_final"]}
    if not shared:
        sd["lm_head.weight"] = w["wcls"]
    for i in range(L):
        pre = f"model.layers.{i}."
        sd |= {
            pre + "input_layernorm.weight": w["rms_att"][i],
            pre + "post_attention_layernorm.weight": w["rms_ffn"][i],
            pre + "self_attn.q_proj.weight": interleaved_to_half(w["wq"][i], n_heads),
            pre + "self_attn.k_proj.weight": interleaved_to_half(w["wk"][i], n_kv_heads),
            pre + "self_attn.v_proj.weight": w["wv"][i],
            pre + "self_attn.o_proj.weight": w["wo"][i],
            pre + "mlp.gate_proj.weight": w["w1"][i],
            pre + "mlp.down_proj.weight": w["w2"][i],
            pre + "mlp.up_proj.weight": w["w3"][i],
        }
    sd = {k: v.to(dtype, copy=True) for k, v in sd.items()}  # own storage, not views of the layer stacks
    cfg = ModelConfig(
        vocab_size=vocab, hidden_size=dim, intermediate_size=hidden, num_layers=L, num_heads=n_heads,
        num_kv_heads=n_kv_heads, head_dim=head_dim, max_position_embeddings=seq_len, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=shared, model_type="llama",
        # llama2.c models use the Llama 2 sentencepiece ids: BOS 1, EOS 2.
        bos_token_id=1, eos_token_ids=(2,),
    )
    return Checkpoint(cfg, check_state_dict(sd, cfg, str(path)), None, str(path), file_sha256([path]))
