"""Checkpoint loaders: GGUF (default model vs transformers, tiny written files), llama2.c, HF dirs, bad inputs."""

from __future__ import annotations

import json
import math
import struct

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from helpers import gguf_name, gguf_writer
from safetensors.torch import save_file

from specair.models.checkpoint import expected_shapes, load_checkpoint, load_hf_dir
from specair.models.config import ModelConfig
from specair.models.errors import InputError, ModelFormatError
from specair.models.gguf_loader import convert_gguf_to_hf_dir, load_gguf


# ---- tiny models, written in each format ----

def tiny_config(model_type: str = "llama", tie: bool = False, bias: bool = False, head_dim: int = 16) -> ModelConfig:
    return ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=head_dim, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                       tie_word_embeddings=tie, attention_bias=bias, model_type=model_type, bos_token_id=1,
                       eos_token_ids=(2,), qk_norm=model_type == "qwen3")


def random_state(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=g) for k, shape in expected_shapes(cfg).items()}


def to_interleaved(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (HF rotate-half rows -> interleaved pairs), written out independently."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quant_round_trip(arr: np.ndarray, qtype: Q) -> np.ndarray:
    """What a weight becomes after writing it as `qtype` (per-row blocks, so row permutations commute with it)."""
    if qtype == Q.F32 or arr.ndim == 1:
        return arr
    if qtype == Q.F16:
        return arr.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(arr, qtype), qtype)


def write_gguf(path, cfg: ModelConfig, sd: dict[str, torch.Tensor], qtype: Q = Q.F32) -> None:
    arch = cfg.model_type
    w = gguf_writer(path, cfg)
    for name, t in sd.items():
        arr = t.numpy().astype(np.float32)
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            arr = to_interleaved(arr, cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads)
        if arr.ndim == 1 or qtype == Q.F32:
            w.add_tensor(gguf_name(name), arr)
        elif qtype == Q.F16:
            w.add_tensor(gguf_name(name), arr.astype(np.float16))
        else:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_hf_dir(path, cfg: ModelConfig, sd: dict[str, torch.Tensor]):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg.to_hf()))
    save_file(sd, str(path / "model.safetensors"))
    return path


# ---- the default model ----

@pytest.fixture(scope="module")
def default_ckpt(default_gguf):
    return load_gguf(default_gguf, progress=False)


def test_default_gguf_matches_transformers(hf_gguf, default_ckpt):
    model = hf_gguf
    theirs = model.state_dict()
    cfg = default_ckpt.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == 1e-5
    assert cfg.intermediate_size == model.config.intermediate_size
    assert set(theirs) == set(default_ckpt.state_dict) | {"lm_head.weight"}  # theirs lists the tied head too
    for name, t in default_ckpt.state_dict.items():
        assert t.dtype == torch.float32
        assert torch.equal(t, theirs[name]), name
    assert default_ckpt.tokenizer is not None and default_ckpt.tokenizer.vocab_size == 49152
    assert len(default_ckpt.fingerprint) == 64


def test_default_checkpoint_is_the_converted_gguf(default_hf_dir, default_ckpt):
    ckpt = load_checkpoint(None, progress=False)
    assert ckpt.source == str(default_hf_dir) and ckpt.config == default_ckpt.config
    assert ckpt.state_dict.keys() == default_ckpt.state_dict.keys()
    for name, t in ckpt.state_dict.items():
        assert torch.equal(t, default_ckpt.state_dict[name]), name
    text = "<|im_start|>user\nx  1 中文<|im_end|>"
    assert ckpt.tokenizer.encode(text) == default_ckpt.tokenizer.encode(text)
    assert ckpt.tokenizer.chat_template == default_ckpt.tokenizer.chat_template
    assert load_checkpoint(None, progress=False).fingerprint == ckpt.fingerprint
    del ckpt
    wide = load_checkpoint(None, dtype=torch.float64, progress=False)  # upcast from the fp32 cache
    assert wide.state_dict["model.norm.weight"].dtype == torch.float64
    assert torch.equal(wide.state_dict["model.norm.weight"].float(), default_ckpt.state_dict["model.norm.weight"])


