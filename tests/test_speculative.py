"""The eager speculative loop built from the graphs: lossless greedy against autoregressive decoding."""

import pytest
import torch
from helpers import save_tiny

from specair.models.checkpoint import load_checkpoint
from specair.models.errors import InputError
from specair.models.llama import build_model, truncated
from specair.runtime.params import SamplingParams
from specair.runtime.reference import ReferenceDecoder
from specair.compile.spec_config import SpeculativeConfig
from specair.runtime.speculative import SpeculativeDecoder

TREES = [  # (tree, num_speculative_tokens)
    (None, 4),
    ("kary:3x2", 3),
    ([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]], 3),
    ("mc_sim_7b_63", 4),
    ("topk:3x10", 4),
]


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory):
    """A float64 random target and a float64 random draft over the same vocabulary."""
    models = []
    for seed in (0, 1):
        path = tmp_path_factory.mktemp(f"m{seed}")
        save_tiny("llama", path, seed=seed, num_hidden_layers=2 if seed == 0 else 1)
        ckpt = load_checkpoint(path, progress=False)
        models.append(build_model(ckpt.config, ckpt.state_dict, torch.float64))
    return models


def spec_decoder(target, draft, **cfg):
    return SpeculativeDecoder(target, draft, SpeculativeConfig.parse({"method": "draft_model", "model": "-", **cfg}),
                              prefill_chunk_size=16)


PROMPT = list(range(3, 40, 2))
GREEDY = SamplingParams(max_tokens=48, ignore_eos=True)


@pytest.mark.parametrize("tree,k", TREES)
@pytest.mark.parametrize("scorer", ["tree", "batch_expansion"])
def test_lossless_greedy_float64(tiny64, tree, k, scorer):
    if scorer == "batch_expansion" and isinstance(tree, str) and tree.startswith("topk"):
        pytest.skip("batch expansion needs a static tree")
    target, draft = tiny64
    ref = ReferenceDecoder(target, prefill_chunk_size=16).generate(PROMPT, GREEDY)
    dec = spec_decoder(target, draft, num_speculative_tokens=k, tree=tree, scorer=scorer)
    res = dec.generate(PROMPT, GREEDY)
    assert res.token_ids == ref.token_ids
    spec = res.extra["spec"]
    assert spec["num_drafts"] >= 48 // (k + 1)
    assert spec["num_draft_tokens"] == spec["num_drafts"] * k
    assert sum(spec["accepted_per_position"]) == spec["num_accepted_tokens"]
    assert spec["mean_accepted_length"] == pytest.approx((spec["num_accepted_tokens"] + spec["num_drafts"])
                                                         / spec["num_drafts"])


def test_target_as_its_own_draft_accepts_everything(tiny64):
    """A draft identical to the target is always right: every step yields k + 1 tokens."""
    target, _ = tiny64
    dec = spec_decoder(target, target, num_speculative_tokens=4)
    res = dec.generate(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True))
    spec = res.extra["spec"]
    assert spec["num_accepted_tokens"] == spec["num_draft_tokens"]
    assert spec["mean_accepted_length"] == 5.0


@pytest.mark.parametrize("acceptance", ["rejection", "typical"])
def test_sampling_runs_and_is_seeded(tiny64, acceptance):
    target, draft = tiny64
    dec = spec_decoder(target, draft, num_speculative_tokens=3, tree="kary:3x2", acceptance=acceptance)
    p = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.95, top_k=50, seed=5, ignore_eos=True)
    a, b = dec.generate(PROMPT, p), dec.generate(PROMPT, p)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 30


def test_near_end_of_context_falls_back_to_plain_steps(tiny64):
    target, draft = tiny64
    ref = ReferenceDecoder(target, max_context=64, prefill_chunk_size=16).generate(list(range(50)), GREEDY)
    dec = SpeculativeDecoder(target, draft, SpeculativeConfig.parse(
        {"method": "draft_model", "model": "-", "num_speculative_tokens": 4}), max_context=64, prefill_chunk_size=16)
    res = dec.generate(list(range(50)), GREEDY)
    assert res.token_ids == ref.token_ids and len(res.token_ids) == 14


@pytest.mark.parametrize("bad,match", [
    ('{"method": "medusa", "num_speculative_tokens": 3}', "method"),
    ('{"method": "layer_skip", "num_speculative_tokens": 3}', "num_layers"),
    ('{"method": "layer_skip", "num_layers": 2, "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "layer_skip", "num_layers": 2, "num_speculative_tokens": 3, "colour": 1}', "unknown"),
    ('{"method": "layer_skip", "num_layers": 2, "num_speculative_tokens": 3, "acceptance": "x"}', "acceptance"),
    ("{not json", "JSON"),
])
def test_bad_speculative_config(bad, match):
    with pytest.raises(InputError, match=match):
        SpeculativeConfig.parse(bad)


def test_tree_depth_must_match_lookahead(tiny64):
    target, draft = tiny64
    with pytest.raises(InputError, match="depth 4"):
        spec_decoder(target, draft, num_speculative_tokens=3, tree="mc_sim_7b_63")


def test_vocabulary_mismatch_is_refused(tiny64, tmp_path):
    save_tiny("llama", tmp_path, vocab_size=300)
    ckpt = load_checkpoint(tmp_path, progress=False)
    other = build_model(ckpt.config, ckpt.state_dict, torch.float64)
    with pytest.raises(InputError, match="vocabulary"):
        spec_decoder(tiny64[0], other, num_speculative_tokens=2)


def test_layer_skip_draft_shares_weights(tiny64):
    target, _ = tiny64
    draft = truncated(target, 1)
    assert draft.config.num_layers == 1
    assert draft.layers[0].attention.wqkv.weight.data_ptr() == target.layers[0].attention.wqkv.weight.data_ptr()
