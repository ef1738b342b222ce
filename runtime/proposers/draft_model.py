"""Proposers with a KV cache of their own: a separate draft model (`draft_model`), the target's first
layers (`layer_skip`), and the base that EAGLE builds on.

The draft's cache lags the target's: after a step it lacks the accepted tokens and the bonus. Each
draft graph starts with a fixed-width catch-up of up to D+1 pending entries; after steps that did not
speculate, `sync` first brings every row within that width with the draft's batched prefill graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor

from specair.compile.catalog import Catalog, GraphSpec
from specair.compile.graph_def import GraphKey
from specair.compile.plan import Plan
from specair.compile.spec_config import SpeculativeConfig
from specair.graphs.draft import draft_chain, draft_static_tree, draft_topk_tree
from specair.graphs.steps import prefill_chunk
from specair.models.errors import InputError
from specair.models.llama import truncated
from specair.runtime.proposers.base import Proposal, Proposer, Step, register
from specair.runtime.scheduler import Seq

L = torch.long


@dataclass
class DraftState:
    length: int = 0  # entries in the proposer's cache
    hidden: Tensor | None = None  # hidden-state drafts: the target states of pending entries [P, H]


class CachedDraft(Proposer):
    """A draft with its own cache; entry p of it holds token p + `offset` (with target hidden state p when
    `reads_hidden`)."""

    has_cache = True
    native = "cached_draft"
    offset: ClassVar[int] = 0
    reads_hidden: ClassVar[bool] = False

    # ---- graphs -------------------------------------------------------------------------------------

    def draft_key(self, B: int, ctx: int, variant: str, shape: int) -> GraphKey:
        chain = self.trees[shape].kind == "chain"
        return GraphKey("draft", B, ctx, variant=Catalog.sampled(variant) if chain else "", shape=shape)

    def graph_keys(self, plan: Plan) -> list[GraphKey]:
        # Prompts prefill into the one-row scratch cache ("draft_prefill"), running rows catch up in their
        # own cache ("draft_sync"): two graphs, so a static-buffer backend binds each to its own memory.
        return [GraphKey("draft_prefill", 1, c, chunk=plan.chunk_key(t)) for c in plan.ctx_buckets
                for t in plan.chunk_buckets] + [
            k for b in plan.batch_buckets for c in plan.ctx_buckets
            for k in [GraphKey("draft_sync", b, c)] + [self.draft_key(b, c, v, i) for v in plan.variants
                                                      for i in plan.shapes(v)]]

    def build_graph(self, key: GraphKey, cat: Catalog) -> GraphSpec:
        B, tree = key.batch, self.trees[key.shape]
        D = tree.depth
        caches = cat.caches(self.draft, B)
        H = cat.hidden_size
        if key.kind in ("draft_prefill", "draft_sync"):
            chunk = key.chunk or self.plan.prefill_chunk
            inputs = {"tokens": cat.zeros(B, chunk), "cache_len": cat.zeros(B),
                      "n_valid": torch.ones(B, dtype=L, device=cat.device), **caches}
            if self.reads_hidden:
                inputs["input_hidden"] = cat.zeros(B, chunk, H, dtype=cat.target.dtype)
            return GraphSpec(prefill_chunk, {"draft": self.draft}, {"ctx": key.ctx}, inputs,
                             ["logits", "hidden", "new_k", "new_v"])
        inputs = {"catch_tokens": cat.zeros(B, D + 1), "n_catch": torch.ones(B, dtype=L, device=cat.device),
                  "draft_len": cat.zeros(B), **caches}
        if tree.kind == "chain":
            fn, static = draft_chain, {"k": D, "ctx": key.ctx, "filtered": key.variant == "filtered"}
            inputs.update(cat.sampling(B), uniforms=cat.uniforms(B, D))
            outs = ["tree_tokens", "catch_k", "catch_v"]
        elif tree.kind == "static":
            fn = draft_static_tree
            static = {"template": tree.template, "ctx": key.ctx, "buffers": cat.on_device(tree.template.buffers())}
            outs = ["tree_tokens", "catch_k", "catch_v"]
        else:
            fn = draft_topk_tree
            static = {"depth": D, "topk": tree.topk, "num_nodes": tree.num_nodes - 1, "ctx": key.ctx}
            outs = ["tree_tokens", "parents", "catch_k", "catch_v"]
        if self.reads_hidden:  # the catch-up entries' target hidden states
            inputs["catch_hidden"] = cat.zeros(B, D + 1, H, dtype=cat.target.dtype)
        return GraphSpec(fn, {"draft": self.draft}, static, inputs, outs)

    # ---- prefill ------------------------------------------------------------------------------------

    def start(self, seq: Seq) -> None:
        seq.draft = DraftState()

    def prefill_chunk(self, seq: Seq, tokens: Tensor, start: int, n: int, ctx: int, hidden: Tensor) -> None:
        m = min(n, len(seq.prompt) - self.offset - start)
        if m <= 0:
            return
        if self.offset:
            shifted = torch.zeros(1, tokens.shape[1], dtype=L)
            shifted[0, :m] = torch.tensor(seq.prompt[start + self.offset:start + self.offset + m])
            tokens = shifted.to(self.device)
        cache_len = torch.tensor([start], device=self.device)
        extra = {"input_hidden": hidden} if self.reads_hidden else {}
        key = GraphKey("draft_prefill", 1, ctx, chunk=self.plan.chunk_key(tokens.shape[1]))
        out = self.graphs(key, tokens=tokens, cache_len=cache_len,
                          n_valid=torch.tensor([m], device=self.device), **self.kv.scratch_inputs("draft"), **extra)
        self.kv.commit("draft", out["new_k"], out["new_v"],
                       cache_len.unsqueeze(1) + torch.arange(tokens.shape[1], device=self.device), scratch=True)

    def prefilled(self, seq: Seq, last_hidden: Tensor) -> None:
        seq.draft.length = len(seq.prompt) - self.offset
        if self.reads_hidden:
            seq.draft.hidden = last_hidden.unsqueeze(0)

    # ---- decoding -----------------------------------------------------------------------------------

    def decoded(self, rows: list[Seq], hidden: Tensor) -> None:
        if self.reads_hidden:
            for i, s in enumerate(rows):
                s.draft.hidden = torch.cat([s.draft.hidden, hidden[i:i + 1]])

    def accepted(self, rows: list[Seq], num_accepted: list[int], path_hidden: Tensor) -> None:
        if self.reads_hidden:
            for i, (s, n) in enumerate(zip(rows, num_accepted)):
                s.draft.hidden = path_hidden[i, :n + 1]

    def _pending(self, s: Seq) -> list[int]:
        return s.tokens[s.draft.length + self.offset:]

    def sync(self, rows: list[Seq], B: int, D: int) -> None:
        """Bring every row's cache to within one catch-up (D+1 entries) of its sequence, after steps that
        did not speculate or speculated deeper (rows already close get no tokens)."""
        chunk = self.plan.prefill_chunk
        while True:
            lag = [len(self._pending(s)) for s in rows]  # pending entries, the root's included
            if max(lag) <= D + 1:
                return
            n = [min(m - 1, chunk) if m > D + 1 else 0 for m in lag]
            tokens = torch.zeros(B, chunk, dtype=L)
            for i, s in enumerate(rows):
                if n[i]:
                    tokens[i, :n[i]] = torch.tensor(self._pending(s)[:n[i]])
            lengths = [s.draft.length for s in rows] + [0] * (B - len(rows))
            start = torch.tensor(lengths, device=self.device)
            extra = {}
            if self.reads_hidden:
                h = torch.zeros(B, chunk, self.target.feature_size, dtype=self.target.dtype, device=self.device)
                for i, s in enumerate(rows):
                    h[i, :n[i]] = s.draft.hidden[:n[i]]
                extra["input_hidden"] = h
            key = GraphKey("draft_sync", B, self.plan.context_bucket(max(max(lengths), 1)))
            out = self.graphs(key, tokens=tokens.to(self.device), cache_len=start,
                              n_valid=torch.tensor(n + [0] * (B - len(n)), device=self.device), **self.kv["draft"],
                              **extra)
            self.kv.commit("draft", out["new_k"], out["new_v"],
                           start.unsqueeze(1) + torch.arange(chunk, device=self.device))
            for i, s in enumerate(rows):
                s.draft.length += n[i]
                if self.reads_hidden:
                    s.draft.hidden = s.draft.hidden[n[i]:]

    def propose(self, step: Step) -> Proposal:
        B, D, rows = step.B, step.tree.depth, step.rows
        self.sync(rows, B, D)
        pending = [self._pending(s) for s in rows]
        catch = torch.zeros(B, D + 1, dtype=L)
        for i, p in enumerate(pending):
            catch[i, :len(p)] = torch.tensor(p)
        n_catch = torch.tensor([len(p) for p in pending] + [1] * (B - len(pending)))
        draft_len = torch.tensor([s.draft.length for s in rows] + [0] * (B - len(rows)), device=self.device)
        inputs = {"catch_tokens": catch.to(self.device), "n_catch": n_catch.to(self.device), "draft_len": draft_len,
                  **self.kv["draft"]}
        if step.tree.kind == "chain":
            inputs.update(step.sampling, uniforms=step.uniforms)
        if self.reads_hidden:
            h = torch.zeros(B, D + 1, self.target.feature_size, dtype=self.target.dtype, device=self.device)
            for i, s in enumerate(rows):
                h[i, :len(s.draft.hidden)] = s.draft.hidden
            inputs["catch_hidden"] = h
        out = self.graphs(self.draft_key(B, step.ctx, step.variant, step.shape), **inputs)
        self.kv.commit("draft", out["catch_k"], out["catch_v"],
                       draft_len.unsqueeze(1) + torch.arange(D + 1, device=self.device))
        for s, p in zip(rows, pending):
            s.draft.length += len(p)
        return Proposal(out["tree_tokens"], out.get("parents"))


@register
class DraftModel(CachedDraft):
    """A smaller model sharing the target's tokenizer (vLLM `draft_model`)."""

    method = "draft_model"

    @classmethod
    def check_config(cls, raw: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(raw.get("model"), str):
            raise InputError("method 'draft_model' needs 'model': the path of a draft checkpoint")
        return super().check_config(raw)

    @classmethod
    def load(cls, spec: SpeculativeConfig, target: Any, tokenizer: Any, target_path: str | None,
             load_model: Callable[[str], tuple[Any, Any, str]]) -> tuple[Any, str | None]:
        draft, draft_tok, fingerprint = load_model(spec.model)
        if draft.config.vocab_size != target.config.vocab_size or (
                tokenizer is not None and draft_tok is not None
                and tokenizer.backend.get_vocab() != draft_tok.backend.get_vocab()):
            raise InputError(f"the draft model {spec.model} has a different tokenizer than the target; "
                             "a draft must share the target's vocabulary")
        return draft, fingerprint


@register
class LayerSkip(CachedDraft):
    """The target's first `num_layers` layers with its final norm and LM head (self-speculation)."""

    method = "layer_skip"

    @classmethod
    def check_config(cls, raw: dict[str, Any]) -> dict[str, Any]:
        if not (isinstance(raw.get("num_layers"), int) and raw["num_layers"] > 0):
            raise InputError("method 'layer_skip' needs 'num_layers': how many target layers the draft keeps")
        return super().check_config(raw)

    @classmethod
    def load(cls, spec: SpeculativeConfig, target: Any, tokenizer: Any, target_path: str | None,
             load_model: Callable[[str], tuple[Any, Any, str]]) -> tuple[Any, str | None]:
        return truncated(target, spec.num_layers), f"layer_skip:{spec.num_layers}"
