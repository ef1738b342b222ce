"""Decoding of one sequence at a time over static, preallocated KV caches.

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

from specair.compile.artifacts import GraphSet
from specair.compile.backends import get_backend
from specair.compile.catalog import Catalog, uniform_dtype
from specair.compile.plan import VARIANTS, Plan
from specair.compile.spec_config import SpeculativeConfig
from specair.graphs.kv import commit_kv
from specair.graphs.sampling import sample, sampling_variant
from specair.models.errors import InputError
from specair.models.llama import Transformer
from specair.runtime.params import GenerationResult, SamplingParams, TextAssembler


@dataclass
class StreamEvent:
    """A streamed piece of a request: new text and tokens; `result` is set on the last event."""

    text: str
    token_ids: list[int]
    result: GenerationResult | None = None
    request_id: str = ""
    draft: tuple[int, int] | None = None  # (proposed, accepted) draft tokens when these came from one speculative step


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
        self.uniform_dtype = uniform_dtype(dtype)
        self.variant = sampling_variant([params.temperature], [params.top_k], [params.top_p])
        self.filtered = self.variant == "filtered"

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0

    def uniforms(self, *shape: int) -> Tensor:
        return torch.rand(1, *shape, generator=self.gen, dtype=self.uniform_dtype)


class Decoder:
    """Shared decoding loop; subclasses implement `_start` (after the prompt) and `_step` (more tokens).

    Every graph runs through a GraphSet by key, so the same loop serves eager graphs, graphs compiled
    on first use, and precompiled artifacts.
    """

    def __init__(self, model: Transformer, tokenizer: Any = None, max_context: int | None = None,
                 prefill_chunk_size: int = 128, *, draft: Transformer | None = None,
                 speculative: SpeculativeConfig | None = None, backend: str = "eager",
                 graphs: GraphSet | None = None) -> None:
        cfg = model.config
        self.model, self.tokenizer, self.draft = model, tokenizer, draft
        if graphs is None:
            plan = Plan(max_context=min(max_context or cfg.max_position_embeddings, cfg.max_position_embeddings),
                        batch_buckets=(1,), prefill_chunk=prefill_chunk_size, variants=VARIANTS,
                        speculative=speculative)
            graphs = GraphSet(Catalog(model, plan, draft), get_backend(backend), None, lazy=True)
        self.graphs, self.plan, self.catalog = graphs, graphs.plan, graphs.catalog
        self.max_context, self.chunk = self.plan.max_context, self.plan.prefill_chunk
        with torch.inference_mode():  # like every graph input: compiled graphs guard on the tensor kind
            self.k_cache, self.v_cache = model.empty_cache(1, self.plan.slots)
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

    @torch.inference_mode()
    def prefill(self, ids: list[int], role: str = "target") -> Tensor:
        """Run ids through the target (or the draft) in fixed-size chunks; return the last logits [1, V]."""
        k_cache, v_cache = (self.k_cache, self.v_cache) if role == "target" else self.draft_caches
        logits = None
        for start in range(0, len(ids), self.chunk):
            piece = ids[start:start + self.chunk]
            tokens = torch.zeros(1, self.chunk, dtype=torch.long)
            tokens[0, :len(piece)] = torch.tensor(piece)
            key = self.catalog.key(f"prefill.{role}", 1, self.plan.context_bucket(max(start, 1)))
            logits, _, new_k, new_v = self.graphs(key, tokens, torch.tensor([start]), torch.tensor([len(piece)]),
                                                  k_cache, v_cache)
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
        key = self.catalog.key("decode", 1, self.plan.context_bucket(pos), self.plan.variant_for(req.variant))
        token, _, _, new_k, new_v = self.graphs(key, torch.tensor([seq[-1]]), torch.tensor([pos]), self.k_cache,
                                             self.v_cache, req.temperature, req.top_k, req.top_p, req.uniforms())
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
