"""The engine: continuous batching over slots gives, under greedy, exactly what each request gives alone, for
every proposer kind, bucket and scorer; requests come and go; bad input is refused and loses nothing."""

import itertools
from dataclasses import replace

import pytest
import torch
from helpers import save_tiny

from specair.models.checkpoint import load_checkpoint
from specair.models.errors import InputError
from specair.models.llama import build_model, truncated
from specair.runtime.build import engine_from_models
from specair.runtime.engine import QueueFullError
from specair.runtime.llm import LLM
from specair.runtime.params import SamplingParams

# Prompts of different lengths (one longer than a prefill chunk) with different budgets, so rows join,
# finish and leave at different steps and the batch bucket grows and shrinks.
PROMPTS = [list(range(3, 40, 2)), [5, 6, 7], list(range(10, 50)), [9] * 5 + [11, 12], list(range(60, 20, -1))]
BUDGETS = [40, 12, 33, 25, 18]


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory):
    """A float64 random target and a float64 random one-layer draft over the same vocabulary (float64, so
    batched and unbatched arithmetic agree to far below any logit gap)."""
    models = []
    for seed in (0, 1):
        path = tmp_path_factory.mktemp(f"m{seed}")
        save_tiny("llama", path, seed=seed, num_hidden_layers=2 if seed == 0 else 1)
        ckpt = load_checkpoint(path, progress=False)
        models.append(build_model(ckpt.config, ckpt.state_dict, torch.float64))
    return models


def run(engine, prompts=PROMPTS, budgets=BUDGETS, **kw):
    params = [SamplingParams(max_tokens=m, ignore_eos=True, **kw) for m in budgets]
    return LLM.from_engine(engine).generate(prompts, params)


@pytest.fixture(scope="module")
def alone(tiny64):
    """Autoregressive greedy outputs, one request at a time."""
    engine = engine_from_models(tiny64[0], prefill_chunk=16)
    return [run(engine, [p], [m])[0].token_ids for p, m in zip(PROMPTS, BUDGETS)]


# Greedy and seeded sampled requests side by side: every request's tokens are its own whatever runs beside it.
MIXED = [dict(), dict(temperature=0.9, top_p=0.95, seed=11), dict(), dict(temperature=0.8, seed=12),
         dict(temperature=1.0, top_k=8, seed=13)]


def run_mixed(engine, which=range(len(PROMPTS))):
    params = [SamplingParams(max_tokens=BUDGETS[i], ignore_eos=True, **MIXED[i]) for i in which]
    return LLM.from_engine(engine).generate([PROMPTS[i] for i in which], params)


@pytest.fixture(scope="module")
def alone_mixed(tiny64):
    """Autoregressive outputs of the MIXED requests, one at a time."""
    engine = engine_from_models(tiny64[0], prefill_chunk=16)
    return [run_mixed(engine, [i])[0].token_ids for i in range(len(PROMPTS))]


CONFIGS = {
    "autoregressive": None,
    "draft chain": {"method": "draft_model", "model": "-", "num_speculative_tokens": 3},
    "draft kary tree": {"method": "draft_model", "model": "-", "num_speculative_tokens": 2, "tree": "kary:2x2"},
    "draft topk tree": {"method": "draft_model", "model": "-", "num_speculative_tokens": 3, "tree": "topk:2x5"},
    "batch expansion": {"method": "draft_model", "model": "-", "num_speculative_tokens": 2, "tree": "kary:2x2",
                        "scorer": "batch_expansion"},
    "layer skip": {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 4},
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
    "disabled above 2 rows": {"method": "draft_model", "model": "-", "num_speculative_tokens": 3,
                              "disable_by_batch_size": 2},
}


HEAD_CONFIGS = {
    "eagle chain": {"method": "eagle", "num_speculative_tokens": 3},
    "eagle topk tree": {"method": "eagle", "num_speculative_tokens": 3, "tree": "topk:2x6"},
    "eagle static tree, disabled above 2 rows": {"method": "eagle", "num_speculative_tokens": 2,
                                                 "tree": "kary:2x2", "disable_by_batch_size": 2},
    "eagle3 topk tree": {"method": "eagle3", "num_speculative_tokens": 3, "tree": "topk:2x6"},
    "eagle3 chain": {"method": "eagle3", "num_speculative_tokens": 3},
    "medusa tree": {"method": "medusa", "num_speculative_tokens": 3, "tree": [[0], [1], [0, 0], [1, 0], [0, 0, 0]]},
    "mlp_speculator": {"method": "mlp_speculator", "num_speculative_tokens": 3},
}


