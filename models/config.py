"""Model configuration for the Llama family, parsed from an HF `config.json` dict."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specair.models.errors import ModelFormatError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections
    output_bias: bool = False  # o_proj (Llama and Qwen3 with attention_bias; never Qwen2 or Mistral)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k before RoPE
    sliding_window: int | None = None
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Parse an HF `config.json` dict (transformers 4.x `rope_theta`/`rope_scaling` or 5.x `rope_parameters`)."""
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type")
        known = set(SUPPORTED_ARCHITECTURES.values())
        if model_type not in known and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise ModelFormatError(
                f"unsupported architecture {archs or model_type!r}; specair runs "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        model_type = model_type if model_type in known else SUPPORTED_ARCHITECTURES[archs[0]]
        try:
            hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
            theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ModelFormatError(f"unsupported rope scaling {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
            rope["rope_type"] = rope_type
            rope.pop("type", None)
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            window = cfg.get("sliding_window")
            if model_type in ("qwen2", "qwen3"):
                window = _qwen_window(cfg, window)
            if cfg.get("mlp_bias"):
                raise ModelFormatError("mlp_bias=true is not supported")
            return cls(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                rope_theta=theta,
                rope_scaling=None if rope_type == "default" else rope,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
                output_bias=model_type in ("llama", "qwen3") and bool(cfg.get("attention_bias", False)),
                qk_norm=model_type == "qwen3",
                sliding_window=int(window) if window else None,
                model_type=model_type,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except KeyError as e:
            raise ModelFormatError(f"config.json lacks required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ModelFormatError(f"config.json has an invalid value: {e}") from None

    def to_hf(self) -> dict[str, Any]:
        """The HF `config.json` dict that `from_hf` reads back to this config."""
        arch = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[self.model_type]
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope.update(self.rope_scaling)
        eos = list(self.eos_token_ids)
        return {
            "architectures": [arch],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias or self.output_bias,
            "sliding_window": self.sliding_window,
            "use_sliding_window": self.sliding_window is not None,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
            "hidden_act": "silu",
        }



def _qwen_window(cfg: dict[str, Any], window: Any) -> Any:
    """Qwen2/Qwen3's sliding window: none unless use_sliding_window, and then on layers from max_window_layers
    on only (transformers' layer_types), which specair runs only where that is every layer."""
    if not cfg.get("use_sliding_window", False) or window is None:
        return None
    layers = int(cfg.get("num_hidden_layers", 0))
    types = cfg.get("layer_types") or ["sliding_attention" if i >= int(cfg.get("max_window_layers", 0))
                                       else "full_attention" for i in range(layers)]
    if set(types) == {"full_attention"}:
        return None
    if set(types) != {"sliding_attention"}:
        raise ModelFormatError("a sliding window on some layers only (max_window_layers / layer_types) is not "
                               "supported; specair applies one window to every layer or none")
    return window


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file holding one object (config.json, tokenizer_config.json, ...); ModelFormatError otherwise."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path}: expected a JSON object")
    return data
