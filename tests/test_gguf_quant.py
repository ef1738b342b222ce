"""GGUF files whose weights are quantized, mixed as llama.cpp mixes them (Q4_K_M: Q4_K beside Q6_K, Q5_0 and
Q8_0 where a width is not a multiple of 256), read exactly: the loader keeps each weight's rows as stored (llama's
q/k rows un-permuted), the int4 path runs them on the block kernels, one operator per format, the LM head
included; greedy speculation there equals plain decoding there; a type the kernels do not read runs dequantized
to float32 after a one-line notice; an unknown type is one clear line."""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from helpers import gguf_name, gguf_writer

from specair.compile import kernels
from specair.compile.kernels import formats
from specair.models.checkpoint import describe, expected_shapes, load_checkpoint
from specair.models.config import ModelConfig
from specair.models.errors import ModelFormatError
from specair.models.gguf_loader import load_stored, open_gguf, stored_weights
from specair.models.llama import GGUF_PARTS, build_model, truncated

onnx = pytest.importorskip("onnx")
if not kernels.enabled():
    pytest.skip("specair's kernel library does not build here", allow_module_level=True)

# every format, and fused q/k/v and gate/up whose parts differ, as a Q4_K_M file's do
TYPES = {
    0: {"q_proj": "Q4_K", "k_proj": "Q5_K", "v_proj": "Q6_K", "o_proj": "Q8_0", "gate_proj": "Q4_0",
        "up_proj": "Q5_0", "down_proj": "Q6_K"},
    1: {"q_proj": "Q4_1", "k_proj": "Q5_1", "v_proj": "Q8_0", "o_proj": "Q4_K", "gate_proj": "Q5_K",
        "up_proj": "Q4_K", "down_proj": "Q4_1"},
}
HEAD = "Q6_K"
# typical magnitude of each format's fp16 fields, so that weights come out around 0.1
SCALE = {"Q4_0": (0.01,), "Q4_1": (0.01, 0.08), "Q5_0": (0.005,), "Q5_1": (0.005, 0.08), "Q8_0": (0.001,),
         "Q4_K": (2e-4, 2e-4), "Q5_K": (1e-4, 1e-4), "Q6_K": (5e-5,), "IQ4_NL": (0.001,)}
OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
           "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,)}


def tiny_config(arch: str = "llama") -> ModelConfig:
    return ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=64, max_position_embeddings=128, rope_theta=10000.0,
                       tie_word_embeddings=True, model_type=arch, bos_token_id=1, eos_token_ids=(2,),
                       qk_norm=arch == "qwen3")


