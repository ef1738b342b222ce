"""Per-request sampling parameters, sampling state, results, stream events, and the text side of a request
(detokenize + stop strings)."""

from __future__ import annotations

import secrets
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from specair.compile.catalog import uniform_dtype
from specair.graphs.sampling import position_uniforms, sampling_variant
from specair.models.errors import InputError
from specair.runtime.detokenize import IncrementalDetokenizer


MIN_TEMPERATURE, MAX_TEMPERATURE = 0.01, 1e4  # vLLM's floor; above the ceiling sampling is uniform already


@dataclass(frozen=True)
class SamplingParams:
    """What to generate: vLLM/OpenAI semantics (temperature 0 is greedy; top_k 0 and top_p 1 disable)."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InputError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        # Bounded so that logits / temperature stays finite in every model dtype (float16 included): a
        # temperature of 1e307 overflowed the sampling tensors and failed the whole batch's step.
        if not (isinstance(self.temperature, (int, float)) and (self.temperature == 0
                or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE)):
            raise InputError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE:g}], "
                             f"got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise InputError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InputError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InputError("stop strings must be non-empty strings")


@dataclass
class GenerationResult:
    """One finished request, in the shape `specair generate --json` prints."""

    text: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_generated_tokens: int
    finish_reason: str  # "stop" (EOS or a stop string), "length", "abort", or "error" (extra["error"] says why)
    ttft_s: float
    decode_tokens_per_s: float
    prefill_tokens_per_s: float
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (vLLM's name)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(d.pop("extra"))
        return d


@dataclass
class StreamEvent:
    """A streamed piece of a request: new text and tokens; `result` is set on the last event."""

    text: str
    token_ids: list[int]
    result: GenerationResult | None = None
    request_id: str = ""
    draft: tuple[int, int] | None = None  # (proposed, accepted) draft tokens when these came from one speculative step


class SamplingState:
    """Per-request sampling state the engine reads: sampling tensors and the seed (drawn at random when the
    request gives none)."""

    def __init__(self, params: SamplingParams, dtype: torch.dtype) -> None:
        self.params = params
        self.seed = secrets.randbits(63) if params.seed is None else params.seed
        self.temperature = torch.tensor([float(params.temperature)], dtype=dtype)
        self.top_k = torch.tensor([params.top_k])
        self.top_p = torch.tensor([float(params.top_p)], dtype=dtype)
        self.uniform_dtype = uniform_dtype(dtype)
        self.variant = sampling_variant([params.temperature], [params.top_k], [params.top_p])
        self.filtered = self.variant == "filtered"

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0

    def uniforms(self, position: int, n: int = 1) -> Tensor:
        """The uniforms [n] that decide this request's tokens at positions position .. position + n - 1."""
        return position_uniforms(self.seed, np.arange(position, position + n), self.uniform_dtype)


class TextAssembler:
    """Streams a request's text: UTF-8-safe deltas, cut at the first stop string, never showing text
    that a stop string might still claim (a suffix that is a prefix of one is held back)."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], stop: Sequence[str]) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids) if tokenizer is not None else None
        self.stop = tuple(stop)
        self.text = ""  # all text decoded so far
        self.sent = 0  # characters of `text` already emitted
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Append a token; return the newly safe text. Sets `stopped` when a stop string appears."""
        if self.detok is None:
            return ""
        self.text += self.detok.add(token_id)
        return self._emit()

    def finish(self) -> str:
        """The rest of the text once generation ends."""
        if self.detok is not None and not self.stopped:
            self.text += self.detok.flush()
        return self._emit(final=True)

    def _emit(self, final: bool = False) -> str:
        if self.stopped:
            return ""
        safe = len(self.text)
        if self.stop:
            start = max(0, self.sent - max(map(len, self.stop)))
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text, self.stopped, safe = self.text[:min(hits)], True, min(hits)
            elif not final:
                safe = len(self.text) - _held_back(self.text, self.stop)
        out, self.sent = self.text[self.sent:safe], max(self.sent, safe)
        return out


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
