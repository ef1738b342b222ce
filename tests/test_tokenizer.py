"""specair's tokenizer against transformers' on the default model, plus chat templates and a sentencepiece GGUF."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
from tokenizers import pre_tokenizers

from specair.models.errors import InputError, ModelFormatError
from specair.models.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    'for (int i = 0; i < n; ++i) { s += a[i]; }  // C\n"quoted" \'single\' it\'s we\'re',
    "emoji 😀🎉 and a family 👨\u200d👩\u200d👧, flags 🇫🇷",
    "中文测试，日本語のテキスト、한국어 텍스트",
    "Ünïcödé àccents ß ø œ — “smart quotes” … ‘x’",
    "a   b    c\t\td\n\n\ne\r\nf",
    "   leading spaces",
    "trailing spaces   ",
    "\n\n\n",
    "",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>org/repo<file_sep>main.py",
    "not special: <|im_start without end, <im_end|>",
    "3.14159 1,000,000 x=42 2024-05-17 0xFF 1e-5 v1.2.3 #1",
    "1 22 333 4444",
]
# llama.cpp's "smollm" pre-tokenizer (and SmolLM2's own tokenizer.json) cuts every digit off first, so the
# spaces before a digit end up in a piece of their own: "x  1" -> "x", "ĠĠ", "1". transformers' GGUF
# tokenizer has no such rule and uses GPT-2's split alone: "x", "Ġ", "Ġ1" -> "x", "Ġ", "Ġ", "1" (the vocabulary
# has no "Ġ1" nor any multi-digit token, so digits alone never differ). Only whitespace runs before a digit do.
DIGIT_SPACE_TEXTS = ["x  1", "a   22 b\t\t3", "total:    100\n\n  7", "  42"]


@pytest.fixture(scope="module")
def ours(default_gguf):
    return Tokenizer.from_gguf(gguf.GGUFReader(str(default_gguf)))


@pytest.fixture(scope="module")
def hf(default_gguf):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name)


def test_metadata(ours):
    assert ours.vocab_size == 49152
    assert ours.bos_token_id == 1 and ours.eos_token_ids == (2,) and not ours.add_bos_token
    assert ours.special_tokens["eos_token"] == "<|im_end|>"
    assert "<|im_start|>" in ours.chat_template


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(ours, hf, text):
    # The text's own tokens; whether BOS goes first follows the GGUF's add_bos_token (test_metadata), which
    # transformers 5.5.4 (what the peers extra installs) does not follow when converting this file.
    assert ours.encode(text) == hf.encode(text, add_special_tokens=False)
    # clean_up_tokenization_spaces (on in transformers' conversion of this file, off in SmolLM2's own
    # tokenizer_config.json and absent from llama.cpp) rewrites the text (" 'single'" -> "'single'").
    assert ours.decode(ours.encode(text)) == hf.decode(hf.encode(text), skip_special_tokens=True,
                                                        clean_up_tokenization_spaces=False)


def test_digits_follow_llama_cpp_smollm_split(ours, hf):
    # Reference: the same vocabulary with SmolLM2's own pre-tokenizer (Digits(individual) + GPT-2 ByteLevel),
    # which is what llama.cpp's "smollm" regexes (\p{N}, then GPT-2's) compute.
    reference = type(hf.backend_tokenizer).from_str(hf.backend_tokenizer.to_str())
    reference.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    for text in TEXTS + DIGIT_SPACE_TEXTS:
        assert ours.encode(text) == reference.encode(text, add_special_tokens=False).ids, text
    pieces = [ours.backend.id_to_token(i) for i in ours.encode("x  1")]
    assert pieces == ["x", "ĠĠ", "1"]


@pytest.mark.parametrize("text", TEXTS + DIGIT_SPACE_TEXTS)
def test_round_trip(ours, text):
    assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


def test_special_tokens(ours):
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert ours.decode(ids) == "user\nhi"
    assert ours.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "Write a haiku about 中文 and 😀"},
        {"role": "assistant", "content": "Lines\n  of code"},
        {"role": "user", "content": "Another"},
    ],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, hf, messages, add_generation_prompt):
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == want


def test_save_and_load_hf_dir(ours, tmp_path):
    ours.save(tmp_path)
    back = Tokenizer.from_hf_dir(tmp_path)
    assert (back.bos_token_id, back.eos_token_ids, back.add_bos_token) == (1, (2,), False)
    assert back.chat_template == ours.chat_template and back.vocab_size == ours.vocab_size
    for text in TEXTS + DIGIT_SPACE_TEXTS:
        assert back.encode(text) == ours.encode(text)
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS + DIGIT_SPACE_TEXTS:
        assert theirs.encode(text) == ours.encode(text)
    assert Tokenizer.from_hf_dir(tmp_path / "nothing-here") is None


def test_hf_dir_template_sources_and_stop_tokens(ours, tmp_path):
    ours.save(tmp_path)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ bos_token }}"}]
    cfg_path.write_text(json.dumps(cfg))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.apply_chat_template([]) == "D<|im_start|>"
    assert tok.eos_token_ids == (2, 0)
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert Tokenizer.from_hf_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == "J1"


def _with_template(tok: Tokenizer, template: str | None) -> Tokenizer:
    return Tokenizer(tok.backend, tok.bos_token_id, tok.eos_token_ids, tok.add_bos_token, template)


def test_chat_template_environment(ours):
    tojson = _with_template(ours, "{{ messages[0] | tojson }}")
    assert tojson.apply_chat_template([{"role": "user", "content": "<b>&é"}]) == '{"role": "user", "content": "<b>&é"}'
    source = "{{ strftime_now('%Y') }}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
    year = _with_template(ours, source + "{{ m.content }}{% endfor %}")
    year = year.apply_chat_template([{"content": "a"}, {"content": "b"}])
    assert len(year) == 5 and year.endswith("a")
    with pytest.raises(InputError, match="alternate"):
        _with_template(ours, "{{ raise_exception('roles must alternate') }}").apply_chat_template([])
    with pytest.raises(InputError, match="no chat template"):
        _with_template(ours, None).apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ModelFormatError, match="not valid jinja"):
        _with_template(ours, "{% for %}").apply_chat_template([])
    with pytest.raises(Exception, match="unsafe|access"):  # the sandbox stays on
        _with_template(ours, "{{ messages.__class__.__mro__ }}").apply_chat_template([])


# ---- a sentencepiece ("llama") GGUF vocabulary, built here ----

SPM_PIECES = ["▁", "e", "h", "l", "o", "t", "w", "r", "d", "a", "n", "s", "▁t", "he", "▁the", "ll", "▁he",
              "llo", "▁hello", "▁w", "or", "ld", "orld", "▁world", "an", "▁a", "▁an", "nd", "▁and", "▁s", "▁▁"]


def _write_spm_gguf(path) -> None:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES + ["<|user|>"]
    types = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES) + [4]
    scores = [0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))] + [0.0]
    w = gguf.GGUFWriter(str(path), arch="llama")
    for key, value in dict(block_count=1, context_length=64, embedding_length=8, feed_forward_length=16,
                           head_count=2, head_count_kv=2, rope_dimension_count=4).items():
        getattr(w, f"add_{key}")(value)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_sentencepiece_gguf_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    _write_spm_gguf(tmp_path / "spm.gguf")
    ours = Tokenizer.from_gguf(gguf.GGUFReader(str(tmp_path / "spm.gguf")))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    assert ours.add_bos_token and ours.bos_token_id == 1 and ours.eos_token_ids == (2,)
    for text in ["hello world", "the hello and a world", " hello", "hello  world", "héllo wörld 😀",
                 "<s>hello</s>", "\nnew\tline", ""]:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text), skip_special_tokens=True), text
    assert [ours.backend.id_to_token(i) for i in ours.encode("hello world")] == ["<s>", "▁hello", "▁world"]
    assert [ours.backend.id_to_token(i) for i in ours.encode(" hello")] == ["<s>", "▁", "▁hello"]
    # A user-defined token (type 4) is matched in text, and the run after it takes the space prefix, as
    # llama.cpp's SPM tokenizer does; transformers' GGUF conversion leaves such tokens out of its added tokens.
    user = ours.backend.token_to_id("<|user|>")
    assert ours.encode("x<|user|>hello") == ours.encode("x") + [user] + ours.encode("hello")[1:]
    assert ours.decode(ours.encode("héllo wörld 😀")) == "héllo wörld 😀"


def test_unsupported_gguf_tokenizer_kind(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "bert.gguf"), arch="llama")
    w.add_tokenizer_model("bert")
    w.add_token_list(["[PAD]", "a"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFormatError, match="tokenizer kind 'bert'"):
        Tokenizer.from_gguf(gguf.GGUFReader(str(tmp_path / "bert.gguf")))
