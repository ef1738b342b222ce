"""The Python API, in the spirit of `vllm.LLM`: load once, then generate, stream or chat."""

from __future__ import annotations

from typing import Any, Iterator, Sequence

from tqdm import tqdm

from specair.models.errors import InputError
from specair.runtime.build import AUTO, open_engine
from specair.runtime.engine import Engine
from specair.runtime.params import GenerationResult, SamplingParams, StreamEvent

Prompt = str | Sequence[int]


class LLM:
    """A model (the default SmolLM2-135M-Instruct when `model` is None), optionally with a proposer, behind
    an engine that batches requests continuously over `batch_buckets`; with `tensor_parallel_size` N, over N
    processes, each holding a shard of the model.

    >>> llm = LLM(speculative_config={"method": "eagle", "num_speculative_tokens": 4})
    >>> llm.chat([{"role": "user", "content": "Hi!"}])[0].text
    """

    def __init__(self, model: str | None = None, speculative_config: dict | str | None = AUTO, *,
                 backend: str = AUTO, artifacts: str | None = None, dtype: str = "fp32",
                 max_context: int | None = None, batch_buckets: tuple[int, ...] = (1, 2, 4, 8),
                 threads: int | None = None, max_waiting: int = 64, quantize: str | None = None,
                 device: str | None = None, features: tuple[int, ...] | None = None,
                 tensor_parallel_size: int = 1, kv_cache_memory_bytes: int | None = None,
                 enable_prefix_caching: bool = True) -> None:
        self.engine: Engine = open_engine(model, dtype, speculative_config, None if artifacts else backend,
                                          artifacts, max_context, threads, tuple(batch_buckets), max_waiting,
                                          quantize=quantize, device=device, features=features,
                                          tensor_parallel_size=tensor_parallel_size)
        try:
            self.engine.limit_kv_memory(kv_cache_memory_bytes)
        except InputError:
            self.engine.close()
            raise
        if not enable_prefix_caching:
            self.engine.prefix_cache = None
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (also done at interpreter exit)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @classmethod
    def from_engine(cls, engine: Engine) -> "LLM":
        """The API over an engine built elsewhere (e.g. `build.engine_from_models` over models in memory)."""
        llm = cls.__new__(cls)
        llm.engine, llm.tokenizer = engine, engine.tokenizer
        return llm

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt given as text or ids."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InputError("this checkpoint has no tokenizer; pass prompts as token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation through the model's chat template."""
        if self.tokenizer is None:
            raise InputError("this checkpoint has no tokenizer (and no chat template)")
        return self.tokenizer.encode_chat(messages)

    def generate(self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
                 *, use_tqdm: bool = False) -> list[GenerationResult]:
        """Generate for one prompt or many (batched by the engine); results in prompt order."""
        single = isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts
                                              and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)
        return self._run([self.encode(p) for p in batch], params, use_tqdm)

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             params: SamplingParams | list[SamplingParams] | None = None, *,
             use_tqdm: bool = False) -> list[GenerationResult]:
        """Generate replies to one conversation or many, through the model's chat template."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self._run([self.encode_chat(c) for c in convs], params, use_tqdm)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamEvent]:
        """Stream one request's text deltas; the last event carries its GenerationResult."""
        rid = self.engine.add_request(self.encode(prompt), params or SamplingParams())
        done = False
        try:
            while not done:
                for ev in self.engine.step():
                    if ev.request_id == rid:
                        done = ev.result is not None
                        yield ev
        finally:
            if not done:  # the caller stopped early: free the slot (this LLM is the engine's only consumer)
                self.engine.abort(rid)
                while not done:
                    done = any(ev.request_id == rid and ev.result is not None for ev in self.engine.step())

    def _run(self, ids: list[list[int]], params: Any, use_tqdm: bool) -> list[GenerationResult]:
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(ids)
        if len(plist) != len(ids):
            raise InputError(f"{len(plist)} sampling params for {len(ids)} prompts")
        for p in ids:
            self.engine.check_prompt(p)  # refuse a bad batch before any of it runs
        results: dict[str, GenerationResult] = {}
        order: list[str] = []
        queue = list(zip(ids, plist))
        bar = tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm)
        while queue or self.engine.has_unfinished():
            # Keep the queue no deeper than the engine allows; results come back in prompt order.
            while queue and self.engine.num_waiting < self.engine.max_waiting:
                order.append(self.engine.add_request(*queue.pop(0)))
            for ev in self.engine.step():
                if ev.result is not None:
                    results[ev.request_id] = ev.result
                    bar.update(1)
        bar.close()
        return [results[r] for r in order]