def test_default_model_dir_rejects_other_dtypes():
    from specair.models.default_model import default_model_dir

    with pytest.raises(InputError, match="float32, float16 or bfloat16"):
        default_model_dir(torch.float64)


# ---- GGUF files written here ----

@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
def test_gguf_tiny_round_trip(tmp_path, qtype):
    cfg = tiny_config()
    sd = random_state(cfg)
    write_gguf(tmp_path / "m.gguf", cfg, sd, qtype)
    ckpt = load_checkpoint(tmp_path / "m.gguf", progress=False)
    assert ckpt.config == cfg and ckpt.tokenizer is None
    assert ckpt.state_dict.keys() == sd.keys()
    for name, t in sd.items():
        want = torch.from_numpy(quant_round_trip(t.numpy(), qtype))
        assert torch.equal(ckpt.state_dict[name], want), name
        tol = {Q.F32: 0, Q.F16: 2e-3, Q.BF16: 2e-2, Q.Q8_0: 0.05, Q.Q4_0: 0.8}[qtype]
        assert (ckpt.state_dict[name] - t).abs().max() <= tol, name  # and close to the source, q/k included


@pytest.mark.parametrize("fmt", ["gguf", "hf"])
def test_lazy_loads_read_every_tensor_but_the_linear_weights(tmp_path, fmt):
    """lazy_linear: linear weights (the LM head included, and a quantized file's embedding table, looked up in
    its blocks) are placeholders of their shapes holding no memory; every other tensor, the stored blocks and
    the fingerprint are the full load's."""
    cfg = tiny_config()
    sd = random_state(cfg)
    if fmt == "gguf":
        write_gguf(tmp_path / "m.gguf", cfg, sd, Q.Q8_0)
        path = tmp_path / "m.gguf"
    else:
        save_file(sd, str(tmp_path / "model.safetensors"))
        (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf()))
        path = tmp_path
    full, lazy = load_checkpoint(path, progress=False), load_checkpoint(path, progress=False, lazy_linear=True)
    assert lazy.state_dict.keys() == full.state_dict.keys() and lazy.fingerprint == full.fingerprint
    linear = {n for n in full.state_dict if n.endswith("proj.weight") or n == "lm_head.weight"}
    assert "lm_head.weight" in linear and len(linear) == 1 + 7 * cfg.num_layers
    if fmt == "gguf":
        linear.add("model.embed_tokens.weight")
    for name, t in full.state_dict.items():
        got = lazy.state_dict[name]
        if name in linear:
            assert got.shape == t.shape and got.dtype == t.dtype and set(got.stride()) == {0}
        else:
            assert torch.equal(got, t), name
    assert lazy.stored.keys() == full.stored.keys()
    assert all(np.array_equal(lazy.stored[n].raw, w.raw) for n, w in full.stored.items())
    assert (len(full.stored) > 0) == (fmt == "gguf")


def test_gguf_tiny_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    cfg = tiny_config(tie=True)
    sd = random_state(cfg, seed=1)
    write_gguf(tmp_path / "m.gguf", cfg, sd)
    ours = load_gguf(tmp_path / "m.gguf", progress=False).state_dict
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf").state_dict()
    for name, t in sd.items():  # both undo llama.cpp's q/k permutation back to the HF source
        assert torch.equal(ours[name], t) and torch.equal(theirs[name], t), name


def test_gguf_qwen2_is_not_permuted_and_keeps_biases(tmp_path):
    cfg = tiny_config("qwen2", tie=True, bias=True)
    sd = random_state(cfg, seed=2)
    write_gguf(tmp_path / "q.gguf", cfg, sd)
    ckpt = load_gguf(tmp_path / "q.gguf", dtype=torch.bfloat16, progress=False)
    assert ckpt.config.model_type == "qwen2" and ckpt.config.attention_bias and ckpt.config.tie_word_embeddings
    assert "model.layers.1.self_attn.k_proj.bias" in ckpt.state_dict
    for name, t in sd.items():
        assert torch.equal(ckpt.state_dict[name], t.to(torch.bfloat16)), name


