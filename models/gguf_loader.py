"""GGUF (llama.cpp) files: metadata -> ModelConfig, dequantized tensors -> HF names and layout, tokenizer."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specair.models.checkpoint import (Checkpoint, CheckpointInfo, StoredWeight, check_state_dict, file_sha256,
                                       interleaved_to_half, lazy_tensor)
from specair.models.config import ModelConfig
from specair.models.errors import ModelFormatError
from specair.models.llama import placeholder
from specair.models.tokenizer import Tokenizer

# GGUF `general.architecture` -> HF architecture. llama.cpp permutes q/k rows of llama-family models for its
# interleaved RoPE; qwen2 files keep HF's order.
_ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
          "qwen3": "Qwen3ForCausalLM"}
_PERMUTED = {"llama", "mistral"}
_FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(gguf_name: str) -> str | None:
    """HF state-dict name of a GGUF tensor name (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`)."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{suffix}"
    return None


def open_gguf(path: str | os.PathLike) -> Any:
    """A `gguf.GGUFReader` on `path`, with truncation or corruption reported as ModelFormatError."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError/IndexError/... on short or garbled files
        raise ModelFormatError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from None


def dequantize(tensor: Any) -> np.ndarray:
    """A GGUF tensor as float32 in torch's (row-major, reversed-ggml) shape."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    try:
        if tensor.tensor_type == Q.F64:
            arr = np.asarray(tensor.data).view(np.float64).astype(np.float32)
        elif tensor.tensor_type in (Q.I8, Q.I16, Q.I32, Q.I64):
            raise NotImplementedError
        else:
            arr = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
    except NotImplementedError:
        raise ModelFormatError(
            f"tensor {tensor.name} has GGML type {tensor.tensor_type.name}, which specair cannot dequantize"
        ) from None
    if arr.size != math.prod(shape):
        raise ModelFormatError(f"tensor {tensor.name}: {arr.size} values for shape {shape}; the file is corrupt")
    return arr.reshape(shape)


def _llama3_factors(theta: float, dim: int, factor: float, low: float, high: float, orig: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp stores in `rope_freqs.weight` for Llama 3.1-style rope scaling."""
    freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * math.pi / freqs
    smooth = (orig / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, mid))


def _f32(x: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(x)))


def gguf_hf_config(reader: Any) -> dict[str, Any]:
    """The HF `config.json` dict equivalent to a GGUF file's metadata."""

    def meta(key: str, default: Any = None) -> Any:
        field = reader.fields.get(key)
        return default if field is None else field.contents()

    arch = meta("general.architecture")
    if arch not in _ARCHS:
        raise ModelFormatError(f"GGUF architecture {arch!r} is not supported; specair reads {', '.join(_ARCHS)}")

    def need(key: str) -> Any:
        value = meta(f"{arch}.{key}")
        if value is None:
            raise ModelFormatError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(meta(f"{arch}.attention.key_length", hidden // heads))
    rope_dim = int(meta(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ModelFormatError(
            f"GGUF rope.dimension_count {rope_dim} != head dim {head_dim}: partial RoPE is not supported")
    tensors = {t.name: t for t in reader.tensors}
    vocab = meta(f"{arch}.vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else int(tensors["token_embd.weight"].shape[-1])
    theta = _f32(meta(f"{arch}.rope.freq_base", 10000.0))

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    scaling, factor = meta(f"{arch}.rope.scaling.type"), meta(f"{arch}.rope.scaling.factor")
    orig = int(meta(f"{arch}.rope.scaling.original_context_length", 8192))
    if meta(f"{arch}.rope.scale_linear") is not None:  # older files
        scaling, factor = "linear", meta(f"{arch}.rope.scale_linear")
    if "rope_freqs.weight" in tensors:
        # Llama 3.1+: llama.cpp stores the scaled frequencies' divisors, not the recipe. Recover the recipe.
        stored = dequantize(tensors["rope_freqs.weight"]).astype(np.float64)
        factor = float(stored.max())
        expected = _llama3_factors(theta, head_dim, factor, 1.0, 4.0, orig)
        if stored.shape != expected.shape or not np.allclose(stored, expected, rtol=1e-3):
            raise ModelFormatError("GGUF rope_freqs.weight does not match Llama 3 rope scaling; not supported")
        rope |= {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": orig}
    elif scaling not in (None, "none") and factor and float(factor) != 1.0:
        rope |= {"rope_type": scaling, "factor": float(factor)}
        if scaling != "linear":
            rope["original_max_position_embeddings"] = orig

    eos = [meta(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    eos = list(dict.fromkeys(int(i) for i in eos if i is not None))
    return {
        "architectures": [_ARCHS[arch]],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(meta(f"{arch}.context_length", 2048)),
        "rms_norm_eps": _f32(meta(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_parameters": rope,
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors or "blk.0.attn_output.bias" in tensors,
        "bos_token_id": meta("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
    }


def load_gguf(path: str | os.PathLike, dtype: torch.dtype = torch.float32, progress: bool = True,
              lazy_linear: bool = False) -> Checkpoint:
    """Load a llama/mistral/qwen2/qwen3 GGUF file: dequantize every tensor to `dtype`, undo llama.cpp's q/k
    permutation; with `lazy_linear`, every linear weight, and the embedding table of a quantized file, is a
    placeholder of its shape instead (read by compiled graphs from their own copies; the stored blocks stay
    known in `Checkpoint.stored`)."""
    from tqdm import tqdm

    path = Path(path)
    gguf_info(path)  # an unknown tensor type is one clear line before the reader's
    reader = open_gguf(path)
    arch = reader.fields["general.architecture"].contents() if "general.architecture" in reader.fields else None
    cfg = ModelConfig.from_hf(gguf_hf_config(reader))
    sd: dict[str, torch.Tensor] = {}
    stored = stored_weights(reader, cfg)
    lazy = {t.name for t in reader.tensors if lazy_linear and lazy_tensor(hf_name(t.name) or "", stored)}
    for t in reader.tensors:
        if t.name in lazy:  # GGML lists dimensions innermost first
            sd[hf_name(t.name)] = placeholder((int(t.shape[1]), int(t.shape[0])), dtype)
    for t in tqdm([t for t in reader.tensors if t.name not in lazy], desc=f"dequantizing {path.name}",
                  unit="tensor", file=sys.stderr, disable=not progress, leave=False):
        name = hf_name(t.name)
        if name is None:
            continue  # rope_freqs (read into the config) and tensors specair does not use
        w = torch.from_numpy(np.array(dequantize(t), dtype=np.float32))
        if arch in _PERMUTED and (".q_proj." in name or ".k_proj." in name):
            w = interleaved_to_half(w, cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads)
        sd[name] = w.to(dtype)
    sd = check_state_dict(sd, cfg, str(path))
    tokenizer = Tokenizer.from_gguf(reader) if "tokenizer.ggml.model" in reader.fields else None
    return Checkpoint(cfg, sd, tokenizer, str(path), file_sha256([path]),
                      stored={n: w for n, w in stored.items() if n in sd})


def stored_weights(reader: Any, cfg: ModelConfig, names: set[str] | None = None) -> dict[str, StoredWeight]:
    """Every 2-D weight of a GGUF file (HF name -> StoredWeight) as the file stores it, its rows in HF order (a
    row is whole blocks, so rows permute as the weights' do), read from the file's mapping without a copy where
    no rows move; empty for a file of float weights only (a float checkpoint like any other)."""
    arch = reader.fields["general.architecture"].contents() if "general.architecture" in reader.fields else None
    index = [(t.name, t.tensor_type.name, tuple(int(d) for d in t.shape), np.asarray(t.data)) for t in reader.tensors]
    return _stored(index, arch, cfg, names)


def _stored(index: list[tuple[str, str, tuple[int, ...], np.ndarray]], arch: str | None, cfg: ModelConfig,
            names: set[str] | None) -> dict[str, StoredWeight]:
    stored: dict[str, StoredWeight] = {}
    for gname, kind, shape, data in index:
        name = hf_name(gname)
        if name is None or len(shape) != 2 or (names is not None and name not in names):
            continue
        N, K = shape[1], shape[0]  # GGML lists dimensions innermost first
        raw = data.view(np.uint8).reshape(N, -1)
        if arch in _PERMUTED and (".q_proj." in name or ".k_proj." in name):
            heads = cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads
            raw = interleaved_to_half(torch.from_numpy(np.array(raw)), heads).numpy()
        stored[name] = StoredWeight(kind, raw, (N, K))
    if all(w.type in _FLOAT_TYPES for w in stored.values()):
        return {}
    return stored


def gguf_info(path: str | os.PathLike) -> CheckpointInfo:
    """A GGUF file's parameter count (the tensors specair reads) and the GGML types of its quantized weights,
    from its tensor index."""
    from gguf import GGMLQuantizationType

    _, tensors, _ = _tensor_index(Path(path))
    params, types = 0, set()
    for name, dims, kind, _ in tensors:
        if hf_name(name) is None:
            continue
        params += math.prod(dims)
        try:
            type_name = GGMLQuantizationType(kind).name
        except ValueError:
            raise ModelFormatError(f"{path}: tensor {name} has GGML type {kind}, which neither gguf nor specair "
                                   "knows") from None
        if len(dims) == 2:
            types.add(type_name)
    return CheckpointInfo(params, frozenset() if types <= _FLOAT_TYPES else frozenset(types))


def load_stored(path: str | os.PathLike, cfg: ModelConfig) -> dict[str, StoredWeight]:
    """`stored_weights` of the GGUF file at `path` (for a model loaded from its conversion), from the file's
    tensor index alone: gguf's reader parses every metadata string, seconds for a vocabulary."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    arch, tensors, data_start = _tensor_index(Path(path))
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    index = []
    for name, dims, kind, offset in tensors:
        qtype = GGMLQuantizationType(kind)
        block, size = GGML_QUANT_SIZES[qtype]
        nbytes = math.prod(dims) // block * size
        index.append((name, qtype.name, dims, mm[data_start + offset:data_start + offset + nbytes]))
    return _stored(index, arch, cfg, None)


_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value types
_STRING, _ARRAY = 8, 9


def _tensor_index(path: Path) -> tuple[str | None, list[tuple[str, tuple[int, ...], int, int]], int]:
    """A GGUF file's architecture, tensors (name, dims innermost first, GGML type, offset in the data section)
    and the data section's start, from its header; metadata values other than those two are skipped."""
    import struct

    size = path.stat().st_size
    with open(path, "rb") as f:
        buf = f.read(1 << 16)
        pos = 0

        def need(n: int) -> None:
            nonlocal buf
            if pos + n > size:
                raise ModelFormatError(f"{path}: corrupt or truncated GGUF file (its header runs past the end)")
            while pos + n > len(buf):
                more = f.read(max(1 << 20, n))
                if not more:
                    raise ModelFormatError(f"{path}: truncated GGUF header")
                buf += more

        def take(fmt: str):
            nonlocal pos
            n = struct.calcsize("<" + fmt)
            need(n)
            out = struct.unpack_from("<" + fmt, buf, pos)
            pos += n
            return out

        def string() -> bytes:
            nonlocal pos
            (n,) = take("Q")
            need(n)
            pos += n
            return buf[pos - n:pos]

        def skip(kind: int) -> None:
            nonlocal pos
            if kind == _STRING:
                string()
            elif kind == _ARRAY:
                item, count = take("IQ")
                if item in _SCALAR_SIZES:
                    need(count * _SCALAR_SIZES[item])
                    pos += count * _SCALAR_SIZES[item]
                else:
                    for _ in range(count):
                        skip(item)
            elif kind in _SCALAR_SIZES:
                need(_SCALAR_SIZES[kind])
                pos += _SCALAR_SIZES[kind]
            else:
                raise ModelFormatError(f"{path}: corrupt GGUF file (metadata value of unknown type {kind})")

        magic, _, n_tensors, n_kv = take("4sIQQ")
        if magic != b"GGUF":
            raise ModelFormatError(f"{path}: not a GGUF file")
        arch, alignment = None, 32
        for _ in range(n_kv):
            key = string()
            (kind,) = take("I")
            if key == b"general.architecture" and kind == _STRING:
                arch = string().decode()
            elif key == b"general.alignment" and kind == 4:
                (alignment,) = take("I")
            else:
                skip(kind)
        tensors = []
        for _ in range(n_tensors):
            name = string().decode()
            (n_dims,) = take("I")
            dims = take(f"{n_dims}Q")
            kind, offset = take("IQ")
            tensors.append((name, tuple(int(d) for d in dims), int(kind), int(offset)))
        return arch, tensors, -(-pos // alignment) * alignment


def convert_gguf_to_hf_dir(
    gguf_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: torch.dtype = torch.float32, progress: bool = True
) -> Path:
    """Write a GGUF file as an HF model dir (config.json, model.safetensors, tokenizer files) in `dtype`.

    The dir appears atomically: it is written under a temporary name and renamed when complete. If another
    process finished the same dir first, its result is kept.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    ckpt = load_gguf(gguf_path, dtype, progress=progress)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        hf = ckpt.config.to_hf() | {"dtype": str(dtype).removeprefix("torch.")}
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        save_file({k: v.contiguous() for k, v in ckpt.state_dict.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt", "source": Path(gguf_path).name})
        os.chmod(tmp / "model.safetensors", 0o644)  # safetensors writes it owner-only
        if ckpt.tokenizer is not None:
            ckpt.tokenizer.save(tmp)
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
