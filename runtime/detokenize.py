"""Streaming detokenization that never splits a multi-byte UTF-8 character across deltas."""

from __future__ import annotations

from typing import Protocol, Sequence

# Tokens of context decoded with each delta: enough for decoders that drop a leading space
# (SentencePiece) or merge across token boundaries to render the new token as it appears in full text.
_CONTEXT = 5


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas whose concatenation is the decoded text.

    A delta is held back while the decoded tail ends in U+FFFD, i.e. while a character's bytes are
    still arriving across tokens (byte-level BPE splits emoji and CJK that way).
    """

    def __init__(self, tokenizer: _Decoder, prompt_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty)."""
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return text[len(prefix):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end renders as U+FFFD)."""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix):] if len(text) > len(prefix) else ""