def test_gguf_qwen3_matches_transformers(tmp_path):
    """Qwen3: q/k norms per head, head_dim 32 over hidden 64 with 4 heads (key_length in the metadata), q/k rows
    in HF order as llama.cpp writes qwen3 files; the source tensors back, and transformers' logits. (transformers'
    own GGUF reader ignores qwen3.attention.key_length and builds head_dim 128, so its Qwen3 is built from the
    source weights here.)"""
    transformers = pytest.importorskip("transformers")
    cfg = tiny_config("qwen3", tie=True, head_dim=32)
    sd = random_state(cfg, seed=3)
    write_gguf(tmp_path / "q3.gguf", cfg, sd)
    ckpt = load_gguf(tmp_path / "q3.gguf", progress=False)
    assert ckpt.config == cfg
    for name, t in sd.items():
        assert torch.equal(ckpt.state_dict[name], t), name
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg.to_hf())).eval()
    hf.load_state_dict(sd, strict=False)
    hf.tie_weights()
    from specair.models.llama import build_model

    model = build_model(ckpt.config, ckpt.state_dict)
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
        ours = model(ids, torch.arange(12)[None], torch.zeros(1, dtype=torch.long), *model.empty_cache(1, 16)).logits
    assert (ours - ref).abs().max().item() <= 1e-4


def test_gguf_llama3_rope_freqs(tmp_path):
    cfg = tiny_config()
    sd = random_state(cfg)
    # what llama.cpp's converter stores for rope_scaling {llama3, factor 8, low 1, high 4, original 8192}
    freqs = 1.0 / 500000.0 ** (np.arange(0, cfg.head_dim, 2) / cfg.head_dim)
    factors = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        smooth = (8192 / wavelen - 1) / (4 - 1)
        factors.append(1.0 if wavelen < 8192 / 4 else 8.0 if wavelen > 8192 else 1 / ((1 - smooth) / 8 + smooth))
    write_gguf(tmp_path / "l3.gguf", cfg, sd)
    # rewrite with the extra tensor and theta (GGUFWriter cannot append)
    w = gguf.GGUFWriter(str(tmp_path / "l3b.gguf"), arch="llama")
    reader = gguf.GGUFReader(str(tmp_path / "l3.gguf"))
    for key, field in reader.fields.items():
        if key.startswith("llama.") and key != "llama.rope.freq_base":
            w.add_key_value(key, field.contents(), field.types[0])
    w.add_rope_freq_base(500000.0)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data))
    w.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    got = load_gguf(tmp_path / "l3b.gguf", progress=False).config
    assert got.rope_theta == 500000.0
    assert got.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}


def test_gguf_unsupported_quant_type(tmp_path):
    cfg = tiny_config()
    w = gguf.GGUFWriter(str(tmp_path / "k.gguf"), arch="llama")
    for key, value in dict(block_count=1, context_length=64, embedding_length=256, feed_forward_length=256,
                           head_count=4, head_count_kv=4, vocab_size=cfg.vocab_size).items():
        getattr(w, f"add_{key}")(value)
    w.add_layer_norm_rms_eps(1e-5)
    # Q8_K is llama.cpp's intermediate type: a valid GGUF type that nothing can dequantize
    w.add_tensor("blk.0.attn_q.weight", np.zeros((256, 292), dtype=np.uint8), raw_dtype=Q.Q8_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFormatError, match=r"blk\.0\.attn_q\.weight has GGML type Q8_K"):
        load_checkpoint(tmp_path / "k.gguf", progress=False)


