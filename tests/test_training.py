"""Training recipes (specair.training): the prompt set, self-distillation through the engine, EAGLE / Medusa /
draft-model training, export through the heads' own loaders, exact resume, and the offline acceptance eval.

Everything runs on a tiny random Llama that carries the default model's real tokenizer and chat template.
"""

import gzip
import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import save_tiny

from specair.models.checkpoint import load_checkpoint
from specair.models.eagle import load_eagle
from specair.models.errors import InputError
from specair.models.llama import build_model
from specair.models.medusa import load_medusa
from specair.training import prompt_set
from specair.training.acceptance import AcceptanceCounter, true_token_rank
from specair.training.data import build_draft_vocab, collate
from specair.runtime.llm import LLM
from specair.training.distill import select_prompts, target_hidden
from specair.models.llama import with_features
from specair.training.draft import DraftRecipe, DraftSettings
from specair.training.eagle import EagleRecipe, EagleSettings, unroll_features
from specair.training.medusa import MedusaRecipe, MedusaSettings
from specair.training.setup import DataOptions, prepare
from specair.training.trainer import TrainConfig

NUM_PROMPTS, NEW_TOKENS = 12, 10


# ---- the prompt set ----

def test_prompt_set_is_shipped_complete_and_reproducible():
    records = prompt_set.load_prompts()
    assert len(records) >= 800
    assert {r["split"] for r in records} == {"train", "heldout"}
    assert {r["category"] for r in records} == set(prompt_set.CATEGORIES)
    held = [r for r in records if r["split"] == "heldout"]
    assert 0.08 < len(held) / len(records) < 0.12
    for cat in prompt_set.CATEGORIES:  # every category has training and held-out prompts
        assert {r["split"] for r in records if r["category"] == cat} == {"train", "heldout"}
    assert len({r["id"] for r in records}) == len(records)
    texts = [r["messages"][0]["content"] for r in records]
    assert len(set(texts)) == len(texts) and all(r["messages"][0]["role"] == "user" for r in records)
    # The shipped file is exactly what the deterministic builder writes.
    shipped = [json.loads(line) for line in prompt_set.PROMPTS_FILE.read_text(encoding="utf-8").splitlines()]
    assert shipped == prompt_set.build_prompt_set()


def test_prompt_subsets_keep_a_heldout_share(tmp_path):
    records = prompt_set.load_prompts()
    for n in (2, 12, 100):
        sub = select_prompts(records, n)
        assert len(sub) == n
        held = sum(r["split"] == "heldout" for r in sub)
        assert 1 <= held <= max(1, round(n * 0.12))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": "hi"}\n')
    with pytest.raises(InputError, match="expected"):
        prompt_set.load_prompts(bad)
    with pytest.raises(InputError, match="at least 2"):
        select_prompts(records, 1)


# ---- distillation on a tiny model with the real tokenizer ----

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, default_hf_dir):
    path = tmp_path_factory.mktemp("tiny-real-tok")
    save_tiny("llama", path, vocab_size=49152, max_position_embeddings=1024)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (Path(default_hf_dir) / name).is_file():
            shutil.copy(Path(default_hf_dir) / name, path / name)
    return path


@pytest.fixture(scope="module")
def setup(tiny_dir, tmp_path_factory):
    """A distilled set of NUM_PROMPTS prompts, made by specair.LLM through the engine."""
    cache = tmp_path_factory.mktemp("distill-cache")
    torch.manual_seed(0)
    return prepare(DataOptions(target=str(tiny_dir), cache_dir=str(cache), max_prompts=NUM_PROMPTS,
                               max_new_tokens=NEW_TOKENS, gen_batch=8))