def random_heads(target, spec):
    """Untrained heads with random weights: they propose junk, which must change nothing but speed."""
    from specair.models.eagle import EagleHead
    from specair.models.eagle3 import Eagle3Head
    from specair.models.medusa import MedusaHeads
    from specair.models.mlp_speculator import MLPSpeculator

    torch.manual_seed(0)
    k = spec["num_speculative_tokens"]
    heads = {"eagle": lambda: EagleHead(target), "eagle3": lambda: Eagle3Head(target), "medusa": lambda: MedusaHeads(target, k, 1),
             "mlp_speculator": lambda: MLPSpeculator(target, k)}[spec["method"]]()
    with torch.no_grad():
        for p in getattr(heads, "own_parameters", heads.parameters)():  # never the target's shared LM head
            p.normal_(0, 0.05)
    return heads.requires_grad_(False)


@pytest.mark.parametrize("name", list(CONFIGS) + list(HEAD_CONFIGS))
def test_batched_equals_each_alone_without_speculation(tiny64, alone_mixed, name):
    """Greedy and seeded sampled requests in one batch, with any proposer: each gets the tokens plain decoding
    gives it alone. Sampled tokens are decided by the uniform of their position, so neither the batch nor
    whether a step speculates (disable_by_batch_size turns it off for the whole batch) changes them."""
    target, other = tiny64
    spec = CONFIGS[name] if name in CONFIGS else HEAD_CONFIGS[name]
    draft = None
    if spec and spec["method"] == "draft_model":
        draft = other
    elif spec and spec["method"] == "layer_skip":
        draft = truncated(target, spec["num_layers"])
    elif spec and spec["method"] in ("eagle", "eagle3", "medusa", "mlp_speculator"):
        draft = random_heads(target, spec)
    engine = engine_from_models(target, None, draft, spec, prefill_chunk=16, batch_buckets=(1, 2, 4))
    results = run_mixed(engine)
    assert [r.token_ids for r in results] == alone_mixed
    assert set(engine.bucket_steps) == {1, 2, 4}, engine.bucket_steps  # every bucket ran
    assert engine.rows == [] and not engine.has_unfinished()
    if spec and spec["method"] != "ngram":
        for r in results:
            s = r.extra["spec"]
            assert s["num_draft_tokens"] == s["num_drafts"] * spec["num_speculative_tokens"]
            assert sum(s["accepted_per_position"]) == s["num_accepted_tokens"]
        assert sum(r.extra["spec"]["num_drafts"] > 0 for r in results) >= (1 if "disable_by_batch_size" in spec
                                                                          else len(results))


def test_ngram_speculates_on_repetitive_text(tiny64):
    """A prompt that repeats itself: the n-gram proposer finds matches and they are accepted losslessly."""
    target = tiny64[0]
    prompt = [7, 8, 9, 10, 11] * 6
    ref = run(engine_from_models(target, prefill_chunk=16), [prompt], [30])[0]
    res = run(engine_from_models(target, spec={"method": "ngram", "num_speculative_tokens": 4},
                                 prefill_chunk=16), [prompt], [30])[0]
    assert res.token_ids == ref.token_ids
    assert res.extra["spec"]["num_drafts"] > 0


def test_adaptive_speculation_is_lossless_and_runs_both_step_kinds(tiny64, alone):
    """adaptive: greedy steps pick speculative or plain by measured tokens/s; either way the output is the
    target's, and the first steps try both kinds."""
    spec = {"method": "draft_model", "model": "-", "num_speculative_tokens": 3, "adaptive": True}
    engine = engine_from_models(tiny64[0], None, tiny64[1], spec, prefill_chunk=16, batch_buckets=(1, 2, 4))
    assert [r.token_ids for r in run(engine)] == alone
    assert engine.adaptive.steps[0] > 0 and engine.adaptive.steps[None] > 0
    with pytest.raises(InputError, match="adaptive"):
        engine_from_models(tiny64[0], None, tiny64[1], {**spec, "adaptive": "yes"})


def test_adaptive_shapes_are_lossless_and_each_runs(tiny64, alone):
    """With `shapes`, greedy steps choose among plain decoding and every precompiled shape (chains and trees
    of different depths, one graph set each); the output stays the target's, whichever ran when."""
    spec = {"method": "draft_model", "model": "-", "num_speculative_tokens": 3, "adaptive": True,
            "shapes": [{"num_speculative_tokens": 1}, {"num_speculative_tokens": 5, "tree": "topk:2x6"}]}
    engine = engine_from_models(tiny64[0], None, tiny64[1], spec, prefill_chunk=16, batch_buckets=(1, 2, 4))
    assert [t.depth for t in engine.plan.trees] == [3, 1, 5] and engine.plan.spare_slots == 16
    assert {k.shape for k in engine.catalog.keys() if k.kind in ("draft", "verify")} == {0, 1, 2}
    assert [r.token_ids for r in run(engine)] == alone
    assert all(n > 0 for n in engine.adaptive.steps.values()), engine.adaptive.steps
    # Sampled steps run the main shape only: no other shape has a sampling verify graph.
    assert not [k for k in engine.catalog.keys() if k.shape and k.kind == "verify" and k.method != "greedy"]