def test_gguf_corrupt_and_unsupported(tmp_path):
    cfg = tiny_config()
    write_gguf(tmp_path / "m.gguf", cfg, random_state(cfg), Q.Q8_0)
    data = (tmp_path / "m.gguf").read_bytes()
    for cut in (len(data) - 100, len(data) // 2, 40):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(ModelFormatError, match="corrupt or truncated GGUF"):
            load_checkpoint(tmp_path / "cut.gguf", progress=False)
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + bytes(range(256)) * 8)
    with pytest.raises(ModelFormatError, match="corrupt or truncated GGUF"):
        load_checkpoint(tmp_path / "junk.gguf", progress=False)
    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), arch="gpt2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFormatError, match="architecture 'gpt2' is not supported"):
        load_checkpoint(tmp_path / "gpt2.gguf", progress=False)


def test_convert_gguf_to_hf_dir(tmp_path):
    cfg = tiny_config()
    sd = random_state(cfg)
    write_gguf(tmp_path / "m.gguf", cfg, sd, Q.Q8_0)
    out = convert_gguf_to_hf_dir(tmp_path / "m.gguf", tmp_path / "hf", torch.float16, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "m.gguf"]  # no temporary dir left behind
    a, b = load_checkpoint(out), load_gguf(tmp_path / "m.gguf", torch.float16, progress=False)
    assert a.config == b.config and a.tokenizer is None
    for name in sd:
        assert torch.equal(a.state_dict[name], b.state_dict[name]), name
    assert a.fingerprint != b.fingerprint and len(a.fingerprint) == 64


# ---- llama2.c ----

def write_llama2c(path, cfg: ModelConfig, sd: dict[str, torch.Tensor], version: int = 0) -> None:
    L, dim, hd = cfg.num_layers, cfg.hidden_size, cfg.head_dim
    shared = cfg.tie_word_embeddings

    def stack(key: str, permute_heads: int | None = None) -> np.ndarray:
        ws = [sd[f"model.layers.{i}.{key}.weight"].numpy() for i in range(L)]
        return np.stack([to_interleaved(w, permute_heads) if permute_heads else w for w in ws])

    wq, wk = stack("self_attn.q_proj", cfg.num_heads), stack("self_attn.k_proj", cfg.num_kv_heads)
    wv, wo = stack("self_attn.v_proj"), stack("self_attn.o_proj")
    w1, w2, w3 = stack("mlp.gate_proj"), stack("mlp.down_proj"), stack("mlp.up_proj")
    rms_att, rms_ffn = stack("input_layernorm"), stack("post_attention_layernorm")
    emb, norm = sd["model.embed_tokens.weight"].numpy(), sd["model.norm.weight"].numpy()
    params = [dim, cfg.intermediate_size, L, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size,
              cfg.max_position_embeddings]
    if version == 0:
        params[5] = cfg.vocab_size if shared else -cfg.vocab_size
        header = struct.pack("<7i", *params)
        angles = np.outer(np.arange(cfg.max_position_embeddings), 1.0 / 10000.0 ** (np.arange(0, hd, 2) / hd))
        arrays = [emb, rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3, norm, np.cos(angles), np.sin(angles)]
    else:
        header = struct.pack("<Ii7iB", 0x616B3432, 1, *params, int(shared))
        header += b"\0" * (256 - len(header))
        arrays = [rms_att, rms_ffn, norm, emb, wq, wk, wv, wo, w1, w2, w3]
    if not shared:
        arrays.append(sd["lm_head.weight"].numpy())
    with open(path, "wb") as f:
        f.write(header)
        for a in arrays:
            f.write(np.ascontiguousarray(a, dtype="<f4").tobytes())


@pytest.mark.parametrize("version", [0, 1])
@pytest.mark.parametrize("shared", [True, False])
def test_llama2c_round_trip(tmp_path, version, shared):
    cfg = tiny_config(tie=shared)
    sd = random_state(cfg, seed=3)
    write_llama2c(tmp_path / "m.bin", cfg, sd, version)
    ckpt = load_checkpoint(tmp_path / "m.bin")
    assert ckpt.config == cfg and ckpt.tokenizer is None and len(ckpt.fingerprint) == 64
    assert ckpt.state_dict.keys() == sd.keys()
    for name, t in sd.items():
        assert torch.equal(ckpt.state_dict[name], t), name


