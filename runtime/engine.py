"""The engine: continuous batching of requests over a fixed number of sequence slots, every step a few
precompiled graphs picked by batch bucket and context bucket.

Rows 0..n-1 of the KV caches hold the n running sequences; the caches have the smallest batch bucket
≥ n rows (padding rows are inert: they compute on zeros, and nothing reads what they write). A finished
sequence's row is filled by the last row, so the running rows stay contiguous. New requests are
prefilled chunk by chunk into a one-row scratch cache, one chunk per engine step, between decode steps,
then copied into a row. A speculative step is draft → verify → accept → commit with one device→host read.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from specair.compile.artifacts import GraphSet
from specair.compile.spec_config import CACHED_DRAFTS
from specair.graphs.kv import commit_kv, commit_path
from specair.graphs.sampling import sample
from specair.models.errors import InputError, SpecairError
from specair.runtime.ngram import NgramIndex
from specair.runtime.params import GenerationResult, Request, SamplingParams, StreamEvent, TextAssembler


class QueueFullError(SpecairError):
    """More requests are waiting than the engine queues."""


@dataclass
class Sequence_:
    """One request's state, from the queue to its last token."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    req: Request
    text: TextAssembler
    budget: int  # tokens it may still generate in all
    t0: float
    seq: list[int] = field(default_factory=list)  # prompt + generated; the last token is not in the cache yet
    out: list[int] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens in the scratch cache
    t_first: float = 0.0
    draft_len: int = 0  # entries in the proposer's own cache (draft model, layer skip, EAGLE)
    pending_hidden: Tensor | None = None  # EAGLE: target hidden states of the entries not yet in its cache
    hidden: Tensor | None = None  # Medusa / MLPSpeculator: target hidden state that produced the last token
    ngram: NgramIndex | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    finish: str | None = None


