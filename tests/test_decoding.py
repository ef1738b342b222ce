"""The static KV cache, chunked prefill, sampling, and the stop conditions of autoregressive decoding."""

import dataclasses

import pytest
import torch
import transformers
from helpers import save_tiny

from specair.graphs.sampling import logits_to_probs, sample, sample_from_probs, sampling_variant
from specair.graphs.kv import commit_kv
from specair.graphs.steps import decode_step, prefill_chunk
from specair.models.checkpoint import load_checkpoint
from specair.models.errors import InputError
from specair.models.llama import build_model
from specair.runtime.build import engine_from_models
from specair.runtime.llm import LLM
from specair.runtime.params import SamplingParams


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_tiny("llama", path)
    return load_checkpoint(path, progress=False)


@pytest.fixture(scope="module")
def tiny(tiny_ckpt):
    return {dt: build_model(tiny_ckpt.config, tiny_ckpt.state_dict, dt) for dt in (torch.float32, torch.float64)}


def llm(model, **kw):
    """The engine over a model in memory, one request at a time."""
    return LLM.from_engine(engine_from_models(model, **kw))


GREEDY = (torch.zeros(1), torch.zeros(1, dtype=torch.long), torch.ones(1), torch.zeros(1))


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
def test_kv_cache_decoding_equals_full_recomputation(tiny, dtype, tol):
    model = tiny[dtype]
    seq = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(0))
    k, v = model.empty_cache(1, 128 + 16)
    with torch.no_grad():
        full = model(seq, torch.arange(60)[None], torch.zeros(1, dtype=torch.long), k, v).logits[0]
        logits, _, nk, nv = prefill_chunk(model, seq[:, :20], torch.tensor([0]), torch.tensor([20]), k, v, ctx=64)
        commit_kv(k, v, nk, nv, torch.arange(20)[None])
        assert (logits[0] - full[19]).abs().max() <= tol
        for t in range(20, 60):
            greedy = [x.to(dtype) if x.is_floating_point() else x for x in GREEDY]
            _, logits, _, nk, nv = decode_step(model, seq[:, t], torch.tensor([t]), k, v, *greedy, ctx=64)
            commit_kv(k, v, nk, nv, torch.tensor([[t]]))
            assert (logits[0] - full[t]).abs().max() <= tol, t


def test_chunked_prefill_equals_one_shot(tiny):
    """A 100-token prompt prefilled in one chunk or in chunks of 7 (crossing context buckets) leaves the same
    K/V in the engine's prefill cache and generates the same tokens."""
    model = tiny[torch.float64]
    prompt = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    one, many = llm(model, prefill_chunk=128), llm(model, prefill_chunk=7)
    p = SamplingParams(max_tokens=20, ignore_eos=True)
    streams = [one.stream(prompt, p), many.stream(prompt, p)]
    first = [next(s).token_ids for s in streams]  # the prefill is done (the scratch is freed once idle)
    for x, y in zip(one.engine.kv.scratch["target"], many.engine.kv.scratch["target"], strict=True):
        assert (x[..., :100, :] - y[..., :100, :]).abs().max() <= 1e-10
    a, b = ([t for ev in s for t in ev.token_ids] for s in streams)
    assert first[0] + a == first[1] + b and len(first[0] + a) == 20


def test_probs_match_transformers_warpers():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 50, generator=g, dtype=torch.float64) * 3
    settings = [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.5, 10, 0.6)]
    temps, ks, ps = (torch.tensor(x) for x in zip(*settings))
    ours = logits_to_probs(logits, temps.double(), ks, ps.double())
    for row, (t, k, p) in enumerate(settings):
        x = transformers.TemperatureLogitsWarper(t)(None, logits[row:row + 1].clone())
        if k:
            x = transformers.TopKLogitsWarper(k)(None, x)
        if p < 1:
            x = transformers.TopPLogitsWarper(p)(None, x)
        assert torch.allclose(ours[row], x.softmax(-1)[0], atol=1e-12), settings[row]


def test_inverse_cdf_sampling_is_exact():
    probs = torch.tensor([[0.0, 0.5, 0.125, 0.0, 0.375]], dtype=torch.float64)
    n = 8000
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n  # a uniform grid stands in for every draw
    toks = sample_from_probs(probs.expand(n, -1), u)
    freq = torch.bincount(toks, minlength=5).double() / n
    assert torch.allclose(freq, probs[0], atol=1 / n)


