"""On the real default model (SmolLM2-135M-Instruct Q4_1 GGUF): parity with transformers' GGUF load,
greedy chat output, streaming text and stop strings through the engine, and the CLI. (Speculation on the
default model, layer skip included, is tested in tests/test_proposers.py.)"""

import json
import subprocess
import sys

import pytest
import torch

from specair.models.checkpoint import load_checkpoint
from specair.models.llama import build_model
from specair.runtime.detokenize import IncrementalDetokenizer
from specair.runtime.build import engine_from_models
from specair.runtime.llm import LLM
from specair.runtime.params import SamplingParams, TextAssembler

CHATS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Give me three tips for writing clean Python code.",
]


@pytest.fixture(scope="module")
def ours(default_hf_dir):
    ckpt = load_checkpoint(default_hf_dir, progress=False)
    return build_model(ckpt.config, ckpt.state_dict), ckpt.tokenizer


def chat_ids(tok, text):
    return tok.encode_chat([{"role": "user", "content": text}])


def test_logits_close_to_transformers_gguf(ours, hf_gguf):
    model, tok = ours
    ids = torch.tensor([chat_ids(tok, CHATS[0])])
    with torch.no_grad():
        ref = hf_gguf(ids).logits
    k, v = model.empty_cache(1, 128)
    out = model(ids, torch.arange(ids.shape[1])[None], torch.zeros(1, dtype=torch.long), k, v)
    assert (out.logits - ref).abs().max().item() < 1e-3
    assert torch.equal(out.logits.argmax(-1), ref.argmax(-1))


def test_greedy_chat_text_equals_transformers(ours, hf_gguf):
    model, tok = ours
    llm = LLM.from_engine(engine_from_models(model, tok, max_context=1024))
    for text in CHATS:
        ids = chat_ids(tok, text)
        with torch.no_grad():
            ref = hf_gguf.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)[0, len(ids):]
        res = llm.generate(ids, SamplingParams(max_tokens=40))[0]
        assert res.token_ids == ref.tolist()[:len(res.token_ids)]
        assert res.text == tok.decode(ref.tolist())


def test_streamed_text_is_utf8_safe_and_complete(ours):
    _, tok = ours
    text = "naïve café — 🌍🚀 世界你好 👩‍💻 done"
    ids = tok.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids), "the text should split characters across tokens"
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_stop_strings_cut_the_text_and_hold_back_prefixes(ours):
    _, tok = ours
    ids = tok.encode("alpha beta gamma delta", add_special_tokens=False)
    asm = TextAssembler(tok, [], stop=["gamma d"])
    shown = ""
    for i in ids:
        shown += asm.add(i)
        assert "gam" not in shown
        if asm.stopped:
            break
    shown += asm.finish()
    assert asm.stopped and shown == asm.text == "alpha beta "


def test_stream_adds_up_and_stop_strings_cut_it(ours):
    model, tok = ours
    llm = LLM.from_engine(engine_from_models(model, tok, max_context=512))
    ids = chat_ids(tok, CHATS[1])
    params = SamplingParams(max_tokens=24)
    events = list(llm.stream(ids, params))
    res = events[-1].result
    assert res is not None and all(e.result is None for e in events[:-1])
    assert "".join(e.text for e in events) == res.text
    assert [t for e in events for t in e.token_ids] == res.token_ids
    # A word of that text as a stop string: the request ends there, the text is cut just before it, and the
    # streamed pieces add up to the cut text (none showed the stop string).
    words = res.text.split()
    assert len(words) >= 4, res.text
    stop = words[2]
    cut = res.text.index(stop)
    events = list(llm.stream(ids, SamplingParams(max_tokens=24, stop=(stop,))))
    stopped = events[-1].result
    assert stopped.finish_reason == "stop" and stopped.text == res.text[:cut]
    assert "".join(e.text for e in events) == stopped.text
    assert stopped.token_ids == res.token_ids[:len(stopped.token_ids)] and len(stopped.token_ids) < len(res.token_ids)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "specair.runtime.cli", *args], capture_output=True, text=True,
                          timeout=600)


def test_cli_generate_json(default_hf_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "The sky is"}) + "\n" +
                       json.dumps({"messages": [{"role": "user", "content": "Say hi."}]}) + "\n")
    r = run_cli("generate", "--model", str(default_hf_dir), "--prompts", str(prompts), "--max-tokens", "8",
                "--json", "--backend", "eager", "--speculative-config",
                '{"method": "layer_skip", "num_layers": 8, "num_speculative_tokens": 3}')
    assert r.returncode == 0, r.stderr
    recs = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(recs) == 2
    for rec in recs:
        assert set(rec) >= {"text", "token_ids", "num_prompt_tokens", "num_generated_tokens", "finish_reason",
                            "ttft_s", "decode_tokens_per_s", "spec"}
        assert rec["num_generated_tokens"] == len(rec["token_ids"]) <= 8
        assert set(rec["spec"]) == {"num_drafts", "num_draft_tokens", "num_accepted_tokens",
                                    "accepted_per_position", "mean_accepted_length"}


@pytest.mark.parametrize("args,needle", [
    (["--model", "/nonexistent/model", "--prompt", "x"], "nonexistent"),
    (["--prompt-ids", "[1, 2,", "--model", "{hf}"], "--prompt-ids"),
    (["--prompt", "x", "--temperature", "-1"], "temperature"),
    (["--prompt", "x", "--speculative-config", '{"method": "nope"}'], "method"),
    (["--prompt-ids", "[" + ", ".join(["1"] * 9000) + "]", "--model", "{hf}"], "context holds"),
])
def test_cli_bad_input_is_a_clear_error(default_hf_dir, args, needle):
    r = run_cli("generate", "--backend", "eager", *[a.replace("{hf}", str(default_hf_dir)) for a in args])
    assert r.returncode == 2
    assert needle in r.stderr and "Traceback" not in r.stderr
