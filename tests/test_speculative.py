"""Speculative decoding through the engine, one request at a time: lossless greedy against autoregressive
decoding for every tree shape and scorer, the acceptance statistics, seeded sampling, the context edge and
refused configurations. (tests/test_engine.py covers the same under continuous batching.)"""

import pytest
import torch
from helpers import save_tiny

from specair.models.checkpoint import load_checkpoint
from specair.models.errors import InputError
from specair.models.llama import build_model, truncated
from specair.runtime.build import engine_from_models, parse_spec
from specair.runtime.llm import LLM
from specair.runtime.params import SamplingParams

TREES = [  # (tree, num_speculative_tokens)
    (None, 4),
    ("kary:3x2", 3),
    ([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]], 3),
    ("mc_sim_7b_63", 4),
    ("topk:3x10", 4),
]


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory):
    """A float64 random target and a float64 random draft over the same vocabulary, with their dirs."""
    models, dirs = [], []
    for seed in (0, 1):
        path = tmp_path_factory.mktemp(f"m{seed}")
        save_tiny("llama", path, seed=seed, num_hidden_layers=2 if seed == 0 else 1)
        ckpt = load_checkpoint(path, progress=False)
        models.append(build_model(ckpt.config, ckpt.state_dict, torch.float64))
        dirs.append(path)
    return models, dirs


def spec_llm(target, draft, max_context=None, **cfg):
    spec = {"method": "draft_model", "model": "-", **cfg}
    return LLM.from_engine(engine_from_models(target, None, draft, spec, max_context=max_context, prefill_chunk=16))


def autoregressive(target, prompt, params, max_context=None):
    engine = engine_from_models(target, max_context=max_context, prefill_chunk=16)
    return LLM.from_engine(engine).generate(prompt, params)[0]


PROMPT = list(range(3, 40, 2))
GREEDY = SamplingParams(max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny64):
    """Autoregressive greedy tokens for PROMPT."""
    return autoregressive(tiny64[0][0], PROMPT, GREEDY).token_ids


@pytest.mark.parametrize("tree,k", TREES)
@pytest.mark.parametrize("scorer", ["tree", "batch_expansion"])
def test_lossless_greedy_float64(tiny64, reference, tree, k, scorer):
    if scorer == "batch_expansion" and isinstance(tree, str) and tree.startswith("topk"):
        pytest.skip("batch expansion needs a static tree")
    target, draft = tiny64[0]
    res = spec_llm(target, draft, num_speculative_tokens=k, tree=tree, scorer=scorer).generate(PROMPT, GREEDY)[0]
    assert res.token_ids == reference
    spec = res.extra["spec"]
    assert spec["num_drafts"] >= 48 // (k + 1)
    assert spec["num_draft_tokens"] == spec["num_drafts"] * k
    assert len(spec["accepted_per_position"]) == k
    assert sum(spec["accepted_per_position"]) == spec["num_accepted_tokens"]
    assert spec["mean_accepted_length"] == pytest.approx((spec["num_accepted_tokens"] + spec["num_drafts"])
                                                         / spec["num_drafts"])


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "top_p": 0.95, "seed": 3}], ids=["greedy", "seeded"])
def test_target_as_its_own_draft_accepts_everything(tiny64, sampling):
    """A draft identical to the target is always right: every step yields k + 1 tokens, and the stream says
    so step by step. Sampling too: the draft samples each position with the uniform the target uses."""
    target = tiny64[0][0]
    events = list(spec_llm(target, target, num_speculative_tokens=4).stream(
        PROMPT, SamplingParams(max_tokens=40, ignore_eos=True, **sampling)))
    spec = events[-1].result.extra["spec"]
    assert spec["num_accepted_tokens"] == spec["num_draft_tokens"]
    assert spec["mean_accepted_length"] == 5.0
    steps = [e for e in events if e.draft is not None]
    assert len(steps) == spec["num_drafts"] and all(e.draft == (4, 4) for e in steps)


@pytest.mark.parametrize("acceptance", ["exact", "typical"])
def test_sampling_runs_and_is_seeded(tiny64, acceptance):
    """Seeded sampling reproduces; with exact acceptance it is plain decoding's sample, token for token."""
    target, draft = tiny64[0]
    llm = spec_llm(target, draft, num_speculative_tokens=3, tree="kary:3x2", acceptance=acceptance)
    p = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.95, top_k=50, seed=5, ignore_eos=True)
    a, b = llm.generate(PROMPT, p)[0], llm.generate(PROMPT, p)[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) == 30
    assert a.extra["spec"]["num_drafts"] > 0
    if acceptance == "exact":
        assert a.token_ids == autoregressive(target, PROMPT, p).token_ids


def test_near_end_of_context_falls_back_to_plain_steps(tiny64):
    target, draft = tiny64[0]
    prompt = list(range(50))
    ref = autoregressive(target, prompt, GREEDY, max_context=64)
    res = spec_llm(target, draft, max_context=64, num_speculative_tokens=4).generate(prompt, GREEDY)[0]
    assert res.token_ids == ref.token_ids and len(res.token_ids) == 14
    assert res.finish_reason == "length"
    # Speculation stops once the lookahead no longer fits in the context; plain steps finish the request.
    assert 0 < res.extra["spec"]["num_drafts"] < 14


@pytest.mark.parametrize("bad,match", [
    ('{"method": "nope", "num_speculative_tokens": 3}', "method"),
    ('{"method": "medusa", "num_speculative_tokens": 3, "tree": "topk:2x4"}', "static tree"),
    ('{"method": "layer_skip", "num_speculative_tokens": 3}', "num_layers"),
    ('{"method": "layer_skip", "num_layers": 2, "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "layer_skip", "num_layers": 2, "num_speculative_tokens": 3, "colour": 1}', "unknown"),
    ('{"method": "layer_skip", "num_layers": 2, "num_speculative_tokens": 3, "acceptance": "x"}', "acceptance"),
    ("{not json", "JSON"),
])
def test_bad_speculative_config(bad, match):
    with pytest.raises(InputError, match=match):
        parse_spec(bad)


def test_tree_depth_must_match_lookahead(tiny64):
    target, draft = tiny64[0]
    with pytest.raises(InputError, match="depth 4"):
        spec_llm(target, draft, num_speculative_tokens=3, tree="mc_sim_7b_63")


def test_vocabulary_mismatch_is_refused(tiny64, tmp_path):
    save_tiny("llama", tmp_path, vocab_size=300)
    target_dir = tiny64[1][0]
    with pytest.raises(InputError, match="vocabulary"):
        LLM(str(target_dir), {"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 2},
            dtype="fp64")


def test_layer_skip_draft_shares_weights(tiny64):
    target = tiny64[0][0]
    draft = truncated(target, 1)
    assert draft.config.num_layers == 1
    assert draft.layers[0].attention.wqkv.weight.data_ptr() == target.layers[0].attention.wqkv.weight.data_ptr()