def test_llama2c_rope_layout_is_hf(tmp_path):
    """Attention scores of llama2.c's interleaved RoPE on the file's raw weights equal those of HF's rotate-half
    RoPE on the loaded weights: checks the q/k reordering without trusting any permutation formula."""
    cfg = tiny_config()
    sd = random_state(cfg, seed=4)
    write_llama2c(tmp_path / "m.bin", cfg, sd)
    loaded = load_checkpoint(tmp_path / "m.bin").state_dict
    raw = np.fromfile(tmp_path / "m.bin", dtype="<f4", offset=28)
    dim, hd, T = cfg.hidden_size, cfg.head_dim, 5
    V, L = cfg.vocab_size, cfg.num_layers
    off = V * dim + L * dim
    wq_raw = torch.from_numpy(raw[off:off + dim * dim].reshape(dim, dim).copy())  # layer 0 wq as llama2.c stores it
    x = torch.randn(T, dim, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(T, dtype=torch.float32)[:, None]
    inv = 1.0 / 10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = pos * inv  # [T, hd/2]

    def interleaved(q):  # llama2.c / Meta: rotate pairs (q[2i], q[2i+1])
        q = q.view(T, -1, hd // 2, 2)
        c, s = torch.cos(ang)[:, None], torch.sin(ang)[:, None]
        return torch.stack([q[..., 0] * c - q[..., 1] * s, q[..., 0] * s + q[..., 1] * c], -1).reshape(T, -1, hd)

    def rotate_half(q):  # HF: rotate (q[i], q[i + hd/2])
        q = q.view(T, -1, hd)
        c, s = torch.cos(torch.cat([ang, ang], -1))[:, None], torch.sin(torch.cat([ang, ang], -1))[:, None]
        return q * c + torch.cat([-q[..., hd // 2:], q[..., : hd // 2]], -1) * s

    def scores(q):  # per-head q·q over positions
        return torch.einsum("thd,shd->hts", q, q)

    a = scores(interleaved(x @ wq_raw.T))
    b = scores(rotate_half(x @ loaded["model.layers.0.self_attn.q_proj.weight"].T))
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_llama2c_bad_files(tmp_path):
    cfg = tiny_config()
    write_llama2c(tmp_path / "m.bin", cfg, random_state(cfg))
    data = (tmp_path / "m.bin").read_bytes()
    (tmp_path / "short.bin").write_bytes(data[:-4])
    with pytest.raises(ModelFormatError, match="truncated"):
        load_checkpoint(tmp_path / "short.bin")
    (tmp_path / "long.bin").write_bytes(data + b"\0" * 8)
    with pytest.raises(ModelFormatError, match="longer than its header implies"):
        load_checkpoint(tmp_path / "long.bin")
    (tmp_path / "text.bin").write_bytes(b"hello, this is not a model at all" * 3)
    with pytest.raises(ModelFormatError, match="not a llama2.c checkpoint"):
        load_checkpoint(tmp_path / "text.bin")
    (tmp_path / "tiny.bin").write_bytes(b"\1\2\3")
    with pytest.raises(ModelFormatError, match="too short"):
        load_checkpoint(tmp_path / "tiny.bin")
    (tmp_path / "v2.bin").write_bytes(struct.pack("<Ii7iB", 0x616B3432, 2, *[8] * 7, 1) + b"\0" * 219)
    with pytest.raises(ModelFormatError, match="version 2 is not supported"):
        load_checkpoint(tmp_path / "v2.bin")
    (tmp_path / "model.pt").write_bytes(b"\x80\x04\x95" + b"\0" * 64)
    with pytest.raises(ModelFormatError, match="pickle"):
        load_checkpoint(tmp_path / "model.pt")


# ---- HF directories ----

def test_hf_dir_round_trip_and_shards(tmp_path):
    cfg = tiny_config("qwen2", tie=True, bias=True)
    sd = random_state(cfg, seed=5)
    d = write_hf_dir(tmp_path / "one", cfg, {**sd, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})
    ckpt = load_checkpoint(d, dtype=torch.float16)
    assert ckpt.config == cfg and ckpt.state_dict.keys() == sd.keys()
    assert all(torch.equal(ckpt.state_dict[k], v.half()) for k, v in sd.items())

    shards = tmp_path / "sharded"
    shards.mkdir()
    (shards / "config.json").write_text(json.dumps(cfg.to_hf()))
    names = sorted(sd)
    parts = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
             "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for fname, keys in parts.items():
        save_file({k: sd[k] for k in keys}, str(shards / fname))
    index = {"metadata": {}, "weight_map": {k: f for f, keys in parts.items() for k in keys}}
    (shards / "model.safetensors.index.json").write_text(json.dumps(index))
    sharded = load_hf_dir(shards)
    assert all(torch.equal(sharded.state_dict[k], v) for k, v in sd.items())
    assert sharded.fingerprint != ckpt.fingerprint


def test_hf_dir_errors(tmp_path):
    cfg = tiny_config()
    sd = random_state(cfg)
    with pytest.raises(ModelFormatError, match="no such file or directory"):
        load_checkpoint(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFormatError, match="no config.json"):
        load_checkpoint(tmp_path / "empty")

    d = write_hf_dir(tmp_path / "gpt2", cfg, sd)
    (d / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ModelFormatError, match="unsupported architecture"):
        load_checkpoint(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelFormatError, match="not valid JSON"):
        load_checkpoint(d)

    d = write_hf_dir(tmp_path / "pickle", cfg, sd)
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"PK\3\4")
    with pytest.raises(ModelFormatError, match="refuses pickles"):
        load_checkpoint(d)
    (d / "pytorch_model.bin").unlink()
    with pytest.raises(ModelFormatError, match="no model.safetensors"):
        load_checkpoint(d)

    d = write_hf_dir(tmp_path / "cut", cfg, sd)
    data = (d / "model.safetensors").read_bytes()
    for cut in (len(data) - 16, 100, 4):
        (d / "model.safetensors").write_bytes(data[:cut])
        with pytest.raises(ModelFormatError, match="corrupt or truncated safetensors"):
            load_checkpoint(d)

    d = write_hf_dir(tmp_path / "missing-tensor", cfg, {k: v for k, v in sd.items() if "layers.1.mlp.up" not in k})
    with pytest.raises(ModelFormatError, match=r"missing tensors model\.layers\.1\.mlp\.up_proj\.weight"):
        load_checkpoint(d)

    bad = dict(sd)
    bad["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    d = write_hf_dir(tmp_path / "bad-shape", cfg, bad)
    with pytest.raises(ModelFormatError, match=r"k_proj\.weight has shape \(64, 64\), config\.json implies \(32, 64\)"):
        load_checkpoint(d)

    d = write_hf_dir(tmp_path / "shard-missing", cfg, sd)
    index = {"weight_map": {"x": "model-00001-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelFormatError, match="model-00001-of-00002.safetensors, which is missing"):
        load_checkpoint(d)
    with pytest.raises(ModelFormatError, match="pass the directory"):
        load_checkpoint(tmp_path / "cut" / "model.safetensors")


def test_a_checkpoint_too_large_for_memory_is_one_line_before_anything_is_built(tmp_path, monkeypatch):
    from specair.models import checkpoint
    from specair.runtime.build import open_engine

    cfg = tiny_config()
    write_gguf(tmp_path / "m.gguf", cfg, random_state(cfg), Q.Q8_0)
    monkeypatch.setenv("SPECAIR_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(checkpoint, "available_memory", lambda: 10_000)
    with pytest.raises(ModelFormatError, match=r"m\.gguf: 0\.00B parameters need about .* GiB of memory .* has "
                                               r"0\.0 GiB available") as e:
        open_engine(str(tmp_path / "m.gguf"), backend="auto")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "cache" / "artifacts").exists()