class Engine:
    """Continuous batching over `num_slots` sequence slots (the largest batch bucket)."""

    def __init__(self, target: Any, tokenizer: Any, draft: Any, graphs: GraphSet, *, max_waiting: int = 64,
                 model_name: str = "specair") -> None:
        self.target, self.tokenizer, self.draft, self.graphs = target, tokenizer, draft, graphs
        self.plan, self.catalog = graphs.plan, graphs.catalog
        self.spec, self.tree = self.plan.speculative, self.plan.tree
        self.method = self.spec.method if self.spec else None
        self.max_context, self.chunk = self.plan.max_context, self.plan.prefill_chunk
        self.num_slots, self.max_waiting, self.model_name = self.plan.batch_buckets[-1], max_waiting, model_name
        self.depth = self.tree.depth if self.tree else 0
        self.eos_ids = frozenset(set(target.config.eos_token_ids) | set(getattr(tokenizer, "eos_token_ids", ()) or ()))
        draft_vocab = getattr(getattr(draft, "config", draft), "vocab_size", None)  # heads keep it on themselves
        if draft is not None and draft_vocab != target.config.vocab_size:
            raise InputError(f"the draft's vocabulary ({draft_vocab} tokens) differs from the "
                             f"target's ({target.config.vocab_size}); a draft must share the target's tokenizer")
        self.cached_draft = self.method in CACHED_DRAFTS
        self.offset = 1 if self.method == "eagle" else 0  # EAGLE entry p holds token p+1
        self.bucket_steps: Counter[int] = Counter()
        self._lock = threading.Lock()
        self._inbox: list[Sequence_] = []
        self._aborts: set[str] = set()
        self._ids = itertools.count()
        self.waiting: deque[Sequence_] = deque()
        self.prefilling: Sequence_ | None = None
        self.rows: list[Sequence_] = []
        self.B = 0
        self._static: dict[int, tuple[Tensor, ...]] = {}
        with torch.inference_mode():  # like every graph input: compiled graphs guard on the tensor kind
            self.scratch = target.empty_cache(1, self.plan.slots)
            self.draft_scratch = draft.empty_cache(1, self.plan.slots) if self.cached_draft else None
            self.caches: tuple[Tensor, Tensor] | None = None
            self.draft_caches: tuple[Tensor, Tensor] | None = None

    # ---- requests -----------------------------------------------------------------------------------

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams = SamplingParams(),
                    request_id: str | None = None) -> str:
        """Queue a request (thread-safe). Raises InputError for bad input, QueueFullError when full."""
        ids = self._check_prompt(prompt_ids)
        if not isinstance(params, SamplingParams):
            raise InputError(f"params must be SamplingParams, got {type(params).__name__}")
        req = Request(params, self.target.dtype)
        self.plan.variant_for(req.variant)  # refuses sampling the plan has no graph for
        if self.spec is not None and self.spec.acceptance == "greedy" and not req.greedy:
            raise InputError("this engine's acceptance is 'greedy', which needs temperature 0; "
                             "use acceptance 'rejection' to sample exactly")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        s = Sequence_(rid, ids, params, req, TextAssembler(self.tokenizer, ids, params.stop),
                      min(params.max_tokens, self.max_context - len(ids)), time.perf_counter())
        if self.spec is not None:
            s.stats = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                       "accepted_per_position": [0] * self.depth}
        with self._lock:
            if len(self._inbox) + len(self.waiting) >= self.max_waiting + max(0, self.num_slots - self.num_running):
                raise QueueFullError(f"{self.max_waiting} requests are already waiting; try again later")
            self._inbox.append(s)
        return rid

    def abort(self, request_id: str) -> None:
        """Stop a request (thread-safe); its slot frees at the next step and its last event says 'abort'."""
        with self._lock:
            self._aborts.add(request_id)

    @property
    def num_running(self) -> int:
        return len(self.rows) + (self.prefilling is not None)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self._inbox)

    def has_unfinished(self) -> bool:
        return bool(self.rows or self.prefilling or self.waiting or self._inbox or self._aborts)

    def _check_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        ids = list(prompt_ids)
        if not ids:
            raise InputError("the prompt is empty")
        V = self.target.config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < V]
        if bad:
            raise InputError(f"token ids must be integers in [0, {V}); got {bad[:5]}")
        if len(ids) >= self.max_context:
            raise InputError(f"the prompt has {len(ids)} tokens but the context holds {self.max_context} "
                             f"(prompt plus at least one generated token)")
        return ids

    # ---- the step -----------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[StreamEvent]:
        """One iteration: a decode or speculative step over the running rows, then one prefill chunk."""
        events: list[StreamEvent] = []
        with self._lock:
            self.waiting.extend(self._inbox)
            self._inbox.clear()
            aborts, self._aborts = self._aborts, set()
        for rid in aborts:
            events += self._abort(rid)
        if self.rows:
            events += self._decode()
        if self.prefilling is None and self.waiting and len(self.rows) < self.num_slots:
            self.prefilling = self.waiting.popleft()
        if self.prefilling is not None:
            events += self._prefill_chunk()
        return events

    def _abort(self, rid: str) -> list[StreamEvent]:
        for s in list(self.waiting):
            if s.request_id == rid:
                self.waiting.remove(s)
                return [self._finish(s, "abort")]
        if self.prefilling is not None and self.prefilling.request_id == rid:
            s, self.prefilling = self.prefilling, None
            return [self._finish(s, "abort")]
        for i, s in enumerate(self.rows):
            if s.request_id == rid:
                self._remove_row(i)
                return [self._finish(s, "abort")]
        return []

    # ---- prefill ------------------------------------------------------------------------------------

    def _prefill_chunk(self) -> list[StreamEvent]:
        """One chunk of the prefilling request into the scratch cache (its proposer's cache alongside)."""
        s = self.prefilling
        start, n = s.prefilled, min(self.chunk, len(s.prompt) - s.prefilled)
        tokens = torch.zeros(1, self.chunk, dtype=torch.long)
        tokens[0, :n] = torch.tensor(s.prompt[start:start + n])
        ctx = self.plan.context_bucket(max(start, 1))
        slots = torch.arange(start, start + self.chunk).unsqueeze(0)
        logits, hidden, new_k, new_v = self.graphs(self.catalog.key("prefill.target", 1, ctx), tokens,
                                                   torch.tensor([start]), torch.tensor([n]), *self.scratch)
        commit_kv(*self.scratch, new_k, new_v, slots)
        if self.method in ("draft_model", "layer_skip"):
            _, _, dk, dv = self.graphs(self.catalog.key("prefill.draft", 1, ctx), tokens, torch.tensor([start]),
                                       torch.tensor([n]), *self.draft_scratch)
            commit_kv(*self.draft_scratch, dk, dv, slots)
        elif self.method == "eagle":  # entries start..start+m-1 pair prompt token p+1 with target hidden p
            m = min(n, len(s.prompt) - 1 - start)
            if m > 0:
                shifted = torch.zeros(1, self.chunk, dtype=torch.long)
                shifted[0, :m] = torch.tensor(s.prompt[start + 1:start + 1 + m])
                _, _, dk, dv = self.graphs(self.catalog.key("prefill.draft", 1, ctx), shifted, torch.tensor([start]),
                                           torch.tensor([m]), *self.draft_scratch, hidden)
                commit_kv(*self.draft_scratch, dk, dv, slots)
        s.prefilled += n
        if s.prefilled < len(s.prompt):
            return []
        self.prefilling = None
        first = int(sample(logits, s.req.temperature, s.req.top_k, s.req.top_p, s.req.uniforms(),
                           s.req.variant).item())
        s.t_first = time.perf_counter()
        L = len(s.prompt)
        s.seq = list(s.prompt)
        last_hidden = hidden[0, n - 1]
        if self.method in ("draft_model", "layer_skip"):
            s.draft_len = L
        elif self.method == "eagle":
            s.draft_len, s.pending_hidden = L - 1, last_hidden.unsqueeze(0)
        elif self.method in ("medusa", "mlp_speculator"):
            s.hidden = last_hidden
        elif self.method == "ngram":
            s.ngram = NgramIndex(self.spec.prompt_lookup_min, self.spec.prompt_lookup_max)
            s.ngram.extend(s.prompt)
        events = self._emit(s, [first])
        if s.finish is None:
            self._insert_row(s, L)
        return events

    def _insert_row(self, s: Sequence_, length: int) -> None:
        """Give a prefilled sequence the next row, copying its prompt's K/V out of the scratch caches."""
        row = len(self.rows)
        self._resize(row + 1)
        self.rows.append(s)
        for cache, scratch in ((self.caches, self.scratch), (self.draft_caches, self.draft_scratch)):
            if cache is not None and scratch is not None:
                for c, sc in zip(cache, scratch):
                    c[:, row, :, :length] = sc[:, 0, :, :length]

    def _resize(self, rows: int) -> None:
        """Switch the caches to the smallest batch bucket holding `rows` rows, keeping the running rows."""
        B = self.plan.batch_bucket(max(rows, 1))
        if B == self.B:
            return
        keep = min(len(self.rows), B)
        used = max((len(s.seq) for s in self.rows[:keep]), default=0)

        def moved(model: Any, old: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor]:
            new = model.empty_cache(B, self.plan.slots)
            if old is not None and keep:
                for n, o in zip(new, old):
                    n[:, :keep, :, :used] = o[:, :keep, :, :used]
            return new

        self.caches = moved(self.target, self.caches)
        if self.cached_draft:
            self.draft_caches = moved(self.draft, self.draft_caches)
        self.B = B

    def _remove_row(self, i: int) -> None:
        """Free row i: the last row moves into it, then the caches shrink to the smallest bucket that fits."""
        last = len(self.rows) - 1
        if i != last:
            used = len(self.rows[last].seq)
            for cache in (self.caches, self.draft_caches):
                if cache is not None:
                    for c in cache:
                        c[:, i, :, :used] = c[:, last, :, :used]
            self.rows[i] = self.rows[last]
        self.rows.pop()
        if self.rows:
            self._resize(len(self.rows))

    # ---- decoding -----------------------------------------------------------------------------------

    def _decode(self) -> list[StreamEvent]:
        n, B = len(self.rows), self.B
        self.bucket_steps[B] += 1
        if self._speculate():
            per_row = self._speculative_step()
        else:
            per_row = [(toks, None) for toks in self._plain_step()]
        events: list[StreamEvent] = []
        for s, (toks, draft) in zip(list(self.rows), per_row):
            events += self._emit(s, toks, draft)
        for i in range(n - 1, -1, -1):
            if self.rows[i].finish is not None:
                self._remove_row(i)
        return events

    def _speculate(self) -> bool:
        """Whether this step speculates: a proposer, not too many rows (disable_by_batch_size), room in
        the context for the lookahead, and some row with more than one token of budget left."""
        if self.spec is None:
            return False
        if self.spec.disable_by_batch_size is not None and len(self.rows) > self.spec.disable_by_batch_size:
            return False
        if any(len(s.seq) + self.depth > self.max_context for s in self.rows):
            return False
        if all(s.budget - len(s.out) <= 1 for s in self.rows):
            return False
        if self.method == "ngram":
            self._proposals = [s.ngram.propose(self.depth) for s in self.rows]
            return any(self._proposals)
        return True

    def _row_tensors(self, s_fn, fill, dtype=torch.long) -> Tensor:
        vals = [s_fn(s) for s in self.rows] + [fill] * (self.B - len(self.rows))
        return torch.tensor(vals, dtype=dtype)

    def _sampling(self) -> tuple[str, tuple[Tensor, Tensor, Tensor]]:
        dt = self.target.dtype
        variant = max((s.req.variant for s in self.rows), key=("greedy", "plain", "filtered").index)
        return self.plan.variant_for(variant), (
            self._row_tensors(lambda s: float(s.params.temperature), 0.0, dt),
            self._row_tensors(lambda s: s.params.top_k, 0),
            self._row_tensors(lambda s: float(s.params.top_p), 1.0, dt))

    def _uniforms(self, *shape: int) -> Tensor:
        rows = [s.req.uniforms(*shape)[0] for s in self.rows]
        pad = torch.zeros(self.B - len(rows), *shape, dtype=rows[0].dtype)
        return torch.cat([torch.stack(rows), pad])

    def _plain_step(self) -> list[list[int]]:
        pos = self._row_tensors(lambda s: len(s.seq) - 1, 0)
        tokens = self._row_tensors(lambda s: s.seq[-1], 0)
        variant, sampling = self._sampling()
        ctx = self.plan.context_bucket(max(int(pos.max()), 1))
        nxt, _, hidden, new_k, new_v = self.graphs(self.catalog.key("decode", self.B, ctx, variant), tokens, pos,
                                                   *self.caches, *sampling, self._uniforms())
        commit_kv(*self.caches, new_k, new_v, pos.unsqueeze(1))
        out = nxt.tolist()  # the step's one device→host read
        for i, s in enumerate(self.rows):
            if self.method == "eagle":
                s.pending_hidden = torch.cat([s.pending_hidden, hidden[i:i + 1]])
            elif self.method in ("medusa", "mlp_speculator"):
                s.hidden = hidden[i]
        return [[t] for t in out[:len(self.rows)]]

    def _tree_buffers(self) -> tuple[Tensor, ...]:
        """depth, ancestor mask, children, paths of the static tree, expanded to the batch bucket."""
        if self.B not in self._static:
            b = self.tree.template.buffers()
            # clone, not contiguous: at B=1 contiguous() returns a view of the template's (possibly
            # non-inference) buffers, and compiled graphs guard on the tensor kind.
            self._static[self.B] = tuple(t.unsqueeze(0).expand(self.B, *t.shape).clone()
                                         for t in (b.depth, b.ancestor_mask, b.children, b.paths))
        return self._static[self.B]

    def _sync_draft(self, ctx_for) -> None:
        """Bring every row's proposer cache to within one catch-up (D+1 entries) of its sequence, after
        steps that did not speculate, with the draft's prefill graph (rows already close get no tokens)."""
        D = self.depth
        while True:
            lag = [len(s.seq) - self.offset - s.draft_len for s in self.rows]  # pending entries, root's incl.
            if max(lag) <= D + 1:
                return
            n = [min(max(m - 1, 0) if m > D + 1 else 0, self.chunk) for m in lag]
            tokens = torch.zeros(self.B, self.chunk, dtype=torch.long)
            for i, s in enumerate(self.rows):
                if n[i]:
                    start = s.draft_len + self.offset
                    tokens[i, :n[i]] = torch.tensor(s.seq[start:start + n[i]])
            start = self._row_tensors(lambda s: s.draft_len, 0)
            extra = ()
            if self.method == "eagle":
                h = torch.zeros(self.B, self.chunk, self.target.config.hidden_size, dtype=self.target.dtype)
                for i, s in enumerate(self.rows):
                    h[i, :n[i]] = s.pending_hidden[:n[i]]
                extra = (h,)
            key = self.catalog.key("prefill.draft", self.B, ctx_for(int(start.max())))
            _, _, dk, dv = self.graphs(key, tokens, start, torch.tensor(n + [0] * (self.B - len(n))),
                                       *self.draft_caches, *extra)
            commit_kv(*self.draft_caches, dk, dv, start.unsqueeze(1) + torch.arange(self.chunk))
            for i, s in enumerate(self.rows):
                s.draft_len += n[i]
                if self.method == "eagle":
                    s.pending_hidden = s.pending_hidden[n[i]:]

    def _propose(self, root: Tensor, ctx: int, variant: str, sampling: tuple[Tensor, ...], need_q: bool):
        """Run the proposer: tree tokens [B, T], draft probs [B, T, V] (None for an n-gram proposal under
        greedy acceptance, which never reads them) and (topk trees) parents."""
        cat, D, B, V = self.catalog, self.depth, self.B, self.target.config.vocab_size
        parents = None
        if self.method == "ngram":
            tokens = torch.zeros(B, D + 1, dtype=torch.long)
            tokens[:, 0] = root
            for i, prop in enumerate(self._proposals):
                tokens[i, 1:1 + len(prop)] = torch.tensor(prop, dtype=torch.long)
            q = None
            if need_q:
                q = F.one_hot(tokens, V).to(self.target.dtype)
                q[:, 0] = 0
            return tokens, q, parents
        if self.method in ("medusa", "mlp_speculator"):
            hidden = torch.zeros(B, self.target.config.hidden_size, dtype=self.target.dtype)
            hidden[:len(self.rows)] = torch.stack([s.hidden for s in self.rows])
            inputs = (hidden, root) + ((*sampling, self._uniforms(D)) if self.method == "mlp_speculator" else ())
            tokens, q = self.graphs(cat.key("draft", B, variant=variant), *inputs)
            return tokens, q, parents
        self._sync_draft(lambda c: self.plan.context_bucket(max(c, 1)))
        pending = [s.seq[s.draft_len + self.offset:] for s in self.rows]
        catch = torch.zeros(B, D + 1, dtype=torch.long)
        for i, p in enumerate(pending):
            catch[i, :len(p)] = torch.tensor(p)
        n_catch = torch.tensor([len(p) for p in pending] + [1] * (B - len(pending)))
        draft_len = self._row_tensors(lambda s: s.draft_len, 0)
        inputs = (catch, n_catch, draft_len, *self.draft_caches)
        if self.tree.kind == "chain":
            inputs += (*sampling, self._uniforms(D))
        if self.method == "eagle":
            h = torch.zeros(B, D + 1, self.target.config.hidden_size, dtype=self.target.dtype)
            for i, s in enumerate(self.rows):
                h[i, :len(s.pending_hidden)] = s.pending_hidden
            inputs += (h,)
        out = self.graphs(cat.key("draft", B, ctx, variant), *inputs)
        if self.tree.kind == "topk":
            tokens, parents, q, ck, cv = out
        else:
            tokens, q, ck, cv = out
        commit_kv(*self.draft_caches, ck, cv, draft_len.unsqueeze(1) + torch.arange(D + 1))
        for s, p in zip(self.rows, pending):
            s.draft_len += len(p)
        return tokens, q, parents

    def _speculative_step(self) -> list[tuple[list[int], tuple[int, int]]]:
        cat, D, B, tree = self.catalog, self.depth, self.B, self.tree
        root_pos = self._row_tensors(lambda s: len(s.seq) - 1, 0)
        root = self._row_tensors(lambda s: s.seq[-1], 0)
        ctx = self.plan.context_bucket(max(int(root_pos.max()), 1))  # both models read only committed slots
        variant, sampling = self._sampling()
        method = cat.acceptance(all(s.req.greedy for s in self.rows))
        tokens, q, parents = self._propose(root, ctx, variant, sampling, need_q=method == "rejection")
        if parents is not None:
            depth, mask, children, paths = self.graphs(cat.key("tree", B), parents)
        else:
            depth, mask, children, paths = self._tree_buffers()
        verify_in = (tokens, root_pos) if self.spec.scorer == "batch_expansion" else (tokens, depth, mask, root_pos)
        logits, hidden, new_k, new_v = self.graphs(cat.key("verify", B, ctx), *verify_in, *self.caches)
        key = cat.key("accept", B, variant=variant, method=method)
        if method == "greedy":
            _, acc, node_ids = self.graphs(key, tokens, logits, paths)
        elif method == "typical":
            _, acc, node_ids = self.graphs(key, tokens, logits, paths, *sampling)
        else:
            _, acc, node_ids = self.graphs(key, tokens, logits, q, children, self._uniforms(tree.num_nodes + 1),
                                           *sampling)
        commit_path(*self.caches, new_k, new_v, node_ids, root_pos)
        accepted = acc.tolist()  # the step's one device→host read
        if self.method == "eagle":
            path_hidden = hidden.gather(1, node_ids.clamp(min=0).unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
        out = []
        for i, s in enumerate(self.rows):
            row = [t for t in accepted[i] if t >= 0]
            n = len(row) - 1
            if self.method == "eagle":
                s.pending_hidden = path_hidden[i, :n + 1]
            elif self.method in ("medusa", "mlp_speculator"):
                s.hidden = hidden[i, node_ids[i, n]]
            st = s.stats
            st["num_drafts"] += 1
            st["num_draft_tokens"] += D
            st["num_accepted_tokens"] += n
            for j in range(n):
                st["accepted_per_position"][j] += 1
            out.append((row, (D, n)))
        return out

    # ---- output -------------------------------------------------------------------------------------

    def _emit(self, s: Sequence_, new: list[int], draft: tuple[int, int] | None = None) -> list[StreamEvent]:
        """Append a step's tokens to a sequence; stop at EOS, a stop string or the budget."""
        taken, delta = [], ""
        for tok in new:
            s.out.append(tok)
            taken.append(tok)
            delta += s.text.add(tok)
            if tok in self.eos_ids and not s.params.ignore_eos or s.text.stopped:
                s.finish = "stop"
                break
            if len(s.out) >= s.budget:
                s.finish = "length"
                break
        s.seq.extend(taken)
        if s.ngram is not None:
            s.ngram.extend(taken)
        if s.finish is None:
            return [StreamEvent(delta, taken, None, s.request_id, draft)]
        ev = self._finish(s, s.finish)
        ev.text, ev.token_ids, ev.draft = delta + ev.text, taken, draft
        return [ev]

    def _finish(self, s: Sequence_, reason: str) -> StreamEvent:
        s.finish = reason
        t_end = time.perf_counter()
        tail = s.text.finish()
        n = len(s.out)
        extra: dict[str, Any] = {}
        if s.stats:
            st = dict(s.stats)
            st["mean_accepted_length"] = (st["num_accepted_tokens"] + st["num_drafts"]) / max(st["num_drafts"], 1)
            extra["spec"] = st
        t_first = s.t_first or t_end
        result = GenerationResult(
            text=s.text.text, token_ids=list(s.out), num_prompt_tokens=len(s.prompt), num_generated_tokens=n,
            finish_reason=reason, ttft_s=t_first - s.t0,
            decode_tokens_per_s=(n - 1) / (t_end - t_first) if n > 1 and t_end > t_first else 0.0,
            prefill_tokens_per_s=len(s.prompt) / (t_first - s.t0) if t_first > s.t0 else 0.0, extra=extra)
        return StreamEvent(tail, [], result, s.request_id)
