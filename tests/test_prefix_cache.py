"""Prefix caching: where graphs are row-independent (onnxruntime over exact int4), a prompt that starts as an
earlier one loads those blocks' KV instead of prefilling them, and gets bit for bit the caches, the tokens
and the sampled tokens it gets with no cache; blocks are found only after the tokens they followed, and the
cache stays within its byte budget, evicting least recently used leaves first."""

import pytest
import torch
from helpers import save_tiny

from specair.runtime.build import open_engine
from specair.runtime.llm import LLM
from specair.runtime.params import SamplingParams
from specair.runtime.prefix_cache import PrefixCache

BASE = list(range(5, 45))  # 40 tokens: two full blocks of 16 and 8 more
PROMPTS = [BASE + [50, 51, 52], BASE, BASE + list(range(60, 100)), BASE[:33], BASE[:17] + [7] * 30,
           BASE[:32], BASE + [50, 51, 52]]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_tiny("llama", path, max_position_embeddings=256)
    kw = dict(backend="onnx", quantize="int4", max_context=256, spec_json="none", batch_buckets=(1, 2, 4))
    cached, plain = open_engine(str(path), **kw), open_engine(str(path), **kw)
    plain.prefix_cache = None
    eager = open_engine(str(path), backend="eager", max_context=256, spec_json="none")
    return cached, plain, eager


def prefilled_kv(engine, prompt):
    """The target's K/V of the prompt's slots once it joined the batch, and the first token."""
    engine.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True), "kv")
    first = []
    while not engine.rows:
        first += [t for ev in engine.step() for t in ev.token_ids]
    k, v = engine.kv.caches["target"]
    out = k[:, 0, :, :len(prompt)].clone(), v[:, 0, :, :len(prompt)].clone(), first
    while engine.has_unfinished():
        engine.step()
    return out


def test_a_cached_prefix_gives_the_caches_prefilling_gives(engines):
    cached, plain, _ = engines
    cached.prefix_cache.clear()
    prefilled_kv(cached, BASE + [99])  # fills the cache with BASE's two blocks
    for prompt in (BASE, BASE + [7, 8, 9], BASE[:33]):
        k, v, first = prefilled_kv(cached, prompt)
        k0, v0, first0 = prefilled_kv(plain, prompt)
        assert torch.equal(k, k0) and torch.equal(v, v0) and first == first0


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "top_p": 0.8, "seed": 3}], ids=["greedy", "seeded"])
def test_prefix_caching_changes_no_token(engines, sampling):
    cached, plain, _ = engines
    cached.prefix_cache.clear()
    params = SamplingParams(max_tokens=20, ignore_eos=True, **sampling)
    for _ in range(2):  # the second round finds every prompt's blocks
        got = LLM.from_engine(cached).generate(PROMPTS, params)
        want = LLM.from_engine(plain).generate(PROMPTS, params)
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
    # Whole blocks only, and never the last prompt token (its logits pick the first token).
    assert [r.num_cached_tokens for r in got] == [32, 32, 64, 32, 32, 16, 32]
    assert all(r.num_cached_tokens == 0 for r in want)


def test_a_block_is_found_only_after_the_tokens_it_followed(engines):
    cached, _, _ = engines
    cached.prefix_cache.clear()
    llm, params = LLM.from_engine(cached), SamplingParams(max_tokens=1)
    llm.generate([BASE + [1]], params)
    (r,) = llm.generate([[9] * 16 + BASE[16:] + [1]], params)  # BASE's second block, after another first one
    assert r.num_cached_tokens == 0
    (r,) = llm.generate([BASE[:16] + [9] * 24], params)
    assert r.num_cached_tokens == 16


def test_the_cache_keeps_to_its_budget_and_evicts_leaves_first(engines):
    cached, _, _ = engines
    pc = cached.prefix_cache
    pc.clear()
    llm, params = LLM.from_engine(cached), SamplingParams(max_tokens=1)
    llm.generate([BASE + [1]], params)
    block_bytes = pc.bytes // 2
    pc.budget = 3 * block_bytes
    llm.generate([[8] * 33], params)  # two more blocks: one over the budget, so BASE's second block goes
    assert len(pc) == 3 and pc.bytes == 3 * block_bytes
    (r,) = llm.generate([BASE + [1]], params)
    assert r.num_cached_tokens == 16
    pc.budget = 0
    llm.generate([[3] * 20], params)
    assert len(pc) == 0 and pc.bytes == 0
    pc.budget = PrefixCache(16).budget


def test_prefix_caching_is_on_only_where_it_is_exact(engines, tmp_path):
    cached, _, eager = engines
    assert cached.prefix_cache is not None and cached.prefix_cache.block == 16
    assert eager.prefix_cache is None  # eager's float GEMMs round a row by the chunk that holds it
    llm = LLM.from_engine(eager)
    (r,) = llm.generate([BASE + [1]], SamplingParams(max_tokens=1))
    (r,) = llm.generate([BASE + [1]], SamplingParams(max_tokens=1))
    assert r.num_cached_tokens == 0