def random_rows(kind: str, N: int, K: int, rng) -> np.ndarray:
    """N rows of K weights of type `kind` as a file stores them: random codes and integer scales, and fp16
    fields of the format's usual size (negative minima included)."""
    block, size = gguf.GGML_QUANT_SIZES[Q[kind]]
    b = rng.integers(0, 256, (N, K // block, size), dtype=np.uint8)
    for off, scale in zip(OFFSETS[kind], SCALE[kind]):
        b[..., off:off + 2] = (rng.standard_normal((N, K // block)) * scale).astype(np.float16)[..., None].view(np.uint8)
    return b.reshape(N, -1)


def to_interleaved(raw: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (interleaved RoPE pairs) from HF's, rows moved whole."""
    return raw.reshape(heads, 2, raw.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(raw.shape)


def write_quantized_gguf(path, cfg: ModelConfig, types=TYPES, head=HEAD, seed=0) -> dict[str, tuple[str, np.ndarray]]:
    """A GGUF file of `cfg` with every 2-D weight of the type `types` names (per layer, per projection), the tied
    embedding table `head`; returns each weight's (type, rows in HF order)."""
    rng = np.random.default_rng(seed)
    w = gguf_writer(path, cfg)
    written = {}
    for name, shape in expected_shapes(cfg).items():
        if len(shape) == 1:
            w.add_tensor(gguf_name(name), (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            continue
        kind = head if name == "model.embed_tokens.weight" else types[int(name.split(".")[2])][name.split(".")[-2]]
        raw = random_rows(kind, *shape, rng)
        written[name] = (kind, raw)
        if cfg.model_type == "llama" and (".q_proj." in name or ".k_proj." in name):
            raw = to_interleaved(raw, cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads)
        w.add_tensor(gguf_name(name), raw, raw_dtype=Q[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


@pytest.fixture(scope="module")
def quantized_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("quant") / "mixed.gguf"
    return path, write_quantized_gguf(path, tiny_config())


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_weights_are_kept_as_stored_and_dequantize_as_gguf_does(tmp_path, arch):
    cfg = tiny_config(arch)
    written = write_quantized_gguf(tmp_path / "m.gguf", cfg)
    ckpt = load_checkpoint(tmp_path / "m.gguf", progress=False)
    assert ckpt.config == cfg
    assert ckpt.stored.keys() == written.keys()
    for name, (kind, raw) in written.items():
        stored = ckpt.stored[name]
        assert stored.type == kind and stored.shape == ckpt.state_dict[name].shape
        assert np.array_equal(stored.raw, raw), name  # q/k rows back in HF order
        # the kernel's layout holds exactly the state dict's weights (gguf's dequantization)
        packed = formats.pack_gguf(kind, stored.raw, stored.shape[1])
        assert np.array_equal(kernels.dequantize(packed), ckpt.state_dict[name].numpy()), name
    # the tensor index read without gguf's reader (the default model's fast path) finds the same
    fast = load_stored(tmp_path / "m.gguf", cfg)
    slow = stored_weights(open_gguf(tmp_path / "m.gguf"), cfg)
    assert fast.keys() == slow.keys() == written.keys()
    assert all(np.array_equal(fast[k].raw, slow[k].raw) and fast[k].type == slow[k].type for k in fast)
    info = describe(tmp_path / "m.gguf")
    assert info.quantized_types == {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}
    assert info.num_params == sum(int(np.prod(s)) for s in expected_shapes(cfg).values())


def _model(path):
    ckpt = load_checkpoint(path, progress=False)
    return build_model(ckpt.config, ckpt.state_dict, stored=ckpt.stored)


def test_int4_path_runs_each_weight_in_its_stored_format(quantized_gguf, tmp_path):
    """Every linear layer and the tied LM head become MatMulBlocks in the file's format (a fused weight of mixed
    parts one operator per part), and the graph's logits are the float model's up to the int8 activations."""
    from specair.compile.backends.onnx import OnnxBackend
    from specair.compile.catalog import Catalog
    from specair.compile.graph_def import GraphKey
    from specair.compile.plan import Plan

    path, written = quantized_gguf
    model = _model(path)
    assert [p.type for p in getattr(model.layers[0].attention.wqkv.weight, GGUF_PARTS)] == ["Q4_K", "Q5_K", "Q6_K"]
    plan = Plan(max_context=64, batch_buckets=(1,), variants=("greedy",), prefill_chunk=16)
    graph = Catalog(model, plan).graph(GraphKey("prefill", 1, 64))
    g = torch.Generator().manual_seed(0)
    k, v = model.empty_cache(1, plan.slots)
    inputs = (torch.randint(0, 512, (1, 16), generator=g), torch.tensor([0]), torch.tensor([16]), k, v)
    ref = graph.eager(*inputs)[0]
    out = OnnxBackend(threads=2, quantize="int4").compile(graph, tmp_path)(*inputs)[0]
    proto = onnx.load(str(tmp_path / f"{graph.key}.onnx"), load_external_data=False)
    fmts = sorted(a.s.decode() for n in proto.graph.node if n.op_type == kernels.OP for a in n.attribute
                  if a.name == "format")
    want = sorted([t for layer in TYPES.values() for t in layer.values()] + [HEAD])
    assert fmts == want
    assert not [n for n in proto.graph.node if n.op_type in ("MatMul", "Gemm", "MatMulNBits")]
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 0.03  # int8 activations per block of 32


def test_greedy_speculation_on_stored_weights_equals_plain_decoding_there(quantized_gguf):
    from specair.runtime.build import engine_from_models, parse_spec
    from specair.runtime.llm import LLM
    from specair.runtime.params import SamplingParams

    model = _model(quantized_gguf[0])
    prompts = [list(range(3, 30, 2)), [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    kw = dict(max_context=64, prefill_chunk=16, variants=("greedy",), backend="onnx", quantize="int4")
    plain = [r.token_ids for r in LLM.from_engine(engine_from_models(model, **kw)).generate(prompts, params)]
    for spec, draft in ((parse_spec({"method": "ngram", "num_speculative_tokens": 4}), None),
                        (parse_spec({"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 3}),
                         truncated(model, 1))):
        res = LLM.from_engine(engine_from_models(model, None, draft, spec, **kw)).generate(prompts, params)
        assert [r.token_ids for r in res] == plain, spec
        assert any(r.extra["spec"]["mean_accepted_length"] > 1 for r in res)


def test_a_type_the_kernels_do_not_read_runs_dequantized_after_a_notice(tmp_path, caplog):
    """IQ4_NL (a codebook type): one notice, then its weights run as float32, exactly gguf's dequantization."""
    from specair.compile import quantize

    cfg = tiny_config()
    types = {i: dict(layer, down_proj="IQ4_NL") for i, layer in TYPES.items()}
    write_quantized_gguf(tmp_path / "iq.gguf", cfg, types)
    model = _model(tmp_path / "iq.gguf")
    w = model.layers[0].feed_forward.w2.weight
    quantize._NOTED.discard("IQ4_NL")
    with caplog.at_level(logging.WARNING, logger="specair"):
        parts = quantize._packed_parts(w)
        quantize._packed_parts(model.layers[1].feed_forward.w2.weight)
    assert [p.format for p in parts] == ["F32"]
    assert np.array_equal(kernels.dequantize(parts[0]), w.detach().numpy())
    notes = [r.message for r in caplog.records if "IQ4_NL" in r.message]
    assert len(notes) == 1 and "not read natively" in notes[0]


def test_unknown_and_undequantizable_types_are_one_clear_line(tmp_path):
    cfg = tiny_config()
    write_quantized_gguf(tmp_path / "m.gguf", cfg)
    data = bytearray((tmp_path / "m.gguf").read_bytes())
    # the first tensor info's type field: after its name, dims count and dims
    marker = data.index(b"token_embd.weight")
    at = marker + len(b"token_embd.weight") + 4 + 2 * 8
    data[at:at + 4] = (250).to_bytes(4, "little")
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    with pytest.raises(ModelFormatError, match="type 250") as e:
        describe(tmp_path / "bad.gguf")
    assert "\n" not in str(e.value)
    with pytest.raises(ModelFormatError, match="type 250, which neither gguf nor specair knows"):
        load_checkpoint(tmp_path / "bad.gguf", progress=False)


def test_auto_runs_the_file_as_stored_and_keeps_no_float_copy_of_it(quantized_gguf, tmp_path, monkeypatch):
    """`LLM(file)` with no other flag: the block kernels over the file's weights (the same tokens as building
    that path by hand), and once its graphs are open no float copy of a linear weight, nor of the embedding
    table (looked up in its own blocks), is left in memory."""
    from specair.runtime.build import engine_from_models
    from specair.runtime.llm import LLM
    from specair.runtime.params import SamplingParams

    monkeypatch.setenv("SPECAIR_CACHE", str(tmp_path))
    path = quantized_gguf[0]
    prompt, params = list(range(3, 30, 2)), SamplingParams(max_tokens=12, ignore_eos=True)
    by_hand = LLM.from_engine(engine_from_models(_model(path), max_context=64, variants=("greedy",), backend="onnx",
                                                 quantize="int4")).generate(prompt, params)[0].token_ids
    llm = LLM(str(path), "none", max_context=64, batch_buckets=(1,))
    assert llm.generate(prompt, params)[0].token_ids == by_hand
    target = llm.engine.target
    linears = [m.weight for m in target.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(w.stride() == (0, 0) for w in linears)
    assert target.tok_embeddings.weight.stride() == (0, 0)  # GatherBlocks reads the table's blocks
