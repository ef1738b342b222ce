"""The engine: continuous batching of requests over a fixed number of sequence slots, every step a few
precompiled graphs picked by batch bucket and context bucket.

A step is: abort what was asked, one decode or speculative step over the running rows, then one prefill
chunk of the next request (so a long prompt never stalls running ones). A speculative step is
propose → verify-and-accept (one graph) → commit, with one device→host read: the accepted tokens.
Its parts live beside it: `scheduler` (queue, admission), `kv_slots` (caches), `batch_state` (per-row
device tensors), `output` (text, stops, results) and the proposer (runtime/proposers).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, replace
from contextlib import nullcontext
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from specair.compile.artifacts import GraphSet
from specair.compile.graph_def import GraphKey
from specair.compile.plan import VARIANTS
from specair.graphs.sampling import sample, sampling_variant
from specair.models.errors import InputError, SpecairError
from specair.runtime.adaptive import AdaptiveSpeculation
from specair.runtime.batch_state import BatchState
from specair.runtime.kv_slots import KVSlots
from specair.runtime.output import Output, eos_ids
from specair.runtime.params import SamplingParams, StreamEvent
from specair.runtime.prefix_cache import PrefixCache
from specair.runtime.proposers import Proposer, Step
from specair.runtime.scheduler import QueueFullError, Scheduler, Seq  # noqa: F401 (QueueFullError: public)
from specair.runtime.tensor_parallel import Group


logger = logging.getLogger("specair.engine")


class EngineDiverged(SpecairError):
    """A tensor-parallel worker's state no longer matches the driver's."""


@dataclass(frozen=True)
class StepMeta:
    """What the driver decides before a step runs, and all a tensor-parallel worker needs to run it."""

    rows: tuple[str, ...]  # running requests in row order, after the aborts (a worker checks it agrees)
    aborts: tuple[str, ...] = ()
    new: tuple[str, list[int], SamplingParams] | None = None  # a request whose prefill starts (seed resolved)
    prefill: bool = False  # one prefill chunk runs after the decode
    shape: int | None = None  # the speculative shape of the decode step; None: plain decoding
    variant: str | None = None  # the sampling variant of the decode step
    chosen: bool = False  # the adaptive choice picked `shape` (None included): its speed is recorded


class Engine:
    """Continuous batching over `num_slots` sequence slots (the largest batch bucket)."""

    def __init__(self, target: Any, tokenizer: Any, proposer: Proposer | None, graphs: GraphSet, *,
                 max_waiting: int = 64, model_name: str = "specair") -> None:
        self.target, self.tokenizer, self.proposer, self.graphs = target, tokenizer, proposer, graphs
        self.plan, self.catalog = graphs.plan, graphs.catalog
        self.max_context, self.model_name = self.plan.max_context, model_name
        self.device = graphs.device
        self.rows: list[Seq] = []
        self.sched = Scheduler(self.plan, target.config.vocab_size, tokenizer, target.dtype, max_waiting, self.rows)
        self.num_slots, self.max_waiting = self.sched.num_slots, max_waiting
        self.output = Output(eos_ids(target, tokenizer))
        roles = {"target": target}
        if proposer is not None and proposer.has_cache:
            roles["draft"] = proposer.draft
        self.kv = KVSlots(roles, self.plan, self.device, graphs, persistent=graphs.static_buffers,
                          any_length=graphs.any_cache_length)
        self.state = BatchState(self.num_slots, target.dtype, self.device)
        if proposer is not None:
            proposer.attach(graphs, self.kv)
        graphs.prepare()
        self.bucket_steps: Counter[int] = Counter()
        # Called as (request_id, hidden [n, F]) with the target's hidden output at a request's next n
        # positions, in order, as the graphs produce them (distillation records them; None: nobody asks).
        self.hidden_observer: Callable[[str, Tensor], None] | None = None
        spec = self.plan.speculative
        # Arms: the speculative shapes by index, and None for a plain decode step.
        arms = (*range(len(self.plan.trees)), None)
        self.adaptive = AdaptiveSpeculation(arms) if spec is not None and spec.adaptive else None
        self.group: Group | None = None  # the tensor-parallel group this engine drives (runtime/tensor_parallel)
        # Prompt KV kept across requests, where loading it gives the bits prefilling would: row-independent
        # graphs, and no proposer cache that the prompt's own pass fills. The block is the smallest prefill
        # chunk, so the tokens past a hit prefill in one small chunk. None: off (`LLM(enable_prefix_caching=False)`).
        exact = graphs.backend.row_independent and self.plan.dtype == "fp32" and not (proposer and proposer.has_cache)
        self.prefix_cache = PrefixCache(self.plan.chunk_buckets[0]) if exact else None
        self._trace: list[dict[str, Any]] | None = None

    @property
    def trace(self) -> list[dict[str, Any]] | None:
        """When a list: each step's decisions and every graph called, in order (tensor-parallel tests)."""
        return self._trace

    @trace.setter
    def trace(self, trace: list[dict[str, Any]] | None) -> None:
        self._trace = trace
        self.graphs.observer = None if trace is None else (lambda key: trace.append({"graph": key.name}))

    def load_graphs(self, params: SamplingParams) -> int:
        """Load now the compiled graphs that requests sampling like `params` run (onnxruntime makes a session
        per graph, ~0.1 s each), so no load lands inside the first request; returns how many loaded."""
        wanted = sampling_variant([params.temperature], [params.top_k], [params.top_p])
        return self.graphs.load_pending((self.plan.variant_for(wanted),))

    # ---- requests -----------------------------------------------------------------------------------

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams = SamplingParams(),
                    request_id: str | None = None) -> str:
        """Queue a request (thread-safe). Raises InputError for bad input, QueueFullError when full."""
        return self.sched.add(prompt_ids, params, request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request (thread-safe); its slot frees at the next step and its last event says 'abort'."""
        self.sched.abort(request_id)

    def check_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        """The prompt's ids, or InputError if this engine cannot take it."""
        return self.sched.check_prompt(prompt_ids)

    def limit_kv_memory(self, budget: int | None) -> None:
        """Admit a waiting request only while the KV caches (every role, the prefill scratch included) would fit
        in `budget` bytes with it and every running request at its longest, prompt plus max_tokens (vLLM's
        kv_cache_memory_bytes); a request that cannot fit even alone is refused at `add_request`. None: no
        budget, the batch buckets alone bound admission."""
        if budget is not None and budget <= 0:
            raise InputError(f"the KV cache budget must be a positive number of bytes, got {budget}")

        def kv_bytes(seqs: list[Seq]) -> int:
            return self.kv.bytes_for([len(s.prompt) + s.budget for s in seqs], max(len(s.prompt) for s in seqs))

        self.sched.set_kv_budget(kv_bytes, budget)

    def kv_usage(self) -> tuple[int, int]:
        """(bytes of KV the running sequences' committed tokens use, bytes the KV caches hold)."""
        return sum(s.committed for s in list(self.rows)) * self.kv.slot_bytes, self.kv.held_bytes()

    @property
    def num_running(self) -> int:
        return self.sched.num_running

    @property
    def num_waiting(self) -> int:
        return self.sched.num_waiting

    def has_unfinished(self) -> bool:
        return self.sched.has_unfinished()

    # ---- the step -----------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[StreamEvent]:
        """One iteration: this step's decisions (`StepMeta`), then a decode or speculative step over the
        running rows and one prefill chunk. Under tensor parallelism the decisions reach every worker
        before any graph runs, and a failing rank fails the step with a TensorParallelError."""
        with self.group.lock if self.group is not None else nullcontext():
            aborts = self.sched.collect()
            events = [ev for rid in aborts for ev in self._abort(rid)]
            meta = self._schedule(tuple(aborts))
            if self.group is None:
                return events + self._run(meta)
            self.group.send(meta)
            try:
                return events + self._run(meta)
            except Exception as e:  # the ranks may no longer agree: the group cannot go on
                raise self.group.fail(e) from e

    @torch.inference_mode()
    def follow(self, meta: StepMeta) -> None:
        """A tensor-parallel worker's step: the driver's decisions, run on this rank's shard."""
        for rid in meta.aborts:
            self._abort(rid)
        if meta.new is not None:
            self.sched.follow_prefill(*meta.new)
        rows = tuple(s.request_id for s in self.rows)
        if rows != meta.rows:
            raise EngineDiverged(f"this rank's rows {rows} differ from the driver's {meta.rows}")
        self._run(meta)

    def close(self) -> None:
        """End the tensor-parallel group, if any (its workers exit); a single-process engine holds nothing."""
        if self.group is not None:
            self.group.close()

    def _schedule(self, aborts: tuple[str, ...]) -> StepMeta:
        """The driver's decisions for this step: whether and how the running rows speculate, which request
        prefills a chunk (a waiting one starts when a row is free)."""
        rows = self.rows
        variant = shape = None
        chosen = False
        if rows:
            variant = self.plan.variant_for(max((s.sampling.variant for s in rows), key=VARIANTS.index))
            if self.sched.speculates() and self.proposer.can_speculate(rows):
                chosen = self.adaptive is not None and variant == "greedy"
                shape = self.adaptive.choose() if chosen else 0
        waiting = self.sched.prefilling is None
        s = self.sched.next_prefill()
        new = None
        if s is not None and waiting and self.group is not None:
            new = (s.request_id, s.prompt, replace(s.params, seed=s.sampling.seed))
        return StepMeta(
            rows=tuple(x.request_id for x in rows), aborts=aborts, new=new, prefill=s is not None, shape=shape,
            variant=variant, chosen=chosen)

    def _trace_step(self, meta: StepMeta) -> dict[str, Any]:
        """A step's decisions under vLLM's names for its speculative worker's flags (the trace
        `SPECAIR_TP_TRACE` writes, which the tensor-parallel test reads)."""
        spec = self.plan.speculative
        return {"rows": len(meta.rows), "prefill": meta.prefill, "shape": meta.shape, "no_spec": meta.shape is None,
                "disable_all_speculation": bool(spec and spec.disable_by_batch_size is not None
                                                and len(meta.rows) > spec.disable_by_batch_size),
                "num_lookahead_slots": 0 if meta.shape is None else self.plan.trees[meta.shape].depth,
                "run_spec_proposer_for_prefill": meta.prefill and spec is not None}

    def _run(self, meta: StepMeta) -> list[StreamEvent]:
        if self.trace is not None:
            self.trace.append({"step": self._trace_step(meta)})
        events = self._decode(meta) if self.rows else []
        if meta.prefill:
            s = self.sched.prefilling
            try:
                events += self._prefill_chunk(s)
            except Exception as e:  # a prompt's own pass: only its request fails
                if self.group is not None or s in self.rows:
                    raise  # ranks that disagree cannot go on; a row half inserted is not its alone
                self.sched.end_prefill()
                events.append(self._fail(s, e))
        return events

    def _fail(self, s: Seq, error: Exception) -> StreamEvent:
        """Fail one request on an error that is its own; the others go on."""
        logger.exception("request %s failed", s.request_id)
        return self.output.fail(s, error)

    def _abort(self, rid: str) -> list[StreamEvent]:
        found = self.sched.find(rid)
        if found is None:
            return []
        where, s, row = found
        if where == "running":
            self._remove_row(row)
        else:
            self.sched.drop(s)
        return [self.output.finish(s, "abort")]

    # ---- rows ---------------------------------------------------------------------------------------

    def _insert_row(self, s: Seq) -> None:
        row = len(self.rows)
        self.kv.resize(row + 1, [len(x.tokens) for x in self.rows],
                       max([s.committed] + [x.committed for x in self.rows]))
        self.rows.append(s)
        try:
            self.kv.insert(row, s.committed)
            self.state.set_row(row, s)
        except Exception:  # taken back whole, so that the failure stays this request's alone
            self._remove_row(row)
            raise

    def _remove_row(self, i: int) -> None:
        """Free row i: the last row moves into it, then the caches shrink to the smallest bucket that fits."""
        rows, last = self.rows, len(self.rows) - 1
        if i != last:
            self.kv.move(last, i, len(rows[last].tokens))
            self.state.move_row(last, i)
            rows[i] = rows[last]
        self.kv.free(last)
        rows.pop()
        self.state.clear_row(last)
        if rows:
            self.kv.resize(len(rows), [len(s.tokens) for s in rows], max(s.committed for s in rows))
        elif self.sched.prefilling is None:
            self.kv.release()

    # ---- prefill ------------------------------------------------------------------------------------

    def _prefill_chunk(self, s: Seq) -> list[StreamEvent]:
        """One chunk of the prefilling request into the scratch cache (its proposer's cache alongside)."""
        caching = self.prefix_cache is not None and self.hidden_observer is None
        if s.prefilled == 0:
            if self.proposer is not None:
                self.proposer.start(s)
            if caching:
                self.kv.fit_scratch(len(s.prompt))
                s.prefilled = s.cached = self.prefix_cache.load(s.prompt, self.kv)
        start = s.prefilled
        self.kv.fit_scratch(start)
        chunk = self.plan.chunk_for(len(s.prompt) - start)
        n = min(chunk, len(s.prompt) - start)
        tokens = torch.zeros(1, chunk, dtype=torch.long)
        tokens[0, :n] = torch.tensor(s.prompt[start:start + n])
        tokens = tokens.to(self.device)
        ctx = self.plan.context_bucket(max(start, 1))
        cache_len = torch.tensor([start], device=self.device)
        out = self.graphs(GraphKey("prefill", 1, ctx, chunk=self.plan.chunk_key(chunk)), tokens=tokens,
                          cache_len=cache_len, n_valid=torch.tensor([n], device=self.device),
                          **self.kv.scratch_inputs("target"))
        self.kv.commit("target", out["new_k"], out["new_v"], cache_len.unsqueeze(1) + torch.arange(
            chunk, device=self.device), scratch=True)
        if self.proposer is not None:
            self.proposer.prefill_chunk(s, tokens, start, n, ctx, out["hidden"])
        if self.hidden_observer is not None:
            self.hidden_observer(s.request_id, out["hidden"][0, :n])
        s.prefilled += n
        if s.prefilled < len(s.prompt):
            return []
        self.sched.end_prefill()
        if caching:
            self.prefix_cache.store(s.prompt, self.kv)
        r = s.sampling
        first = int(sample(out["logits"], r.temperature.to(self.device), r.top_k.to(self.device),
                           r.top_p.to(self.device), r.uniforms(len(s.prompt)).to(self.device), r.variant).item())
        s.t_first = time.perf_counter()
        s.tokens = list(s.prompt)
        if self.proposer is not None:
            self.proposer.prefilled(s, out["hidden"][0, n - 1])
        _, ev = self.output.emit(s, [first])
        if s.finish is None:
            self._insert_row(s)
        return [ev]

    # ---- decoding -----------------------------------------------------------------------------------

    def _decode(self, meta: StepMeta) -> list[StreamEvent]:
        rows = self.rows  # room for the context the rows reached in the last step
        self.kv.resize(len(rows), [len(s.tokens) for s in rows], max(s.committed for s in rows))
        B = self.kv.B
        self.bucket_steps[B] += 1
        shape, variant = meta.shape, meta.variant
        t0 = time.perf_counter()
        per_row = self._plain_step(B, variant) if shape is None else self._speculative_step(B, variant, shape)
        if meta.chosen:
            self.adaptive.record(shape, sum(len(toks) for toks, _ in per_row), time.perf_counter() - t0)
        events = []
        for s, (toks, draft) in zip(list(self.rows), per_row):
            try:
                events.append(self.output.emit(s, toks, draft)[1])
            except Exception as e:  # its text or stop handling: that row alone finishes (removed below)
                if self.group is not None:
                    raise
                events.append(self._fail(s, e))
        for i in range(len(self.rows) - 1, -1, -1):
            if self.rows[i].finish is not None:
                self._remove_row(i)
        return events

    def _plain_step(self, B: int, variant: str) -> list[tuple[list[int], None]]:
        st = self.state
        pos = st.positions[:B]
        out = self.graphs(GraphKey("decode", B, self.sched.context_bucket(), variant=variant),
                          tokens=st.tokens[:B], cache_len=pos, **self.kv["target"], **st.sampling(B),
                          uniform=st.uniforms(self.rows, B))
        self.kv.commit("target", out["new_k"], out["new_v"], pos.unsqueeze(1))
        st.advance(out["next_tokens"], 1)
        nxt = out["next_tokens"].tolist()  # the step's one device→host read
        if self.proposer is not None:
            self.proposer.decoded(self.rows, out["hidden"])
        if self.hidden_observer is not None:
            for i, s in enumerate(self.rows):
                self.hidden_observer(s.request_id, out["hidden"][i:i + 1])
        return [([t], None) for t in nxt[:len(self.rows)]]

    def _speculative_step(self, B: int, variant: str, shape: int) -> list[tuple[list[int], tuple[int, int]]]:
        st, tree = self.state, self.plan.trees[shape]
        D = tree.depth
        ctx = self.sched.context_bucket()  # both models read only committed slots
        root_pos = st.positions[:B].clone()
        uniforms = st.uniforms(self.rows, B, D + 1)
        # A fresh [B, D] buffer: a slice keeps the stride D + 1, which compiled graphs guard on.
        drafted = uniforms.new_empty(B, D).copy_(uniforms[:, :D])
        step = Step(B, shape, tree, self.rows, ctx, variant, st.sampling(B), st.tokens[:B], root_pos, drafted)
        prop = self.proposer.propose(step)
        key = self.catalog.verify_key(B, ctx, variant, shape)
        inputs = self.catalog.verify_inputs(key, prop.tokens, root_pos, self.kv["target"], prop.parents, uniforms,
                                            step.sampling)
        out = self.graphs(key, **inputs)
        self.kv.commit("target", out["path_k"], out["path_v"],
                       root_pos.unsqueeze(1) + torch.arange(D + 1, device=self.device))
        n_acc = out["num_accepted"]
        st.advance(out["tokens"].gather(1, n_acc.unsqueeze(1)).squeeze(1), n_acc + 1)
        accepted = out["tokens"].tolist()  # the step's one device→host read
        per_row, counts = [], []
        for s, row in zip(self.rows, accepted):
            toks = [t for t in row if t >= 0]
            counts.append(len(toks) - 1)
            self.output.count_draft(s, D, counts[-1])
            per_row.append((toks, (D, counts[-1])))
        self.proposer.accepted(self.rows, counts, out["path_hidden"])
        if self.hidden_observer is not None:
            for i, (s, n) in enumerate(zip(self.rows, counts)):
                self.hidden_observer(s.request_id, out["path_hidden"][i, :n + 1])
        return per_row