def test_distillation_caches_greedy_answers_and_hidden_states(setup, tiny_dir, tmp_path):
    data = setup.data
    assert len(data.sequences) == NUM_PROMPTS
    assert data.split("train") and data.split("heldout")
    tok = setup.tokenizer
    for s in data.sequences[:3]:
        assert 0 < s.answer_len <= NEW_TOKENS
        assert s.hidden.dtype == torch.float16 and s.hidden.shape == (s.tokens.numel(), 64)
        # Recorded by the engine's graphs as they ran: the final hidden state at every position but the last
        # (never fed), and EAGLE-3's features (the inputs of the recorded layers) beside it.
        full = target_hidden(setup.target, s.tokens)
        assert torch.allclose(s.hidden[:-1].float(), full[:-1], atol=2e-3, rtol=1e-2)
        assert not s.hidden[-1].any()
        layers = tuple(data.meta["feature_layers"])
        view = with_features(setup.target, layers)
        with torch.no_grad():
            feats = view(s.tokens[None], torch.arange(s.tokens.numel())[None], torch.zeros(1, dtype=torch.long),
                         *view.empty_cache(1, 1)).hidden[0]
        assert s.features.shape == (s.tokens.numel(), 64 * len(layers))
        assert torch.allclose(s.features[:-1].float(), feats[:-1], atol=2e-3, rtol=1e-2)
        greedy = setup.target.lm_head(full).argmax(-1)
        assert torch.equal(greedy[s.prompt_len - 1:-1], s.tokens[s.prompt_len:])
        assert "<|im_start|>assistant" in tok.decode(s.tokens[:s.prompt_len].tolist(), skip_special_tokens=False)
    # A second run loads the cache without building an LLM (nothing left to generate).
    from specair.training.distill import distill

    def no_llm():
        raise AssertionError("the cache is complete; nothing should be generated")

    again = distill(setup.target, setup.fingerprint, str(tiny_dir), cache=data.cache_dir, max_prompts=NUM_PROMPTS,
                    max_new_tokens=NEW_TOKENS, make_llm=no_llm)
    assert [s.id for s in again.sequences] == [s.id for s in data.sequences]
    with pytest.raises(InputError, match="max_new_tokens"):
        distill(setup.target, setup.fingerprint, str(tiny_dir), cache=data.cache_dir, max_new_tokens=5,
                make_llm=no_llm)
    # Cached answers made for other prompt tokens (a changed prompt set or template) are refused.
    stale = tmp_path / "stale"
    shutil.copytree(data.cache_dir, stale)
    lines = (stale / "answers.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    first["prompt_ids"] = first["prompt_ids"][:-1]
    (stale / "answers.jsonl").write_text("\n".join([json.dumps(first)] + lines[1:]) + "\n")
    with pytest.raises(InputError, match="another prompt"):
        distill(setup.target, setup.fingerprint, str(tiny_dir), cache=stale, max_prompts=NUM_PROMPTS,
                max_new_tokens=NEW_TOKENS, make_llm=no_llm, tokenizer=setup.tokenizer)


def test_shipped_answers_seed_a_new_cache_and_features_are_teacher_forced(setup, tiny_dir, tmp_path):
    from specair.training import distill as dm

    data = setup.data
    ship = tmp_path / "ship"
    out = dm.ship_answers(data.cache_dir, ship)
    info = json.loads(out.with_suffix("").with_suffix(".json").read_text())
    assert info["answers"] == NUM_PROMPTS and info["fingerprint"] == setup.fingerprint
    shipped = dm.shipped_answers(setup.fingerprint, NEW_TOKENS, ship)
    assert sorted(shipped) == sorted(s.id for s in data.sequences)
    assert dm.shipped_answers(setup.fingerprint, NEW_TOKENS + 1, ship) == {}  # other settings: not used
    # One shipped answer was made for another prompt: it is answered again, the rest are teacher-forced.
    lines = gzip.decompress(out.read_bytes()).decode().splitlines()
    first = json.loads(lines[0])
    first["prompt_crc"] ^= 1
    out.write_bytes(gzip.compress("\n".join([json.dumps(first)] + lines[1:]).encode() + b"\n"))
    llms = []

    def make_llm():
        llms.append(LLM(str(tiny_dir), backend="auto", batch_buckets=(1, 8), max_waiting=32, max_context=1024,
                        features=tuple(data.meta["feature_layers"])))
        return llms[-1]

    old = dm.SHIPPED
    dm.SHIPPED = ship
    try:
        again = dm.distill(setup.target, setup.fingerprint, str(tiny_dir), cache=tmp_path / "fresh",
                           max_prompts=NUM_PROMPTS, max_new_tokens=NEW_TOKENS, make_llm=make_llm,
                           tokenizer=setup.tokenizer)
    finally:
        dm.SHIPPED = old
    assert again.meta["shipped_answers_taken"] == NUM_PROMPTS - 1
    steps = sum(llms[0].engine.bucket_steps.values())
    assert 0 < steps <= NEW_TOKENS  # only the re-answered prompt decoded
    by_id = {s.id: s for s in data.sequences}
    for s in again.sequences:
        ref = by_id[s.id]
        assert torch.equal(s.tokens, ref.tokens) and s.prompt_len == ref.prompt_len
        # Prefilled instead of decoded: the same features up to float16 storage and kernel order.
        assert torch.allclose(s.hidden[:-1].float(), ref.hidden[:-1].float(), atol=2e-3, rtol=1e-2)
        assert torch.allclose(s.features[:-1].float(), ref.features[:-1].float(), atol=2e-3, rtol=1e-2)


# ---- training: loss goes down, export loads back identically ----

def _train_loss(recipe, batch_fn, steps, lr):
    params = list(recipe.params.values())
    opt = torch.optim.AdamW(params, lr=lr)
    first = last = None
    for _ in range(steps):
        loss, _ = batch_fn()
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = float(loss.detach()) if first is None else first
    with torch.no_grad():
        last = float(batch_fn()[0])
    return first, last


def test_eagle_training_lowers_the_loss_and_exports_through_load_eagle(setup, tmp_path):
    torch.manual_seed(0)
    recipe = EagleRecipe(setup, EagleSettings(draft_vocab=2048, unroll=2, noise=0.0, eval_depth=3))
    batch = collate(setup.train[:4])
    first, last = _train_loss(recipe, lambda: recipe.losses(batch, 2, 0.0), 15, 3e-3)
    assert last < 0.8 * first
    ev = recipe.evaluate()
    acc = ev["acceptance"]
    assert acc["chain_starts"] > 0 and len(acc["acceptance_by_position"]) == 3
    assert acc["tau_chain"] <= acc["tree_w2"]["tau"] <= acc["tree_w8"]["tau"] <= 4.0

    from specair.training.eagle import export_eagle

    export_eagle(recipe.head, tmp_path / "eagle")
    loaded = load_eagle(tmp_path / "eagle", setup.target)
    own = dict(recipe.params)
    got = {f"fc.{n}": p for n, p in loaded.fc.named_parameters()} | \
        {f"layers.{n}": p for n, p in loaded.layers.named_parameters()}
    assert own.keys() == got.keys()
    for name, p in own.items():  # shipped in float16: equal to the trained weights rounded to float16
        assert torch.equal(got[name], p.detach().half().float()), name
    assert torch.equal(loaded.draft_vocab, recipe.vocab)


def test_eagle_unrolled_features_match_the_drafting_contract(setup):
    """unroll_features' step-2 chain equals running EagleHead.forward as the draft loop does: true entries
    0..p in the cache, then (x_{p+2}, f_p) at position p+1."""
    torch.manual_seed(1)
    head = EagleRecipe(setup, EagleSettings(draft_vocab=0, init="random")).head.eval()  # attention matters
    s = setup.train[0]
    tokens, hidden = s.tokens.unsqueeze(0), s.hidden.float().unsqueeze(0)
    with torch.no_grad():
        feats = unroll_features(head, tokens, hidden, 2)
        T = tokens.shape[1]
        kc, vc = head.empty_cache(1, 0)
        first = head(tokens[:, 1:], torch.arange(T - 1).view(1, -1), torch.zeros(1, dtype=torch.long), kc, vc,
                     input_hidden=hidden[:, :-1])
        assert torch.allclose(first.hidden, feats[0], atol=1e-5)
        for p in (s.prompt_len, T - 4):
            k_cache, v_cache = first.new_k[..., : p + 1, :], first.new_v[..., : p + 1, :]
            out = head(tokens[:, p + 2: p + 3], torch.tensor([[p + 1]]), torch.tensor([p + 1]), k_cache, v_cache,
                       input_hidden=feats[0][:, p: p + 1])
            assert torch.allclose(out.hidden[0, 0], feats[1][0, p], atol=1e-5)


def test_eagle3_training_lowers_the_loss_and_exports_through_load_eagle3(setup, tmp_path):
    from specair.models.eagle3 import load_eagle3
    from specair.training.eagle3 import Eagle3Recipe, Eagle3Settings, export_eagle3

    torch.manual_seed(0)
    recipe = Eagle3Recipe(setup, Eagle3Settings(draft_vocab=2048, unroll=3, eval_depth=3))
    batch = recipe.collate(setup.train[:4])
    assert batch.features.shape[-1] == 64 * len(setup.data.meta["feature_layers"])
    first, last = _train_loss(recipe, lambda: recipe.losses(batch, 3, 0.0), 15, 3e-3)
    assert last < 0.8 * first
    acc = recipe.evaluate()["acceptance"]
    assert acc["chain_starts"] > 0 and acc["tau_chain"] <= acc["tree_w8"]["tau"] <= 4.0
    export_eagle3(recipe.head, tmp_path / "eagle3")
    loaded = load_eagle3(tmp_path / "eagle3", setup.target)
    assert loaded.feature_layers == tuple(setup.data.meta["feature_layers"])
    got = dict(loaded.named_parameters())
    for name, p in recipe.params.items():  # shipped in float16: the trained weights rounded to float16
        assert torch.equal(got[name], p.detach().half().float()), name
    assert torch.equal(loaded.draft_vocab, recipe.vocab)
    # --init DIR goes on from the exported head: its weights (the lm_head too, not the target's rows again)
    warm = Eagle3Recipe(setup, Eagle3Settings(draft_vocab=2048, unroll=3, eval_depth=3, init=str(tmp_path / "eagle3")))
    for name, p in warm.params.items():
        assert torch.equal(p.detach(), got[name].detach()), name
    with torch.no_grad():
        assert float(warm.losses(batch, 3, 0.0)[0]) < 0.9 * first
    with pytest.raises(InputError, match="draft vocabulary"):
        Eagle3Recipe(setup, Eagle3Settings(draft_vocab=1024, init=str(tmp_path / "eagle3")))
    with pytest.raises(InputError, match="trained eagle3 head"):
        Eagle3Recipe(setup, Eagle3Settings(init=str(tmp_path / "nowhere")))


def test_eagle3_unrolled_steps_match_the_drafting_contract(setup):
    """unroll_features with an EAGLE-3 head: step 1 reads the recorded features through fc, step 2 the
    step-1 output at position p+1, exactly as Eagle3Head.forward does in the draft loop."""
    from specair.training.eagle3 import Eagle3Recipe, Eagle3Settings

    torch.manual_seed(1)
    head = Eagle3Recipe(setup, Eagle3Settings(draft_vocab=0, init="random")).head.eval()
    s = setup.train[0]
    tokens, feats_in = s.tokens.unsqueeze(0), s.features.float().unsqueeze(0)
    with torch.no_grad():
        feats = unroll_features(head, tokens, feats_in, 2)
        T = tokens.shape[1]
        first = head(tokens[:, 1:], torch.arange(T - 1).view(1, -1), torch.zeros(1, dtype=torch.long),
                     *head.empty_cache(1, 0), input_hidden=feats_in[:, :-1])
        assert torch.allclose(first.hidden, feats[0], atol=1e-5)
        p = s.prompt_len
        out = head(tokens[:, p + 2: p + 3], torch.tensor([[p + 1]]), torch.tensor([p + 1]),
                   first.new_k[..., : p + 1, :], first.new_v[..., : p + 1, :], input_hidden=feats[0][:, p: p + 1])
        assert torch.allclose(out.hidden[0, 0], feats[1][0, p], atol=1e-5)


def test_medusa_training_lowers_the_loss_and_exports_through_load_medusa(setup, tmp_path):
    torch.manual_seed(0)
    recipe = MedusaRecipe(setup, MedusaSettings(num_heads=3, draft_vocab=2048))
    from specair.training.medusa import export_medusa, flatten_positions

    h, t = flatten_positions(setup.train, 3, recipe.to_index)
    assert h.shape[0] == t.shape[0] > 0 and (t[:, 0] >= 0).any()
    first, last = _train_loss(recipe, lambda: recipe.losses(h[:256], t[:256]), 15, 3e-2)
    assert last < 0.9 * first
    export_medusa(recipe.heads, tmp_path / "medusa")
    loaded = load_medusa(tmp_path / "medusa", setup.target)
    assert loaded.tied and loaded.num_heads == 3
    assert torch.equal(loaded.res_weight, recipe.heads.res_weight.detach().half().float())
    assert torch.equal(loaded.res_bias, recipe.heads.res_bias.detach().half().float())
    assert torch.equal(loaded.draft_vocab, recipe.vocab)
    files = {p.name for p in (tmp_path / "medusa").iterdir()}
    assert files == {"config.json", "medusa_lm_head.safetensors"}


def test_draft_equal_to_the_target_accepts_everything_and_training_lowers_the_kl(setup, tmp_path):
    # A draft with all of the target's layers is the target: the offline eval must accept every token
    # (this pins the eval's indexing to the distilled greedy continuation).
    full = DraftRecipe(setup, DraftSettings(num_layers=2, eval_depth=3))
    acc = full.evaluate()["acceptance"]
    assert acc["chain_starts"] > 0
    assert acc["acceptance_by_position"] == [1.0, 1.0, 1.0] and acc["tau_chain"] == 4.0

    torch.manual_seed(0)
    recipe = DraftRecipe(setup, DraftSettings(num_layers=1, eval_depth=3))
    batch = collate(setup.train[:4])
    first, last = _train_loss(recipe, lambda: recipe.losses(batch), 8, 3e-3)
    assert last < 0.7 * first
    from specair.training.draft import save_hf_dir

    save_hf_dir(recipe.draft, setup.tokenizer, tmp_path / "draft")
    ckpt = load_checkpoint(tmp_path / "draft", progress=False)
    assert ckpt.config.num_layers == 1 and ckpt.tokenizer is not None
    reloaded = build_model(ckpt.config, ckpt.state_dict)
    w = recipe.draft.layers[0].attention.wqkv.weight.detach().half().float()
    assert torch.equal(reloaded.layers[0].attention.wqkv.weight, w)


# ---- resume ----

def test_resume_continues_from_the_saved_step_exactly(setup, tmp_path):
    """Train 4 steps straight; separately crash after step 2's checkpoint and resume: same weights."""
    cfg = TrainConfig(max_steps=4, batch_size=4, save_every=2, eval_every=100, lr=2e-3, warmup_steps=1)
    settings = EagleSettings(draft_vocab=1024, unroll=2, eval_depth=2)

    torch.manual_seed(0)
    straight = EagleRecipe(setup, settings)
    straight.fit(cfg, tmp_path / "a", resume=False)

    torch.manual_seed(0)
    crashing = EagleRecipe(setup, settings)
    real_step = crashing.train_step

    def crash_at_two(indices, step):
        if step == 2:
            raise KeyboardInterrupt
        return real_step(indices, step)

    crashing.train_step = crash_at_two
    with pytest.raises(KeyboardInterrupt):
        crashing.fit(cfg, tmp_path / "b", resume=False)
    assert [p.name for p in (tmp_path / "b" / "checkpoint").iterdir()] == ["step-000002"]

    torch.manual_seed(123)  # a different fresh init: everything must come from the checkpoint
    resumed = EagleRecipe(setup, settings)
    steps = []
    real = resumed.train_step
    resumed.train_step = lambda indices, step: steps.append(step) or real(indices, step)
    resumed.fit(cfg, tmp_path / "b", resume=True)
    assert steps == [2, 3]
    for name, p in straight.params.items():
        assert torch.equal(p, resumed.params[name]), name
    record = json.loads((tmp_path / "b" / "training.json").read_text())
    assert record["recipe"] == "eagle" and record["heldout_eval"]["step"] == 4
    assert not (tmp_path / "b" / "checkpoint").exists()


def test_bf16_training_lowers_the_loss_with_fp32_weights(setup, tmp_path):
    """--precision bf16: the forward runs under autocast, the weights and the optimizer stay float32."""
    from specair.training.eagle3 import Eagle3Recipe, Eagle3Settings

    torch.manual_seed(0)
    recipe = Eagle3Recipe(setup, Eagle3Settings(draft_vocab=2048, unroll=3, eval_depth=2))
    cfg = TrainConfig(max_steps=12, batch_size=4, save_every=100, eval_every=100, lr=3e-3, warmup_steps=1,
                      precision="bf16")
    batch = recipe.collate(setup.train[:4])
    with torch.no_grad():
        before = float(recipe.losses(batch, 3, 0.0)[0])
    recipe.fit(cfg, tmp_path / "h", resume=False)
    with torch.no_grad():
        after = float(recipe.losses(batch, 3, 0.0)[0])
    assert after < 0.8 * before
    assert all(p.dtype == torch.float32 for p in recipe.params.values())
    assert json.loads((tmp_path / "h" / "training.json").read_text())["settings"]["precision"] == "bf16"
    with pytest.raises(InputError, match="precision"):
        recipe.fit(TrainConfig(max_steps=1, precision="fp8"), tmp_path / "x", resume=False)


# ---- pieces ----

def test_acceptance_counter_and_ranks():
    c = AcceptanceCounter(3, widths=(1, 2))
    c.add(torch.tensor([[0, 0, 0], [0, 1, 0], [1, 0, 0], [0, 0, 5]]))
    r = c.result()
    assert r["acceptance_by_position"] == [0.75, 0.5, 0.25]  # run lengths 3, 1, 0, 2
    assert r["tau_chain"] == 2.5
    assert r["conditional_acceptance"] == [0.75, round(0.5 / 0.75, 4), 0.5]
    assert r["tree_w2"]["acceptance_by_position"] == [1.0, 1.0, 0.75]
    # The engine's walk over one sequence: start 0 accepts 3 (+ bonus: next start 4), start 4 accepts 0,
    # start 5 accepts 1 (next 7), start 7 accepts 2: 4 steps, 4 + 1 + 2 + 3 = 10 tokens.
    walk = torch.tensor([[0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0], [1, 0, 0], [0, 2, 0], [0, 0, 0],
                         [0, 0, 3]])
    c.add_walk(walk)
    assert c.result()["walk"]["tau_chain"] == 2.5
    logits = torch.tensor([[0.1, 0.5, 0.3], [1.0, 0.0, 2.0]])
    assert true_token_rank(logits, torch.tensor([1, 0])).tolist() == [0, 1]
    assert true_token_rank(logits, torch.tensor([-1, 2])).tolist() == [3, 0]


def test_draft_vocab_is_the_most_frequent_answer_tokens(setup):
    ids = build_draft_vocab(setup.train, 49152, 16, always=[2])
    assert ids.numel() == 16 and 2 in ids.tolist() and torch.equal(ids, ids.sort().values)
    counts = torch.zeros(49152, dtype=torch.long)
    for s in setup.train:
        counts += torch.bincount(s.tokens[s.prompt_len:], minlength=49152)
    chosen = counts[ids[ids != 2]].min()
    others = counts.clone()
    others[ids] = -1
    assert chosen >= others.max()


def test_train_cli_parses_and_validates(tmp_path):
    import argparse

    from specair.training.cli import add_train_parser

    parser = argparse.ArgumentParser(prog="specair")
    add_train_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train", "eagle", "--out", str(tmp_path), "--draft-vocab", "4096", "--resume"])
    assert args.recipe == "eagle" and args.draft_vocab == 4096 and args.resume and args.target is None
    args = parser.parse_args(["train", "medusa", "--out", str(tmp_path), "--num-heads", "3"])
    assert args.num_heads == 3 and args.batch_size == 512
    args = parser.parse_args(["train", "eagle3", "--out", str(tmp_path)])
    assert args.magpie == 20000 and args.unroll == 5 and args.gen_batch == 32  # one command reproduces the head
    args = parser.parse_args(["train", "distill", "--max-prompts", "40", "--ship"])
    assert args.magpie == 20000 and args.ship and args.max_prompts == 40 and args.func.__name__ == "cmd_distill"
    args = parser.parse_args(["train", "distill", "--gen-batch", "0"])
    with pytest.raises(InputError, match="--gen-batch"):
        args.func(args)
    args = parser.parse_args(["train", "prompts", "--count", "0"])
    with pytest.raises(InputError, match="--count"):
        args.func(args)
    args = parser.parse_args(["train", "draft", "--out", str(tmp_path), "--num-layers", "4", "--epochs", "0"])
    with pytest.raises(InputError, match="--epochs"):
        args.func(args)


# ---- self-generated prompts (Magpie) ----

def test_magpie_filters_and_conditioning():
    from specair.training.magpie import TASKS, MagpieSettings, candidate, normalize, reject_reason

    s = MagpieSettings()
    ok = "How do I keep basil alive on a windowsill in winter?"
    assert reject_reason(ok, "stop", s) is None
    assert reject_reason(ok, "length", s) == "unfinished"
    assert reject_reason("Hi there", "stop", s) == "short"
    assert reject_reason("What is this?<|im_start|>assistant", "stop", s) == "template"
    assert reject_reason("Wie geht es dir heute, mein Freund? Ça va très bien, merci à vous", "stop", s) == "language"
    assert reject_reason("1234 5678 9999 = + - * / 4444 3333", "stop", s) == "language"
    assert reject_reason("the cat sat on the mat " * 4, "stop", s) == "repetition"
    assert reject_reason("Why is the sky blue???????????", "stop", s) == "repetition"
    assert normalize("How do I, keep basil ALIVE?") == normalize("how do i keep basil alive")
    a, b = candidate(s, 7), candidate(MagpieSettings(seed=0), 7)
    assert a == b and a["kind"] in TASKS and a["topic"] in a["system"]  # fixed by (seed, i)
    assert candidate(MagpieSettings(seed=1), 7) != a or candidate(MagpieSettings(seed=1), 8) != candidate(s, 8)


def test_magpie_generation_resumes_and_reproduces(default_hf_dir, tmp_path, monkeypatch):
    """The default model writes user turns; a run stopped after one batch and resumed -- also from a shipped
    copy of the partial set -- gives the same set as one run, and a directory made with other settings is
    refused."""
    from specair.training import magpie
    from specair.training.magpie import MagpieSettings, generate_prompts, report, user_turn_prefix

    llm = LLM(backend="eager", batch_buckets=(1, 8), max_context=256)
    prefix = user_turn_prefix(llm.tokenizer, "You chat with users.")
    assert prefix.endswith("<|im_start|>user\n") and "You chat with users." in prefix
    small = MagpieSettings(count=4, max_tokens=32)
    one = generate_prompts(llm, tmp_path / "a", small, "fp", batch=8)
    half = MagpieSettings(count=2, max_tokens=32)
    generate_prompts(llm, tmp_path / "b", half, "fp", batch=8)
    monkeypatch.setattr(magpie, "SHIPPED", tmp_path / "shipped")
    magpie.ship(tmp_path / "b", seed=0)  # a set shipped in the package seeds an empty directory
    assert [r["messages"] for r in magpie.cached_prompts(tmp_path / "d", half, "fp")] == \
        [r["messages"] for r in one[:2]]
    assert magpie.cached_prompts(tmp_path / "e", half, "another target") is None
    from_shipped = generate_prompts(llm, tmp_path / "c", small, "fp", batch=8)
    resumed = generate_prompts(llm, tmp_path / "b", small, "fp", batch=8)
    assert [r["messages"] for r in resumed] == [r["messages"] for r in one] and len(one) == 4
    assert [r["messages"] for r in from_shipped] == [r["messages"] for r in one]
    texts = [r["messages"][0]["content"] for r in one]
    assert len(set(texts)) == 4 and all(len(t.split()) >= 3 for t in texts)
    assert {r["split"] for r in one} <= {"train", "heldout"} and all(r["id"] >= 1_000_000 for r in one)
    rep = report(tmp_path / "a")
    assert rep["kept"] == 4 and rep["tried"] >= 4 and rep["prompts_per_s"] > 0
    with pytest.raises(InputError, match="temperature"):
        generate_prompts(llm, tmp_path / "a", MagpieSettings(count=4, max_tokens=32, temperature=1.0), "fp")
