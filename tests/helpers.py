"""Tiny random HF checkpoints for parity tests (real transformers models, saved with save_pretrained)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, max_position_embeddings=512)

VARIANTS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "llama3-rope": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                     "rope_theta": 500000.0}),
    "llama-tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {"tie_word_embeddings": True}),
    # Llama 3.2 1B/3B: llama3 rope scaling and a tied head; o_proj bias as attention_bias asks
    "llama3-tied-bias": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                         {"rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                          "rope_theta": 500000.0, "tie_word_embeddings": True, "attention_bias": True}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    # head_dim 32 with 4 heads over hidden 64: q projects to 128, not to the hidden size
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"tie_word_embeddings": True, "head_dim": 32}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": 24}),
}


def save_tiny(kind: str, path: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """Save a randomly initialised HF model of one of VARIANTS to path; return the HF model (eval mode)."""
    cfg_cls, model_cls, extra = VARIANTS[kind]
    torch.manual_seed(seed)
    cfg = cfg_cls(**{**TINY, **extra, **overrides})
    model = model_cls(cfg).to(dtype).eval()
    # Random init leaves norms at 1 and biases at 0; perturb them so a loader that drops them fails.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def to_q4_1(w: torch.Tensor) -> torch.Tensor:
    """w rounded onto GGUF Q4_1 blocks of 32 (fp16 scale d and minimum m, w = d*q + m), as the loader
    dequantizes them."""
    N, K = w.shape
    b = w.reshape(N, K // 32, 32)
    m = b.amin(-1).half().float()
    d = ((b.amax(-1) - m) / 15).half().float()
    q = ((b - m[..., None]) / d[..., None]).round().clamp(0, 15)
    return (q * d[..., None] + m[..., None]).reshape(N, K)


GGUF_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
              "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
              "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(name: str) -> str:
    """llama.cpp's tensor name for an HF one."""
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if name in top:
        return top[name]
    _, _, layer, rest = name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_BLOCK[module]}.{suffix}"


def gguf_writer(path, cfg):
    """A gguf.GGUFWriter at `path` holding the metadata of a specair ModelConfig `cfg`, as llama.cpp writes it."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch=cfg.model_type)
    for key, value in dict(block_count=cfg.num_layers, context_length=cfg.max_position_embeddings,
                           embedding_length=cfg.hidden_size, feed_forward_length=cfg.intermediate_size,
                           head_count=cfg.num_heads, head_count_kv=cfg.num_kv_heads, rope_freq_base=cfg.rope_theta,
                           layer_norm_rms_eps=cfg.rms_norm_eps, rope_dimension_count=cfg.head_dim,
                           key_length=cfg.head_dim, value_length=cfg.head_dim, vocab_size=cfg.vocab_size,
                           bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_ids[0]).items():
        getattr(w, f"add_{key}")(value)
    return w
