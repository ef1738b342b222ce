"""Tokenizers (HF `tokenizer.json` dirs and GGUF metadata) and chat templates rendered like transformers."""

from __future__ import annotations

import json
import warnings
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from specair.models.config import read_json_object
from specair.models.errors import InputError, ModelFormatError

if TYPE_CHECKING:
    import gguf

# llama.cpp's token types (llama_token_type / gguf.TokenType).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` -> the regexes llama.cpp applies in turn (llama-vocab.cpp), each one splitting
# the pieces the previous one left. A missing or unlisted name gets GPT-2's split, as in transformers
# (llama.cpp falls back to a cruder regex chain and warns that quality degrades).
_GGUF_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    **{name: (_LLAMA3_SPLIT,) for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx")},
    **{name: (_QWEN2_SPLIT,) for name in ("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez")},
    **{name: (r"\p{N}", _GPT2_SPLIT) for name in ("smollm", "starcoder", "refact", "command-r", "codeshell")},
    **{name: (_GPT2_SPLIT,) for name in ("default", "gpt-2", "gpt2", "mpt", "olmo", "jais")},
}


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _special_content(value: Any) -> str | None:
    """A special token as `tokenizer_config.json` spells it: a string or a serialized AddedToken."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """A `tokenizers` backend plus the special tokens and chat template a model needs."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        add_bos_token: bool = False,
        chat_template: str | None = None,
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.add_bos_token = bool(add_bos_token)
        self.chat_template = chat_template
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def _token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    @property
    def special_tokens(self) -> dict[str, str]:
        """`bos_token`, `eos_token`, `unk_token`, `pad_token` strings (those that exist), as templates see them."""
        ids = {
            "bos_token": self.bos_token_id,
            "eos_token": self.eos_token_ids[0] if self.eos_token_ids else None,
            "unk_token": self.unk_token_id,
            "pad_token": self.pad_token_id,
        }
        return {k: t for k, i in ids.items() if (t := self._token(i)) is not None}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text are matched whole. Prepends BOS only if
        `add_special_tokens` and the model's tokenizer asks for it (`add_bos_token`)."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids` (special tokens dropped unless `skip_special_tokens=False`)."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_bytes(self, vocab_size: int) -> tuple[list[bytes], str]:
        """Each token id's bytes (empty for special tokens, which decoding skips), and how they were got:
        "byte_level" (exact: byte-level BPE) or "per_token" (each token decoded alone; exact for byte-fallback
        SentencePiece except its leading-space strip)."""
        spec = json.loads(self.backend.to_str())
        special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        decoder = spec.get("decoder") or {}
        out = [b""] * vocab_size
        if "ByteLevel" in {d.get("type") for d in decoder.get("decoders", [decoder])}:
            inverse = {c: b for b, c in _byte_alphabet().items()}
            for piece, i in self.backend.get_vocab(with_added_tokens=True).items():
                if i < vocab_size and i not in special:
                    out[i] = bytes(inverse[c] for c in piece) if set(piece) <= inverse.keys() else piece.encode()
            return out, "byte_level"
        for i in range(vocab_size):
            if i in special:
                continue
            piece = self.backend.id_to_token(i) or ""
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                out[i] = bytes.fromhex(piece[3:5])
            else:
                out[i] = self.backend.decode([i], skip_special_tokens=True).encode()
        return out, "per_token"

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render `messages` with the model's chat template as transformers' `apply_chat_template(tokenize=False)` does.

        Extra keyword arguments (e.g. `tools`) are passed to the template.
        """
        import jinja2

        if not self.chat_template:
            raise InputError("this model has no chat template; send a plain prompt instead of chat messages")
        template = _compile_template(self.chat_template)
        try:
            variables = {**self.special_tokens, **kwargs}
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:
            raise InputError(f"the chat template rejected these messages: {e}") from None

    def encode_chat(self, messages: list[dict], **kwargs: Any) -> list[int]:
        """Token ids of a conversation rendered by the chat template (the template writes BOS itself)."""
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)

    def save(self, directory: str | Path) -> None:
        """Write `tokenizer.json` and `tokenizer_config.json` in the layout transformers reads."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(d / "tokenizer.json"))
        cfg: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **{k: self.special_tokens.get(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")},
            "add_bos_token": self.add_bos_token,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
        }
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    @classmethod
    def from_hf_dir(cls, directory: str | Path) -> "Tokenizer | None":
        """Load an HF tokenizer dir (`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`);
        None if it has no `tokenizer.json`."""
        d = Path(directory)
        if not (d / "tokenizer.json").is_file():
            return None
        try:
            backend = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise ModelFormatError(f"{d / 'tokenizer.json'}: cannot load tokenizer ({e})") from None
        cfg = read_json_object(d / "tokenizer_config.json") if (d / "tokenizer_config.json").is_file() else {}

        def token_id(key: str) -> int | None:
            content = _special_content(cfg.get(key))
            return None if content is None else backend.token_to_id(content)

        bos = token_id("bos_token")
        # Stop tokens: the tokenizer's EOS first, then those generation_config.json / config.json add (Llama 3).
        eos = [token_id("eos_token")]
        for name in ("generation_config.json", "config.json"):
            if (d / name).is_file():
                value = read_json_object(d / name).get("eos_token_id")
                eos += value if isinstance(value, list) else [value]
        eos_ids = [int(i) for i in eos if isinstance(i, int)]

        add_bos = cfg.get("add_bos_token")
        if add_bos is None:  # no flag: the tokenizer.json post-processor decides (Llama 3 adds BOS there)
            with_special, plain = (backend.encode("a", add_special_tokens=s).ids[:1] for s in (True, False))
            add_bos = bos is not None and with_special == [bos] and plain != [bos]

        template = cfg.get("chat_template")
        if (d / "chat_template.jinja").is_file():  # transformers 5 saves it here, and it wins
            template = (d / "chat_template.jinja").read_text(encoding="utf-8")
        elif isinstance(template, list):  # [{name, template}, ...]: the "default" one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default", next(iter(named.values()), None))
        return cls(backend, bos, eos_ids, bool(add_bos), template if isinstance(template, str) else None,
                   pad_token_id=token_id("pad_token"), unk_token_id=token_id("unk_token"))

    @classmethod
    def from_gguf(cls, reader: "gguf.GGUFReader") -> "Tokenizer":
        """Build the tokenizer a GGUF file describes in its `tokenizer.*` metadata, as llama.cpp would run it."""

        def meta(key: str, default: Any = None) -> Any:
            field = reader.fields.get(key)
            return default if field is None else field.contents()

        kind = meta("tokenizer.ggml.model")
        tokens: list[str] | None = meta("tokenizer.ggml.tokens")
        if not tokens:
            raise ModelFormatError("GGUF file has no tokenizer vocabulary (tokenizer.ggml.tokens)")
        types = meta("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
        add_space_prefix = meta("tokenizer.ggml.add_space_prefix", True)
        if kind == "gpt2":
            backend = _byte_level_bpe(tokens, types, meta("tokenizer.ggml.merges"), meta("tokenizer.ggml.pre"))
            default_add_bos = False
        elif kind == "llama":
            backend = _sentencepiece_bpe(tokens, types, meta("tokenizer.ggml.scores"),
                                         meta("tokenizer.ggml.unknown_token_id"), add_space_prefix)
            default_add_bos = True  # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise
        else:
            raise ModelFormatError(
                f"GGUF tokenizer kind {kind!r} is not supported; "
                "specair reads 'gpt2' (byte-level BPE) and 'llama' (sentencepiece)"
            )
        eos = [meta("tokenizer.ggml.eos_token_id"), meta("tokenizer.ggml.eot_token_id")]
        return cls(
            backend,
            bos_token_id=meta("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[i for i in eos if i is not None],
            add_bos_token=meta("tokenizer.ggml.add_bos_token", default_add_bos),
            chat_template=meta("tokenizer.chat_template"),
            pad_token_id=meta("tokenizer.ggml.padding_token_id"),
            unk_token_id=meta("tokenizer.ggml.unknown_token_id"),
        )


def _add_gguf_added_tokens(backend: tokenizers.Tokenizer, tokens: list[str], types: list[int]) -> None:
    """CONTROL (and UNKNOWN) tokens become special added tokens, USER_DEFINED ones plain added tokens, matched
    whole in the raw text like llama.cpp does. They already have their id in the vocabulary."""
    pairs = list(zip(tokens, types))
    special = [AddedToken(t, normalized=False, special=True) for t, k in pairs if k in (_CONTROL, _UNKNOWN)]
    plain = [AddedToken(t, normalized=False, special=False) for t, k in pairs if k == _USER_DEFINED]
    backend.add_special_tokens(special)
    backend.add_tokens(plain)


def _byte_level_bpe(tokens: list[str], types: list[int], merges: list[str] | None,
                    pre: str | None) -> tokenizers.Tokenizer:
    if not merges:
        raise ModelFormatError("GGUF byte-level BPE tokenizer has no merges (tokenizer.ggml.merges)")
    alphabet = _byte_alphabet()
    letters = set(alphabet.values())
    vocab: dict[str, int] = {}
    for i, (t, k) in enumerate(zip(tokens, types)):
        # Normal tokens are spelled in the byte alphabet; a few converters write some raw: respell those.
        if k in (_NORMAL, _BYTE, _UNUSED) and not set(t) <= letters:
            t = "".join(alphabet[b] for b in t.encode("utf-8"))
        vocab.setdefault(t, i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, continuing_subword_prefix="", end_of_word_suffix="")
    )
    splits = _GGUF_PRE_SPLITS.get(pre or "default")
    if splits is None:
        warnings.warn(f"GGUF pre-tokenizer {pre!r} is unknown to specair; splitting text like GPT-2", stacklevel=3)
        splits = (_GPT2_SPLIT,)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    _add_gguf_added_tokens(backend, tokens, types)
    return backend


def _sentencepiece_bpe(tokens: list[str], types: list[int], scores: list[float] | None, unk_id: int | None,
                       add_space_prefix: bool) -> tokenizers.Tokenizer:
    """A sentencepiece (llama.cpp SPM) vocabulary as BPE with byte fallback, as transformers' converter builds it:
    merges ranked by the score of the token they make."""
    if scores is None:
        raise ModelFormatError("GGUF sentencepiece tokenizer has no token scores (tokenizer.ggml.scores)")
    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}
    merges = []
    for t, score in zip(tokens, scores):
        local = [(t[:j], t[j:], score) for j in range(1, len(t)) if t[:j] in vocab and t[j:] in vocab]
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=[(a, b) for a, b, _ in merges], unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    # llama.cpp's SPM tokenizer (and sentencepiece's add_dummy_prefix) puts a space before every run of text
    # that starts the input or follows a special token, also one starting with a space (" hi" -> "▁▁hi"),
    # which Metaspace's prepend schemes skip; a normalizer runs on each run between added tokens.
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁")] * add_space_prefix + [normalizers.Replace(" ", "▁")])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
    _add_gguf_added_tokens(backend, tokens, types)
    return backend


@lru_cache(maxsize=16)
def _compile_template(source: str) -> Any:
    """Compile a chat template in the sandboxed environment transformers uses."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # transformers' tojson: no HTML escaping, unlike jinja's
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ModelFormatError(f"the model's chat template is not valid jinja: {e}") from None