@pytest.mark.parametrize("spec, message", [
    ({"shapes": [{"num_speculative_tokens": 2}]}, "adaptive"),
    ({"adaptive": True, "shapes": [{"tree": "chain", "num_speculative_tokens": 3}]}, "repeats"),
    ({"adaptive": True, "shapes": [{"method": "ngram"}]}, "'num_speculative_tokens' and/or 'tree' only"),
    ({"adaptive": True, "shapes": "chain"}, "list of objects"),
    ({"adaptive": True, "shapes": [{"num_speculative_tokens": 40}]}, "1..16"),
])
def test_bad_adaptive_shapes_are_refused(tiny64, spec, message):
    with pytest.raises(InputError, match=message):
        engine_from_models(tiny64[0], None, tiny64[1],
                           {"method": "draft_model", "model": "-", "num_speculative_tokens": 3, **spec})


def test_adaptive_choice_follows_the_faster_step_and_probes_the_other():
    from specair.runtime.adaptive import AdaptiveSpeculation

    a = AdaptiveSpeculation((True, False), alpha=0.5, probe=4)
    assert a.choose() is True
    a.record(True, 6, 0.02)  # 300 tokens/s
    assert a.choose() is False
    a.record(False, 2, 0.01)  # 200 tokens/s
    picks = [a.choose() for _ in range(8)]
    assert picks == [True, True, True, False, True, True, True, False]  # the slower kind every 4th step
    for _ in range(6):
        a.record(True, 2, 0.02)  # acceptance falls: speculation now emits 100 tokens/s
    assert a.rate[True] < a.rate[False] and a.choose() is False


def test_adaptive_choice_among_several_arms_probes_each_in_turn():
    from specair.runtime.adaptive import AdaptiveSpeculation

    a = AdaptiveSpeculation((0, 1, None), alpha=1.0, probe=3)
    for arm, rate in ((0, 100.0), (1, 300.0), (None, 200.0)):
        assert a.choose() == arm
        a.record(arm, int(rate), 1.0)
    assert [a.choose() for _ in range(9)] == [1, 1, 0, 1, 1, None, 1, 1, 0]
    a.record(None, 400, 1.0)
    assert a.choose() is None


def test_abort_frees_the_slot_and_others_continue(tiny64, alone):
    engine = engine_from_models(tiny64[0], prefill_chunk=16, batch_buckets=(1, 2))
    keep = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=BUDGETS[0], ignore_eos=True))
    drop = engine.add_request(PROMPTS[2], SamplingParams(max_tokens=BUDGETS[2], ignore_eos=True))
    results = {}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        if steps == 6:
            engine.abort(drop)
        for ev in engine.step():
            if ev.result is not None:
                results[ev.request_id] = ev.result
    assert results[drop].finish_reason == "abort"
    assert results[keep].token_ids == alone[0]
    assert engine.rows == [] and engine.num_running == 0


