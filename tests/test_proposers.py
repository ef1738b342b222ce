"""Every proposer through a compiled CPU backend (ONNX on a tiny model) and on the default model (eager
graphs, shipped heads) gives exactly the target's greedy output; the n-gram index equals a brute-force scan."""

import random

import pytest
import torch
from helpers import save_tiny
from test_engine import random_heads

from specair.models.checkpoint import load_checkpoint
from specair.models.llama import build_model, truncated
from specair.runtime.build import engine_from_models, load_models, parse_spec
from specair.runtime.llm import LLM
from specair.runtime.proposers.ngram import NgramIndex
from specair.runtime.params import SamplingParams

PROPOSERS = {
    "draft_model": {"method": "draft_model", "model": "-", "num_speculative_tokens": 3, "tree": "kary:3x2"},
    "layer_skip": {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 3},
    "ngram": {"method": "ngram", "num_speculative_tokens": 3},
    "medusa": {"method": "medusa", "num_speculative_tokens": 2, "tree": [[0], [1], [0, 0], [0, 1]]},
    "eagle": {"method": "eagle", "num_speculative_tokens": 3, "tree": "topk:2x5"},
    "eagle3": {"method": "eagle3", "num_speculative_tokens": 2, "tree": "kary:2x2"},
    "mlp_speculator": {"method": "mlp_speculator", "num_speculative_tokens": 3},
}
# A second shape per proposer for the adaptive choice: another depth, or a chain beside a tree.
SHAPES = {
    "draft_model": {"num_speculative_tokens": 2, "tree": "chain"},
    "layer_skip": {"num_speculative_tokens": 1},
    "ngram": {"num_speculative_tokens": 5},
    "medusa": {"num_speculative_tokens": 1, "tree": "chain"},
    "eagle": {"num_speculative_tokens": 1, "tree": "chain"},
    "eagle3": {"tree": "topk:2x4"},
    "mlp_speculator": {"num_speculative_tokens": 2},
}
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8], list(range(30, 60, 3))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = []
    for seed in (0, 1):
        path = tmp_path_factory.mktemp(f"t{seed}")
        save_tiny("llama", path, seed=seed, num_hidden_layers=2 - seed, max_position_embeddings=128)
        ckpt = load_checkpoint(path, progress=False)
        out.append(build_model(ckpt.config, ckpt.state_dict))
    return out


def greedy(engine, n=16):
    return [r.token_ids for r in LLM.from_engine(engine).generate(
        PROMPTS, SamplingParams(max_tokens=n, ignore_eos=True))]


@pytest.mark.parametrize("adaptive", [False, True], ids=["", "adaptive-shapes"])
@pytest.mark.parametrize("name", list(PROPOSERS))
def test_every_proposer_through_onnx_equals_autoregressive(tiny, name, adaptive):
    pytest.importorskip("onnxruntime")
    target, other = tiny
    spec = PROPOSERS[name]
    if adaptive:
        spec = {**spec, "adaptive": True, "shapes": [SHAPES[name]]}
    draft = {"draft_model": other, "layer_skip": truncated(target, 1), "ngram": None}.get(name)
    if draft is None and name != "ngram":
        draft = random_heads(target, spec)
    kw = dict(max_context=64, prefill_chunk=16, batch_buckets=(2,), variants=("greedy",), backend="onnx")
    ref = greedy(engine_from_models(target, **kw))
    engine = engine_from_models(target, None, draft, spec, **kw)
    assert greedy(engine) == ref
    verified = {k.shape for k in engine.graphs.fns if k.kind == "verify"}  # it did speculate, through compiled graphs
    assert verified == ({0, 1} if adaptive else {0})


CHAT = [{"role": "user", "content": "Explain what a hash table is, briefly."}]


@pytest.fixture(scope="module")
def default_ar(default_hf_dir):
    """The default model (fp32), its tokenizer and its autoregressive greedy reply to CHAT."""
    models = load_models(None, "fp32", None)
    llm = LLM.from_engine(engine_from_models(models.target, models.tokenizer, max_context=512))
    return models, llm.chat(CHAT, SamplingParams(max_tokens=32))[0]


@pytest.mark.parametrize("spec", [
    {"method": "eagle"},  # the shipped head and its shipped tree
    {"method": "eagle3"},
    {"method": "medusa"},
    {"method": "ngram", "num_speculative_tokens": 4},
], ids=lambda s: s["method"])  # layer skip on the default model: tests/test_speculative.py's exact float64 cases cover it
def test_default_model_proposers_are_lossless(default_ar, spec):
    """fp32 on the real model: greedy output equals autoregressive decoding token for token (a divergence
    is allowed only at a near-tie of the target's top-2 logits, where differently shaped passes may
    round differently)."""
    (models, ar) = default_ar
    parsed = parse_spec(spec)
    target = models.target
    draft = truncated(target, parsed.num_layers) if parsed.method == "layer_skip" else (
        None if parsed.method == "ngram" else load_models_draft(parsed, target))
    llm = LLM.from_engine(engine_from_models(target, models.tokenizer, draft, parsed, max_context=512))
    res = llm.chat(CHAT, SamplingParams(max_tokens=32))[0]
    if res.token_ids != ar.token_ids:
        i = next(j for j, (x, y) in enumerate(zip(ar.token_ids, res.token_ids)) if x != y)
        ids = llm.encode_chat(CHAT) + ar.token_ids[:i]
        with torch.inference_mode():
            logits = target(torch.tensor([ids]), torch.arange(len(ids))[None], torch.zeros(1, dtype=torch.long),
                            *target.empty_cache(1, 1)).logits[0, -1]
        top2 = logits.topk(2).values
        assert float(top2[0] - top2[1]) < 1e-3, f"diverged at token {i} without a near-tie"
    assert res.extra["spec"]["num_drafts"] > 0


def load_models_draft(spec, target):
    """The shipped heads for the default model, loaded onto the already loaded target."""
    from specair.runtime.proposers import proposer_class

    cls = proposer_class(spec.method)
    return cls.loader(cls.head_path(None), target)


def brute_force(tokens, k, lo, hi):
    for n in range(hi, lo - 1, -1):
        if len(tokens) < n:
            continue
        suffix = tokens[-n:]
        for j in range(len(tokens) - n - 1, -1, -1):  # latest earlier occurrence with a continuation
            if tokens[j:j + n] == suffix:
                return tokens[j + n:j + n + k]
    return []


def test_ngram_index_equals_brute_force():
    rng = random.Random(0)
    for trial in range(200):
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        idx = NgramIndex(lo, hi)
        seq: list[int] = []
        for _ in range(rng.randint(1, 6)):
            piece = [rng.randint(0, 5) for _ in range(rng.randint(1, 12))]
            idx.extend(piece)
            seq += piece
            k = rng.randint(1, 5)
            assert idx.propose(k) == brute_force(seq, k, lo, hi), (trial, seq)