def test_temperature_zero_is_argmax_and_padding_rows_are_independent():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(3))
    temps, ks, ps = torch.tensor([0.0, 1.0, 0.0]), torch.tensor([0, 3, 0]), torch.tensor([1.0, 1.0, 1.0])
    u = torch.tensor([0.3, 0.9, 0.1])
    out = sample(logits, temps, ks, ps, u)
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()
    assert out[1] in logits[1].topk(3).indices
    alone = sample(logits[1:2], temps[1:2], ks[1:2], ps[1:2], u[1:2])
    assert alone[0] == out[1]


def test_a_top_p_below_float32s_range_samples_the_top_token(tiny):
    """top_p 1e-50 is valid and rounds to 0 in the float32 sampling tensors: it keeps the top token alone, so
    sampling gives greedy's tokens (not an empty distribution's)."""
    gen = llm(tiny[torch.float32], prefill_chunk=16)
    prompt = list(range(10, 30))
    greedy = gen.generate(prompt, SamplingParams(max_tokens=20, ignore_eos=True))[0]
    tiny_p = gen.generate(prompt, SamplingParams(max_tokens=20, temperature=1.0, top_p=1e-50, seed=3,
                                                 ignore_eos=True))[0]
    assert tiny_p.token_ids == greedy.token_ids


def test_seeded_sampling_reproduces(tiny):
    gen = llm(tiny[torch.float32], prefill_chunk=16)
    prompt = list(range(10, 30))
    p = SamplingParams(max_tokens=30, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    a, b = gen.generate(prompt, p)[0], gen.generate(prompt, p)[0]
    c = gen.generate(prompt, SamplingParams(max_tokens=30, temperature=1.0, top_p=0.9, seed=8, ignore_eos=True))[0]
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_eos_and_max_tokens(tiny, tiny_ckpt):
    prompt = list(range(5, 25))
    free = llm(tiny[torch.float32], prefill_chunk=16).generate(prompt, SamplingParams(max_tokens=12,
                                                                                         ignore_eos=True))[0]
    assert free.num_generated_tokens == 12 and free.finish_reason == "length"
    # The same weights with the fifth generated token as the model's EOS: generation stops at its first use.
    eos = free.token_ids[4]
    cfg = dataclasses.replace(tiny_ckpt.config, eos_token_ids=(eos,))
    gen = llm(build_model(cfg, tiny_ckpt.state_dict, torch.float32), prefill_chunk=16)
    stopped = gen.generate(prompt, SamplingParams(max_tokens=12))[0]
    first = free.token_ids.index(eos)
    assert stopped.token_ids == free.token_ids[:first + 1] and stopped.finish_reason == "stop"
    ignored = gen.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert ignored.token_ids == free.token_ids and ignored.finish_reason == "length"


# Temperatures past float16's range (found by the soak's fuzzing: 3.86e307 failed the batch's step) or so
# small that logits / temperature overflows are refused, as are NaN and infinity.
@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1), dict(temperature=3.86e307),
                                 dict(temperature=1e-300), dict(temperature=float("nan")),
                                 dict(temperature=float("inf")), dict(top_p=0), dict(top_k=-2), dict(stop=("",))])
def test_bad_sampling_params(bad):
    with pytest.raises(InputError):
        SamplingParams(**bad)


def test_sampling_variants_agree_where_they_apply():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    temps, ks, ps = torch.tensor([0.7, 1.0, 1.5], dtype=torch.float64), torch.zeros(3, dtype=torch.long), \
        torch.ones(3, dtype=torch.float64)
    assert torch.allclose(logits_to_probs(logits, temps, ks, ps), logits_to_probs(logits, temps, ks, ps, filtered=False),
                          atol=1e-12)
    u = torch.rand(3, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    assert torch.equal(sample(logits, temps, ks, ps, u, "plain"), sample(logits, temps, ks, ps, u, "filtered"))
    zero = torch.zeros(3, dtype=torch.float64)
    assert torch.equal(sample(logits, zero, ks, ps, u, "greedy"), logits.argmax(-1))
    assert sampling_variant([0.0], [0], [1.0]) == "greedy"
    assert sampling_variant([0.0, 0.5], [0, 0], [1.0, 1.0]) == "plain"
    assert sampling_variant([0.5], [0], [0.9]) == "filtered"