def test_bad_input_is_refused_and_loses_nothing(tiny64):
    engine = engine_from_models(tiny64[0], max_context=64, prefill_chunk=16, batch_buckets=(1, 2), max_waiting=1)
    with pytest.raises(InputError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(InputError, match="token ids"):
        engine.add_request([1, 2, 10**6], SamplingParams())
    with pytest.raises(InputError, match="context holds 64"):
        engine.add_request(list(range(64)), SamplingParams())
    ok = [engine.add_request([1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True)) for _ in range(3)]
    with pytest.raises(QueueFullError):  # two slots and one waiting place are taken
        engine.add_request([1, 2, 3], SamplingParams())
    done = {}
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.result is not None:
                done[ev.request_id] = ev.result
    assert sorted(done) == sorted(ok) and all(r.num_generated_tokens == 5 for r in done.values())
    # A request near the end of the context stops at its edge instead of failing.
    r = run(engine, [list(range(1, 60))], [100])[0]
    assert r.finish_reason == "length" and r.num_generated_tokens == 64 - 59


def test_draft_with_another_vocabulary_is_refused(tiny64, tmp_path):
    save_tiny("llama", tmp_path, vocab_size=300, num_hidden_layers=1)
    ckpt = load_checkpoint(tmp_path, progress=False)
    other = build_model(ckpt.config, ckpt.state_dict, torch.float64)
    with pytest.raises(InputError, match="vocabulary"):
        engine_from_models(tiny64[0], None, other, {"method": "draft_model", "model": "-",
                                                    "num_speculative_tokens": 2})


def test_greedy_acceptance_refuses_sampling(tiny64):
    target, draft = tiny64
    engine = engine_from_models(target, None, draft, {"method": "draft_model", "model": "-",
                                                      "num_speculative_tokens": 2, "acceptance": "greedy"})
    with pytest.raises(InputError, match="temperature 0"):
        engine.add_request([1, 2], SamplingParams(temperature=0.7))


def test_prompts_prefill_on_the_smallest_chunk_that_holds_them(tiny64, alone):
    """With chunk buckets 16/32/64 a prompt's last chunk runs on the smallest graph holding it (a 7-token
    prompt on t16, 40 tokens on 64, 20 on 32) and every output equals the 16-token-chunk engine's."""
    engine = engine_from_models(tiny64[0], prefill_chunk=64)
    assert engine.plan.chunk_buckets == (16, 32, 64)
    calls, graphs = [], engine.graphs

    class Recording:
        def __call__(self, key, **inputs):
            calls.append((key.kind, key.chunk, tuple(inputs["tokens"].shape) if key.kind == "prefill" else None))
            return graphs(key, **inputs)

        def __getattr__(self, name):
            return getattr(graphs, name)

    engine.graphs = Recording()
    assert [r.token_ids for r in run(engine)] == alone
    chunks = [(c, shape) for kind, c, shape in calls if kind == "prefill"]
    # PROMPTS lengths 19, 3, 40, 7, 40: 32; 16; 64; 16; 64 (the plan's own chunk is GraphKey.chunk 0).
    assert chunks == [(32, (1, 32)), (16, (1, 16)), (0, (1, 64)), (16, (1, 16)), (0, (1, 64))]


class Exploding:
    """A sequence's text assembly that breaks at its n-th token (a fault that belongs to one request)."""

    def __init__(self, after: int) -> None:
        self.left, self.stopped = after, False

    def add(self, token: int) -> str:
        self.left -= 1
        if self.left < 0:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "broken on purpose")
        return ""

    def finish(self) -> str:
        return ""

    text = ""


@pytest.mark.parametrize("name", ["autoregressive", "draft chain"])
def test_a_raising_sequence_fails_alone(tiny64, alone, name):
    """A request whose own step work raises (here its text assembly, in decode and in its first token, and
    the write of its sampling state into the batch as it joins) ends with finish reason "error" and the error;
    the requests beside it in the same steps give what they give alone."""
    spec = CONFIGS[name]
    engine = engine_from_models(tiny64[0], None, tiny64[1] if spec else None, spec, prefill_chunk=16,
                                batch_buckets=(1, 2, 4))
    ids = [engine.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True)) for p, m in zip(PROMPTS, BUDGETS)]
    doomed = {ids[1]: 5, ids[3]: 0}  # one breaks mid-decode, one at its first token (the prefill's)
    for s in engine.sched._inbox:
        if s.request_id in doomed:
            s.text = Exploding(doomed[s.request_id])
        elif s.request_id == ids[2]:  # past validation, a top_k int64 cannot hold: its row's write fails
            s.params = replace(s.params)
            object.__setattr__(s.params, "top_k", 2 ** 63)
            doomed[s.request_id] = "overflow"
    results = {}
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.result is not None:
                results[ev.request_id] = ev.result
    for i, rid in enumerate(ids):
        r = results[rid]
        if rid in doomed:
            assert r.finish_reason == "error" and ("broken on purpose" if doomed[rid] != "overflow"
                                                   else "overflow") in r.extra["error"].lower()
        else:
            assert r.finish_reason == "length" and r.token_ids == alone[i]
    assert not engine.rows and engine.sched.prefilling is None


