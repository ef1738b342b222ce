"""Admission and the queue: requests in (thread-safe), one prefilling at a time, running rows out.

The running sequences are `rows` in row order: row i of every KV cache and batch-state tensor is
`rows[i]`. A finished row is filled by the last one, so running rows stay contiguous.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from specair.compile.plan import Plan
from specair.models.errors import InputError, SpecairError
from specair.runtime.params import SamplingParams, SamplingState, TextAssembler


class QueueFullError(SpecairError):
    """More requests are waiting than the engine queues."""


@dataclass
class Seq:
    """One request's state, from the queue to its last token."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    sampling: SamplingState
    text: TextAssembler
    budget: int  # tokens it may still generate in all
    t0: float
    tokens: list[int] = field(default_factory=list)  # prompt + generated; the last token is not in the cache yet
    out: list[int] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens in the scratch cache
    cached: int = 0  # of which the prefix cache gave
    t_first: float = 0.0
    draft: Any = None  # the proposer's own per-sequence state
    stats: dict[str, Any] = field(default_factory=dict)
    finish: str | None = None

    @property
    def committed(self) -> int:
        """Tokens whose K/V is in the target's cache (all but the last)."""
        return len(self.tokens) - 1


class Scheduler:
    """Requests from the queue to a row. `add` and `abort` are thread-safe; the rest runs on the engine's
    stepping thread."""

    def __init__(self, plan: Plan, vocab_size: int, tokenizer: Any, dtype: Any, max_waiting: int,
                 rows: list[Seq]) -> None:
        self.plan, self.vocab_size, self.tokenizer, self.dtype = plan, vocab_size, tokenizer, dtype
        self.num_slots, self.max_waiting, self.depth = plan.batch_buckets[-1], max_waiting, plan.max_depth
        self._lock = threading.Lock()
        self._inbox: list[Seq] = []
        self._aborts: set[str] = set()
        self._ids = itertools.count()
        self.waiting: deque[Seq] = deque()
        self.prefilling: Seq | None = None
        self.rows = rows  # the running batch in row order: read here, changed only by the engine with its caches
        # The most bytes the KV caches hold while these sequences run, each to its longest (set with a budget).
        self.kv_bytes: Callable[[list[Seq]], int] | None = None
        self.kv_budget: int | None = None

    def set_kv_budget(self, kv_bytes: Callable[[list[Seq]], int] | None, budget: int | None) -> None:
        """Admit a request only while kv_bytes(running + it) fits in budget bytes (None: no budget)."""
        self.kv_bytes, self.kv_budget = kv_bytes, budget

    def check_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        """The prompt as a list of ids; InputError if it is empty, outside the vocabulary or too long."""
        ids = list(prompt_ids)
        if not ids:
            raise InputError("the prompt is empty")
        V = self.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < V]
        if bad:
            raise InputError(f"token ids must be integers in [0, {V}); got {bad[:5]}")
        if len(ids) >= self.plan.max_context:
            raise InputError(f"the prompt has {len(ids)} tokens but the context holds {self.plan.max_context} "
                             f"(prompt plus at least one generated token)")
        return ids

    def add(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None) -> str:
        ids = self.check_prompt(prompt_ids)
        if not isinstance(params, SamplingParams):
            raise InputError(f"params must be SamplingParams, got {type(params).__name__}")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        s = self.make_seq(rid, ids, params)
        if self.kv_budget is not None and (need := self.kv_bytes([s])) > self.kv_budget:
            raise InputError(f"this request can grow to {len(ids) + s.budget} tokens, whose KV cache takes "
                             f"{need / 2**20:.0f} MiB, more than the KV cache budget of "
                             f"{self.kv_budget / 2**20:.0f} MiB; ask for fewer tokens or raise "
                             f"--kv-cache-memory-bytes")
        with self._lock:
            if len(self._inbox) + len(self.waiting) >= self.max_waiting + max(0, self.num_slots - self.num_running):
                raise QueueFullError(f"{self.max_waiting} requests are already waiting; try again later")
            self._inbox.append(s)
        return rid

    def make_seq(self, request_id: str, ids: list[int], params: SamplingParams) -> Seq:
        """A request's state (what a tensor-parallel worker rebuilds from the driver's message)."""
        sampling = SamplingState(params, self.dtype)
        self.plan.variant_for(sampling.variant)  # refuses sampling the plan has no graph for
        spec = self.plan.speculative
        if spec is not None and spec.acceptance == "greedy" and not sampling.greedy:
            raise InputError("this engine's acceptance is 'greedy', which needs temperature 0; "
                             "use acceptance 'exact' to sample")
        s = Seq(request_id, ids, params, sampling, TextAssembler(self.tokenizer, ids, params.stop),
                min(params.max_tokens, self.plan.max_context - len(ids)), time.perf_counter())
        if spec is not None:
            s.stats = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                       "accepted_per_position": [0] * self.depth}
        return s

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.add(request_id)

    def collect(self) -> set[str]:
        """Move new requests into the queue; return the aborts asked for since the last step."""
        with self._lock:
            self.waiting.extend(self._inbox)
            self._inbox.clear()
            aborts, self._aborts = self._aborts, set()
        return aborts

    def next_prefill(self) -> Seq | None:
        """The request to prefill: the one in progress, else the next waiting one if a row is free (and, with a
        KV budget, if the caches still fit it with every running request at its longest)."""
        if self.prefilling is None and self.waiting and len(self.rows) < self.num_slots and (
                self.kv_budget is None or self.kv_bytes([*self.rows, self.waiting[0]]) <= self.kv_budget):
            self.prefilling = self.waiting.popleft()
        return self.prefilling

    def follow_prefill(self, request_id: str, ids: list[int], params: SamplingParams) -> None:
        """A tensor-parallel worker: start prefilling the request the driver admitted."""
        self.prefilling = self.make_seq(request_id, ids, params)

    def end_prefill(self) -> None:
        """The prefilling request left the queue: its last chunk ran (it has a row now) or it failed."""
        self.prefilling = None

    def drop(self, s: Seq) -> None:
        """Forget a request that holds no row yet (waiting or prefilling), e.g. an aborted one."""
        if s is self.prefilling:
            self.prefilling = None
        else:
            self.waiting.remove(s)

    def find(self, rid: str) -> tuple[str, Seq, int] | None:
        """Where a request is: ("waiting" | "prefilling" | "running", its Seq, its row)."""
        for s in self.waiting:
            if s.request_id == rid:
                return "waiting", s, -1
        if self.prefilling is not None and self.prefilling.request_id == rid:
            return "prefilling", self.prefilling, -1
        for i, s in enumerate(self.rows):
            if s.request_id == rid:
                return "running", s, i
        return None

    @property
    def num_running(self) -> int:
        return len(self.rows) + (self.prefilling is not None)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self._inbox)

    def has_unfinished(self) -> bool:
        return bool(self.rows or self.prefilling or self.waiting or self._inbox or self._aborts)

    def speculates(self) -> bool:
        """Whether this step may speculate, as far as scheduling goes: not more rows than
        disable_by_batch_size, room in the context for the lookahead, and some row with more than one
        token of budget left."""
        spec = self.plan.speculative
        if spec is None:
            return False
        if spec.disable_by_batch_size is not None and len(self.rows) > spec.disable_by_batch_size:
            return False
        if any(len(s.tokens) + self.depth > self.plan.max_context for s in self.rows):
            return False
        return any(s.budget - len(s.out) > 1 for s in self.rows)

    def context_bucket(self) -> int:
        """The context bucket holding every running row's committed prefix."""
        return self.plan.context_bucket(max(max(s.committed for s in self.rows), 1))
