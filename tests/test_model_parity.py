"""specair's model and engine against HF transformers on random checkpoints loaded from save_pretrained dirs."""

import pytest
import torch
from helpers import VARIANTS, save_tiny

from specair.models.checkpoint import load_checkpoint
from specair.models.llama import build_model
from specair.runtime.build import engine_from_models
from specair.runtime.llm import LLM
from specair.runtime.params import SamplingParams


def load(path, dtype=torch.float32):
    ckpt = load_checkpoint(path, dtype=dtype, progress=False)
    return build_model(ckpt.config, ckpt.state_dict, dtype)


@pytest.mark.parametrize("kind", sorted(VARIANTS))
def test_logits_match_transformers(kind, tmp_path):
    hf = save_tiny(kind, tmp_path)
    model = load(tmp_path)
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    k, v = model.empty_cache(2, 64)
    out = model(ids, torch.arange(48).expand(2, -1), torch.zeros(2, dtype=torch.long), k, v)
    assert (out.logits - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("kind", sorted(VARIANTS))
def test_greedy_matches_generate(kind, tmp_path):
    hf = save_tiny(kind, tmp_path)
    llm = LLM.from_engine(engine_from_models(load(tmp_path), prefill_chunk=16))
    prompt = torch.randint(0, 256, (1, 37), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf.generate(prompt, max_new_tokens=64, do_sample=False, eos_token_id=None, pad_token_id=0)
    res = llm.generate(prompt[0].tolist(), SamplingParams(max_tokens=64, ignore_eos=True))[0]
    assert res.token_ids == ref[0, 37:].tolist()
    assert res.finish_reason == "length"


def test_sliding_window_is_applied(tmp_path):
    """A window shorter than the context changes the logits (so the parity test above exercises it)."""
    save_tiny("mistral", tmp_path / "w", sliding_window=8)
    save_tiny("mistral", tmp_path / "full", sliding_window=None)
    ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(3))
    outs = []
    for name in ("w", "full"):
        m = load(tmp_path / name)
        k, v = m.empty_cache(1, 64)
        outs.append(m(ids, torch.arange(32)[None], torch.zeros(1, dtype=torch.long), k, v).logits)
    assert (outs[0][:, :8] - outs[1][:, :8]).abs().max() < 1e-5
    assert (outs[0][:, 8:] - outs[1][:, 8:]).abs().max() > 1e-3


def test_feature_view_equals_transformers_hidden_states(tmp_path):
    """with_features: each listed layer's input is transformers' hidden_states[layer] (EAGLE-3's features)."""
    from specair.models.llama import with_features

    save_tiny("llama", tmp_path, num_hidden_layers=4)
    hf = __import__("transformers").LlamaForCausalLM.from_pretrained(tmp_path).eval()
    model = load(tmp_path)
    view = with_features(model, (0, 2, 3))
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        out = view(ids, torch.arange(20).expand(2, -1), torch.zeros(2, dtype=torch.long), *view.empty_cache(2, 1))
    assert out.hidden.shape == (2, 20, 3 * 64) and view.feature_size == 3 * 64
    want = torch.cat([ref.hidden_states[i] for i in (0, 2, 3)], dim=-1)
    assert (out.hidden - want).abs().max().item() <= 1e-4
    assert (out.logits - ref.logits).abs().max().item() <= 1e-4  # logits unchanged
    assert view.layers is model.layers and with_features(view, (0, 2, 3)) is view


@pytest.mark.parametrize("kind", ["qwen3", "llama3-tied-bias", "qwen2"])
def test_defaults_give_transformers_greedy_output(kind, tmp_path, monkeypatch):
    """What a user runs with no flags but the model (`LLM(dir)`: `--backend auto`, a toy model's float32 onnx
    graphs on specair's kernels, n-gram speculation where that cannot change the output) generates
    transformers' greedy tokens."""
    monkeypatch.setenv("SPECAIR_CACHE", str(tmp_path / "cache"))
    hf = save_tiny(kind, tmp_path / "m", max_position_embeddings=256)
    llm = LLM(str(tmp_path / "m"), max_context=128, batch_buckets=(1,))
    prompt = torch.randint(0, 256, (1, 29), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf.generate(prompt, max_new_tokens=48, do_sample=False, eos_token_id=None, pad_token_id=0)
    res = llm.generate(prompt[0].tolist(), SamplingParams(max_tokens=48, ignore_eos=True))[0]
    assert res.token_ids == ref[0, 29:].tolist()