def test_cache_pages_are_committed_on_write_and_given_back():
    """A CPU cache reads as zeros and holds no memory until written; `release` gives back a row's whole pages
    from a slot on (they read as zeros again) and leaves every other slot as it was."""
    from specair.models import memory

    page_slots = memory.PAGE // (64 * 4)
    k = memory.zeros((3, 4, 2, 64 * page_slots, 64), torch.float32)
    assert memory.resident_bytes([k]) == 0 and k[:, :, :, -page_slots:].abs().sum() == 0  # read, not held
    k[:, :, :, :5 * page_slots] = 1.0
    assert memory.resident_bytes([k]) == 3 * 4 * 2 * 5 * memory.PAGE
    memory.release(k, 2, 2 * page_slots + 1)  # pages 3 and 4 of each run of row 2; page 2 is partly kept
    assert memory.resident_bytes([k]) == (3 * 4 * 2 * 5 - 3 * 2 * 2) * memory.PAGE
    assert (k[:, 2, :, :3 * page_slots] == 1).all() and (k[:, 2, :, 3 * page_slots:] == 0).all()
    assert (k[:, [0, 1, 3], :, :5 * page_slots] == 1).all()
    for row in range(4):
        memory.release(k, row)
    assert memory.resident_bytes([k]) == 0 and k.abs().sum() == 0


@pytest.mark.parametrize("backend", ["eager", "onnx"])
def test_kv_memory_follows_the_context_in_use(tmp_path, backend):
    """On the CPU the caches have the plan's full context, the fixed shape compiled graphs take, but hold
    memory only for the slots written (pages committed on write, measured in /proc/self/smaps): short
    requests hold a sliver of the maximum context, a long one grows with what it uses, and a finished row, the
    prefill scratch and an idle engine give theirs back."""
    save_tiny("llama", tmp_path, num_hidden_layers=2, max_position_embeddings=4096)
    ckpt = load_checkpoint(tmp_path, progress=False)
    target = build_model(ckpt.config, ckpt.state_dict, torch.float32)
    engine = engine_from_models(target, max_context=4096, prefill_chunk=16, batch_buckets=(1, 2, 4),
                                backend=backend, variants=("greedy",))
    plan, kv = engine.plan, engine.kv
    assert kv.on_demand and plan.slots == 4096 + plan.spare_slots
    assert backend == "eager" or plan.ctx_buckets == (4096,)  # fused attention reads only the used slots
    full_row = plan.slots * kv.slot_bytes

    def held_while(prompts, budgets):
        peak = 0
        for p, m in zip(prompts, budgets):
            engine.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True))
        for step in itertools.count():
            if not engine.has_unfinished():
                return peak, engine.kv_usage()[1]
            engine.step()
            if step % 8 == 0:  # a read of smaps costs tens of ms
                used, held = engine.kv_usage()
                assert used <= held
                peak = max(peak, held)

    peak, after = held_while(PROMPTS[:4], [20, 20, 20, 20])  # contexts under 64 tokens, up to 4 rows
    assert peak <= 5 * full_row // 16  # four rows and the prefill scratch, a 16th of their full size
    assert after == 0  # idle: nothing resident
    peak, after = held_while([list(range(3, 40))], [400])  # a row of over 400 tokens
    assert 400 * kv.slot_bytes <= peak <= 2 * 500 * kv.slot_bytes  # the row and no more than its scratch
    assert after == 0
    # A row that finishes gives its memory back while the other runs on.
    engine.add_request(list(range(3, 40)), SamplingParams(max_tokens=300, ignore_eos=True))
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True))
    while len(engine.rows) < 2:
        engine.step()
    while len(engine.rows) == 2:
        engine.step()
    assert engine.kv_usage()[1] <= 400 * kv.slot_bytes  # one row of about 340 tokens, not two
    while engine.has_unfinished():
        engine.step()


def test_a_kv_budget_decides_admission(tiny64, alone):
    """With a KV budget, a waiting request starts only while the caches fit it and every running request at
    its longest; one that cannot fit even alone is refused up front, and the others' outputs are unchanged."""
    engine = engine_from_models(tiny64[0], max_context=512, prefill_chunk=16, batch_buckets=(1, 2, 4))
    # Room for any two requests at their longest (bucket 2) and the scratch, but for no three.
    longest, prompt = [len(p) + m for p, m in zip(PROMPTS, BUDGETS)], max(map(len, PROMPTS))
    budget = max(engine.kv.bytes_for(pair, prompt) for pair in itertools.combinations(longest, 2))
    assert min(engine.kv.bytes_for(three, prompt) for three in itertools.combinations(longest, 3)) > budget
    engine.limit_kv_memory(budget)
    rids = [engine.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True)) for p, m in zip(PROMPTS, BUDGETS)]
    with pytest.raises(InputError, match="KV cache budget"):
        engine.add_request(list(range(1, 40)), SamplingParams(max_tokens=400))
    out, most = {}, 0
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.result is not None:
                out[ev.request_id] = ev.result.token_ids
        most = max(most, len(engine.rows))
    assert most == 2 and [out[r] for r in rids] == alone
    with pytest.raises(InputError, match="positive"):
        engine.limit_kv_memory(0)
