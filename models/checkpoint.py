"""Load model weights from any supported source into HF-named tensors: the one entry point is `load_checkpoint`.

Sources: an HF directory (config.json + safetensors), a GGUF file, a llama2.c `.bin`, or None for the
default model. Pickle files (`pytorch_model.bin`, `.pt`) are refused: loading them runs arbitrary code.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from specair.models.config import ModelConfig, read_json_object
from specair.models.errors import ModelFormatError
from specair.models.llama import GGUF_PARTS, placeholder, shard_layout, shard_slice, shard_state_dict  # noqa: F401
from specair.models.tokenizer import Tokenizer




@dataclass(frozen=True)
class StoredWeight:
    """A linear weight [N, K] as a GGUF file stores it: GGML type name (Q4_K, Q8_0, F16, ...) and its raw rows,
    bytes [N, row bytes], each row K weights in the type's blocks (rows in HF order)."""

    type: str
    raw: np.ndarray
    shape: tuple[int, int]


@dataclass
class Checkpoint:
    """Weights with HF transformers names (q/k rows in HF rotate-half order), their config and tokenizer."""

    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None
    source: str
    fingerprint: str
    shard: tuple[int, int] | None = None  # (rank, world) when `state_dict` holds one rank's parts (`shard_slice`)
    # GGUF files with quantized weights: every linear weight (HF name) as the file stores it
    stored: dict[str, StoredWeight] = field(default_factory=dict)


_LINEAR = (".q_proj.weight", ".k_proj.weight", ".v_proj.weight", ".o_proj.weight", ".gate_proj.weight",
           ".up_proj.weight", ".down_proj.weight")


EMBED = "model.embed_tokens.weight"


def linear_weight(name: str) -> bool:
    """Whether the HF-named tensor is a linear layer's weight (the LM head included, the embedding table not)."""
    return name.endswith(_LINEAR) or name == "lm_head.weight"


def lazy_tensor(name: str, stored: dict[str, StoredWeight] | frozenset) -> bool:
    """Whether a lazy load (`load_checkpoint`'s lazy_linear) leaves the HF-named tensor a placeholder: every
    linear weight, and the embedding table where the file stores it as blocks (`stored`; the graphs look its
    rows up in them)."""
    return linear_weight(name) or (name == EMBED and name in stored)


