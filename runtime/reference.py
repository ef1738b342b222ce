"""Eager decoding of one sequence at a time over static, preallocated KV caches.

`Decoder` owns what every decoding method shares (prompt checks, chunked prefill, stop conditions,
text streaming, timing); `ReferenceDecoder` is plain autoregressive decoding, the baseline every
speculative configuration is tested and measured against.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor

from specair.graphs.sampling import sample, sampling_variant
from specair.graphs.kv import commit_kv
from specair.graphs.steps import decode_step, prefill_chunk
from specair.models.errors import InputError
from specair.models.llama import Transformer
from specair.runtime.params import GenerationResult, SamplingParams, TextAssembler

MIN_CONTEXT_BUCKET = 64


@dataclass
class StreamEvent:
    """A streamed piece of a request: new text and tokens; `result` is set on the last event."""

    text: str
    token_ids: list[int]
    result: GenerationResult | None = None


def context_bucket(needed: int, slots: int) -> int:
    """The smallest power of two (>= MIN_CONTEXT_BUCKET) holding `needed` slots, capped at the cache size."""
    bucket = MIN_CONTEXT_BUCKET
    while bucket < needed:
        bucket *= 2
    return min(bucket, slots)


class Request:
    """Per-request state the decoding methods read: sampling tensors and the seeded uniform source."""

    def __init__(self, params: SamplingParams, dtype: torch.dtype) -> None:
        self.params = params
        self.gen = torch.Generator()
        if params.seed is None:
            self.gen.seed()
        else:
            self.gen.manual_seed(params.seed)
        self.temperature = torch.tensor([float(params.temperature)], dtype=dtype)
        self.top_k = torch.tensor([params.top_k])
        self.top_p = torch.tensor([float(params.top_p)], dtype=dtype)
        self.variant = sampling_variant([params.temperature], [params.top_k], [params.top_p])
        self.filtered = self.variant == "filtered"

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0

    def uniforms(self, *shape: int) -> Tensor:
        return torch.rand(1, *shape, generator=self.gen, dtype=torch.float64)


class Decoder:
    """Shared decoding loop; subclasses implement `_start` (after the prompt) and `_step` (more tokens)."""

    def __init__(self, model: Transformer, tokenizer: Any = None, max_context: int | None = None,
                 prefill_chunk_size: int = 128, spare_slots: int = 0) -> None:
        cfg = model.config
        self.model, self.tokenizer = model, tokenizer
        self.max_context = min(max_context or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.chunk = prefill_chunk_size
        # Spare slots past the context take a padded prefill chunk's K/V and speculative scratch.
        self.slots = self.max_context + max(self.chunk, spare_slots)
        self.k_cache, self.v_cache = model.empty_cache(1, self.slots)
        eos = set(cfg.eos_token_ids) | set(getattr(tokenizer, "eos_token_ids", ()) or ())
        self.eos_ids = frozenset(eos)

    def check_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        """Validate token ids against the vocabulary and the context; return them as a list."""
        ids = list(prompt_ids)
        if not ids:
            raise InputError("the prompt is empty")
        V = self.model.config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < V]
        if bad:
            raise InputError(f"token ids must be integers in [0, {V}); got {bad[:5]}")
        if len(ids) >= self.max_context:
            raise InputError(f"the prompt has {len(ids)} tokens but the context holds {self.max_context} "
                             f"(prompt plus at least one generated token)")
        return ids

    def prefill(self, ids: list[int], model: Transformer | None = None,
                caches: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """Run ids through a model (the target by default) in fixed-size chunks; return the last logits [1, V]."""
        model = model or self.model
        k_cache, v_cache = caches or (self.k_cache, self.v_cache)
        logits = None
        for start in range(0, len(ids), self.chunk):
            piece = ids[start:start + self.chunk]
            tokens = torch.zeros(1, self.chunk, dtype=torch.long)
            tokens[0, :len(piece)] = torch.tensor(piece)
            ctx = context_bucket(start + self.chunk, self.slots)
            logits, _, new_k, new_v = prefill_chunk(model, tokens, torch.tensor([start]), torch.tensor([len(piece)]),
                                                    k_cache, v_cache, ctx)
            commit_kv(k_cache, v_cache, new_k, new_v, torch.arange(start, start + self.chunk).unsqueeze(0))
        return logits

    def _start(self, ids: list[int], req: Request) -> int:
        """Prefill the prompt; return the first generated token."""
        logits = self.prefill(ids)
        return int(sample(logits, req.temperature, req.top_k, req.top_p, req.uniforms(), req.variant).item())

    def _step(self, seq: list[int], req: Request) -> list[int]:
        """Given the sequence so far (its last token not yet in the cache), return the next tokens."""
        raise NotImplementedError

    def _decode_one(self, seq: list[int], req: Request) -> list[int]:
        """One autoregressive target step."""
        pos = len(seq) - 1
        ctx = context_bucket(pos + 1, self.slots)
        token, _, new_k, new_v = decode_step(self.model, torch.tensor([seq[-1]]), torch.tensor([pos]), self.k_cache,
                                             self.v_cache, req.temperature, req.top_k, req.top_p, req.uniforms(), ctx,
                                             req.variant)
        commit_kv(self.k_cache, self.v_cache, new_k, new_v, torch.tensor([[pos]]))
        return [int(token.item())]

    def _stats(self) -> dict[str, Any]:
        return {}

    @torch.inference_mode()
    def stream(self, prompt_ids: Sequence[int], params: SamplingParams = SamplingParams()) -> Iterator[StreamEvent]:
        """Generate for one prompt, yielding text deltas; the last event carries the GenerationResult."""
        ids = self.check_prompt(prompt_ids)
        t0 = time.perf_counter()
        req = Request(params, self.model.dtype)
        text = TextAssembler(self.tokenizer, ids, params.stop)
        budget = min(params.max_tokens, self.max_context - len(ids))
        new = [self._start(ids, req)]
        t_first = time.perf_counter()
        seq, out, finish, delta = ids + new, [], "length", ""
        while True:
            batch, done = [], False
            for tok in new:
                out.append(tok)
                batch.append(tok)
                delta += text.add(tok)
                if tok in self.eos_ids and not params.ignore_eos or text.stopped:
                    finish, done = "stop", True
                    break
                if len(out) >= budget:
                    done = True
                    break
            if done:
                break
            yield StreamEvent(delta, batch)
            delta = ""
            new = self._step(seq, req)
            seq.extend(new)
        t_end = time.perf_counter()
        delta += text.finish()
        n = len(out)
        result = GenerationResult(
            text=text.text, token_ids=out, num_prompt_tokens=len(ids), num_generated_tokens=n,
            finish_reason=finish, ttft_s=t_first - t0,
            decode_tokens_per_s=(n - 1) / (t_end - t_first) if n > 1 and t_end > t_first else 0.0,
            prefill_tokens_per_s=len(ids) / (t_first - t0), extra=self._stats(),
        )
        yield StreamEvent(delta, batch, result)

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams = SamplingParams()) -> GenerationResult:
        """Generate for one prompt and return the finished result."""
        for event in self.stream(prompt_ids, params):
            if event.result is not None:
                return event.result
        raise AssertionError("stream ended without a result")


class ReferenceDecoder(Decoder):
    """Autoregressive decoding: one target pass per token."""

    def _step(self, seq: list[int], req: Request) -> list[int]:
        return self._decode_one(seq, req)