def load_checkpoint(
    path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32, progress: bool = True,
    shard: tuple[int, int] | None = None, lazy_linear: bool = False,
) -> Checkpoint:
    """Load a checkpoint: None -> the default model, a directory -> HF safetensors dir, a file starting with
    `GGUF` -> GGUF, any other file -> llama2.c `.bin`. Weights come back in `dtype`. With `shard` (rank,
    world), only that rank's parts of each tensor (`shard_slice`): read alone from safetensors, cut from
    the whole for GGUF and llama2.c (their tensors are quantized or interleaved as stored). With
    `lazy_linear` (HF directories and GGUF files, unsharded), linear weights are not read at all: each is a
    `placeholder` of its shape, for a model whose compiled graphs read their own copies of them; so is the
    embedding table where the file stores it as blocks (the graphs look its rows up in them)."""
    lazy_linear = lazy_linear and shard is None
    if path is None:
        from specair.models.default_model import default_model_dir

        # The cache holds fp32/fp16/bf16 conversions; other dtypes (float64 for exactness tests) upcast fp32.
        from specair.models.default_model import default_gguf_path
        from specair.models.gguf_loader import load_stored

        cached = dtype if dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.float32
        d = default_model_dir(cached, progress=progress)
        # the file's blocks, for kernels that read them as stored
        stored = load_stored(default_gguf_path(), ModelConfig.from_hf(read_json_object(d / "config.json"))) \
            if shard is None else {}
        ckpt = load_hf_dir(d, dtype, shard, lazy_linear, stored)
        ckpt.stored = stored
        return ckpt
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelFormatError(f"{p}: no such file or directory")
    if p.is_dir():
        return load_hf_dir(p, dtype, shard, lazy_linear)
    ckpt = _load_file(p, dtype, progress, lazy_linear)
    if shard is not None:
        ckpt.state_dict, ckpt.shard = shard_state_dict(ckpt.state_dict, ckpt.config, *shard), shard
        ckpt.stored = {}
    return ckpt


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint holds, read from its headers alone: its parameter count and the GGML types of its 2-D
    weights (empty for float checkpoints: HF safetensors, llama2.c, float GGUF files)."""

    num_params: int
    quantized_types: frozenset[str]


def describe(path: str | os.PathLike | None) -> CheckpointInfo:
    """CheckpointInfo without reading any weights (None: the default model, whose weights are Q4_1 and Q8_0)."""
    if path is None:
        from specair.models.default_model import default_gguf_path

        path = default_gguf_path()
    p = Path(path).expanduser()
    if p.is_dir():
        cfg = ModelConfig.from_hf(read_json_object(p / "config.json")) if (p / "config.json").is_file() else None
        if cfg is None:
            raise ModelFormatError(f"{p}: no config.json; an HF model directory needs config.json and model.safetensors")
        shapes = expected_shapes(cfg)
        return CheckpointInfo(sum(int(np.prod(s)) for s in shapes.values()), frozenset())
    if not p.is_file():
        raise ModelFormatError(f"{p}: no such file or directory")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        from specair.models.gguf_loader import gguf_info

        return gguf_info(p)
    size = p.stat().st_size  # a llama2.c file is its float32 weights and a small header
    return CheckpointInfo(size // 4, frozenset())


def check_memory(path: str | os.PathLike | None, dtype: torch.dtype) -> None:
    """Refuse, in one line and before any weight is read, a checkpoint whose weights would not fit in the memory
    this machine has available: loading holds them in `dtype` twice at its peak (as read, and fused)."""
    info = describe(path)
    need = 2 * info.num_params * torch.empty((), dtype=dtype).element_size()
    free = available_memory()
    if free is not None and need > free:
        raise ModelFormatError(
            f"{path or 'the default model'}: {info.num_params / 1e9:.2f}B parameters need about {need / 2**30:.1f} GiB "
            f"of memory to load as {str(dtype).removeprefix('torch.')} and this machine has {free / 2**30:.1f} GiB "
            "available")


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (Linux MemAvailable), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _load_file(p: Path, dtype: torch.dtype, progress: bool, lazy_linear: bool = False) -> Checkpoint:
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelFormatError(f"{p}: cannot read ({e.strerror})") from None
    if magic == b"GGUF":
        from specair.models.gguf_loader import load_gguf

        return load_gguf(p, dtype, progress=progress, lazy_linear=lazy_linear)
    if magic[:2] == b"PK" or magic[:1] == b"\x80":
        raise ModelFormatError(f"{p}: looks like a PyTorch pickle; specair refuses pickles (they can run code). "
                               "Convert it to safetensors and pass the directory holding config.json")
    if p.suffix == ".safetensors":
        raise ModelFormatError(f"{p}: pass the directory holding config.json and this file, not the file itself")
    from specair.models.llama2c import load_llama2c

    return load_llama2c(p, dtype)


# ---- helpers shared by the loaders ----

_HASH_CACHE: dict[tuple, str] = {}


def file_sha256(paths: list[Path]) -> str:
    """sha256 over the concatenated contents of `paths`, streamed; cached in-process by (path, size, mtime)."""
    stats = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in paths]
    key = tuple(stats)
    if key not in _HASH_CACHE:
        h = hashlib.sha256()
        for p in paths:
            with open(p, "rb") as f:
                while chunk := f.read(1 << 22):
                    h.update(chunk)
        _HASH_CACHE[key] = h.hexdigest()
    return _HASH_CACHE[key]


def interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the rows of a q/k projection (weight or bias) from interleaved-pair RoPE (Meta, llama2.c,
    llama.cpp) to HF's rotate-half layout: per head, rows (x0, y0, x1, y1, ...) -> (x0, x1, ..., y0, y1, ...)."""
    out = w.shape[0]
    return w.reshape(n_heads, out // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def half_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of `interleaved_to_half` (what llama.cpp's converter applies to HF q/k weights)."""
    out = w.shape[0]
    return w.reshape(n_heads, 2, out // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of `cfg` must have, with its shape (optional biases excluded)."""
    h, q, kv, i = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for n in range(cfg.num_layers):
        pre = f"model.layers.{n}."
        shapes |= {
            pre + "input_layernorm.weight": (h,),
            pre + "post_attention_layernorm.weight": (h,),
            pre + "self_attn.q_proj.weight": (q, h),
            pre + "self_attn.k_proj.weight": (kv, h),
            pre + "self_attn.v_proj.weight": (kv, h),
            pre + "self_attn.o_proj.weight": (h, q),
            pre + "mlp.gate_proj.weight": (i, h),
            pre + "mlp.up_proj.weight": (i, h),
            pre + "mlp.down_proj.weight": (h, i),
        }
        if cfg.attention_bias:
            shapes |= {pre + "self_attn.q_proj.bias": (q,), pre + "self_attn.k_proj.bias": (kv,),
                       pre + "self_attn.v_proj.bias": (kv,)}
        if cfg.output_bias:
            shapes[pre + "self_attn.o_proj.bias"] = (h,)
        if cfg.qk_norm:
            shapes |= {pre + "self_attn.q_norm.weight": (cfg.head_dim,), pre + "self_attn.k_norm.weight": (cfg.head_dim,)}
    return shapes


def random_checkpoint(cfg: ModelConfig, seed: int = 0, scale: float = 0.2) -> dict[str, torch.Tensor]:
    """A checkpoint of `cfg` with random weights, N(0, scale²) (norm weights around 1), for checks that need
    a model's shapes and a deterministic function rather than its answers (vLLM's "dummy" load format)."""
    g = torch.Generator().manual_seed(seed)
    return {k: (1.0 if k.endswith("norm.weight") else 0.0) + scale * torch.randn(shape, generator=g)
            for k, shape in expected_shapes(cfg).items()}


def _optional_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    for n in range(cfg.num_layers):
        pre = f"model.layers.{n}.self_attn."
        shapes |= {pre + "q_proj.bias": (q,), pre + "k_proj.bias": (kv,), pre + "v_proj.bias": (kv,)}
    return shapes


def check_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig, source: str) -> dict[str, torch.Tensor]:
    """Validate names and shapes against `cfg`; drop rotary caches and a tied lm_head; warn about unknown tensors."""
    return {k: sd[k] for k in checked_names({k: tuple(t.shape) for k, t in sd.items()}, cfg, source)}


def checked_names(shapes: dict[str, tuple[int, ...]], cfg: ModelConfig, source: str) -> list[str]:
    """The tensors to keep of a checkpoint whose tensors have `shapes`, validated against `cfg` as
    `check_state_dict` does (before any is read, so a sharded load checks the whole shapes)."""
    required, optional = expected_shapes(cfg), _optional_shapes(cfg)
    missing = [k for k in required if k not in shapes]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ModelFormatError(f"{source}: missing tensors {', '.join(missing[:3])}{more}")
    keep, unknown = [], []
    for k, shape in shapes.items():
        if k.endswith("rotary_emb.inv_freq") or (k == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        want = required.get(k) or optional.get(k)
        if want is None:
            unknown.append(k)
            continue
        if shape != want:
            raise ModelFormatError(f"{source}: tensor {k} has shape {shape}, config.json implies {want}")
        keep.append(k)
    if unknown:
        warnings.warn(f"{source}: ignoring {len(unknown)} unknown tensors, e.g. {unknown[0]}", stacklevel=4)
    return keep


# ---- HF safetensors directory ----

def load_hf_dir(directory: str | os.PathLike, dtype: torch.dtype = torch.float32,
                shard: tuple[int, int] | None = None, lazy_linear: bool = False,
                stored: dict[str, StoredWeight] | None = None) -> Checkpoint:
    """Load an HF model directory: config.json, model.safetensors (or a sharded index), tokenizer files;
    with `shard` (rank, world), reading only that rank's part of each tensor (`shard_slice`); with
    `lazy_linear` (unsharded), placeholders where `lazy_tensor` says (`stored`: the blocks a GGUF file holds of
    these weights, the default model's)."""
    from safetensors import safe_open

    d = Path(directory)
    if not d.is_dir():
        raise ModelFormatError(f"{d}: no such directory")
    if not (d / "config.json").is_file():
        raise ModelFormatError(f"{d}: no config.json; an HF model directory needs config.json and model.safetensors")
    cfg = ModelConfig.from_hf(read_json_object(d / "config.json"))
    files = _safetensors_files(d)
    layout = None if shard is None else shard_layout(cfg, *shard)

    def read(step: str, f: Path, each) -> None:  # noqa: ANN001
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    each(st, name, f)
        except ModelFormatError:
            raise
        except Exception as e:  # SafetensorError, OSError, or torch's error on a short buffer
            raise ModelFormatError(f"{f}: corrupt or truncated safetensors file ({step}: {e})") from None

    shapes: dict[str, tuple[int, ...]] = {}

    def header(st, name: str, f: Path) -> None:  # noqa: ANN001
        part = st.get_slice(name)
        if not part.get_dtype().startswith(("F", "BF")):
            raise ModelFormatError(
                f"{f}: tensor {name} has dtype {part.get_dtype()}; quantized checkpoints are not supported")
        shapes[name] = tuple(part.get_shape())

    for f in files:
        read("header", f, header)
    keep = set(checked_names(shapes, cfg, str(d)))
    sd: dict[str, torch.Tensor] = {}

    def tensor(st, name: str, f: Path) -> None:  # noqa: ANN001
        if name not in keep:
            return
        if lazy_linear and layout is None and lazy_tensor(name, stored or {}):
            sd[name] = placeholder(shapes[name], dtype)
            return
        cut = None if layout is None else shard_slice(layout, name, cfg)
        if cut is None:
            t = st.get_tensor(name)
        else:
            dim, start, stop = cut
            t = st.get_slice(name)[(slice(None),) * dim + (slice(start, stop),)]
        sd[name] = t.to(dtype)

    for f in files:
        read("data", f, tensor)
    return Checkpoint(cfg, sd, Tokenizer.from_hf_dir(d), str(d), file_sha256(files), shard)


def _safetensors_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelFormatError(f"{index}: not a valid safetensors index ({e})") from None
        files = [d / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelFormatError(f"{index} lists {f.name}, which is missing")
        return files
    if (d / "model.safetensors").is_file():
        return [d / "model.safetensors"]
    pickles = sorted(p.name for p in d.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    if pickles:
        raise ModelFormatError(
            f"{d}: weights only as {pickles[0]}, a PyTorch pickle; specair refuses pickles (they can run code). "
            "Convert it to model.safetensors (e.g. save_pretrained(..., safe_serialization=True))"
        )
    raise ModelFormatError(f"{d}: no model.safetensors or model.safetensors.index.json")
