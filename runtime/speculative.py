"""The eager speculative loop, made only of the graphs in `specair.graphs`:
draft → verify → accept → commit, one device→host read (the accepted tokens) per step.
"""

from __future__ import annotations

from typing import Any

import torch

from specair.graphs.acceptance import accept_greedy, accept_rejection, accept_typical
from specair.graphs.draft import draft_chain, draft_static_tree, draft_topk_tree
from specair.graphs.kv import commit_kv, commit_path
from specair.graphs.tree import buffers_from_parents, get_template
from specair.graphs.verify import expanded_verify, leaf_paths, tree_verify
from specair.models.errors import InputError
from specair.models.llama import Transformer
from specair.runtime.reference import Decoder, Request, context_bucket
from specair.runtime.spec_config import SpeculativeConfig


def parse_topk_tree(spec: str) -> tuple[int, int]:
    """'topk:KxN' → (K candidates per expansion, N draft nodes kept)."""
    try:
        k, n = spec.split(":", 1)[1].lower().split("x")
        return int(k), int(n)
    except ValueError:
        raise InputError(f"tree {spec!r}: expected 'topk:KxN', e.g. 'topk:4x16'") from None


class SpeculativeDecoder(Decoder):
    """Speculative decoding with a draft model (or the target's own first layers) proposing a tree."""

    def __init__(self, model: Transformer, draft: Transformer, config: SpeculativeConfig, tokenizer: Any = None,
                 max_context: int | None = None, prefill_chunk_size: int = 128) -> None:
        if draft.config.vocab_size != model.config.vocab_size:
            raise InputError(f"the draft's vocabulary ({draft.config.vocab_size} tokens) differs from the "
                             f"target's ({model.config.vocab_size}); a draft must share the target's tokenizer")
        self.config, self.draft = config, draft
        k = config.num_speculative_tokens
        tree = config.tree
        self.topk_tree = parse_topk_tree(tree) if isinstance(tree, str) and tree.startswith("topk:") else None
        if self.topk_tree:
            K, N = self.topk_tree
            self.depth, self.num_nodes = k, N + 1
            created = K + (k - 1) * K * K
            if not 1 <= N <= created:
                raise InputError(f"tree topk:{K}x{N} keeps {N} nodes but creates only {created} at depth {k}")
            if config.scorer != "tree":
                raise InputError("the batch-expansion scorer needs a static tree, not a per-row topk tree")
        else:
            try:
                self.template = get_template(tree, k)
            except ValueError as e:
                raise InputError(str(e)) from None
            self.depth, self.num_nodes = self.template.max_depth, self.template.num_nodes
            if self.depth != k:
                raise InputError(f"tree {tree!r} has depth {self.depth}; set num_speculative_tokens to {self.depth}")
            self.buffers = self.template.buffers()
            self.is_chain = self.template.max_width == 1
            if config.scorer == "batch_expansion":
                self.leaves = leaf_paths(self.buffers.paths, self.buffers.children)
        # Commits reach D slots past the root: the draft's catch-up and the verified path.
        super().__init__(model, tokenizer, max_context, prefill_chunk_size, spare_slots=self.depth + 1)
        self.draft_caches = draft.empty_cache(1, self.slots)

    def _start(self, ids: list[int], req: Request) -> int:
        if self.config.acceptance == "greedy" and not req.greedy:
            raise InputError("acceptance 'greedy' needs temperature 0; use 'rejection' to sample exactly")
        D = self.depth
        self.stats = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                      "accepted_per_position": [0] * D}
        first = super()._start(ids, req)
        self.prefill(ids, self.draft, self.draft_caches)
        self.draft_len = len(ids)
        return first

    def _stats(self) -> dict[str, Any]:
        s = dict(self.stats)
        s["mean_accepted_length"] = (s["num_accepted_tokens"] + s["num_drafts"]) / max(s["num_drafts"], 1)
        return {"spec": s}

    def _step(self, seq: list[int], req: Request) -> list[int]:
        root_pos = len(seq) - 1
        D = self.depth
        if root_pos + D + 1 > self.max_context:  # too close to the end of the context to speculate
            self.draft_len = min(self.draft_len, root_pos)
            return self._decode_one(seq, req)
        catch = seq[self.draft_len:]
        catch_tokens = torch.zeros(1, D + 1, dtype=torch.long)
        catch_tokens[0, :len(catch)] = torch.tensor(catch)
        n_catch, draft_len, root = torch.tensor([len(catch)]), torch.tensor([self.draft_len]), torch.tensor([root_pos])
        dk, dv = self.draft_caches
        ctx = context_bucket(root_pos + 1, self.slots)  # both models read only committed slots
        temp, top_k, top_p = req.temperature, req.top_k, req.top_p

        if self.topk_tree:
            K, N = self.topk_tree
            tokens, parents, q, ck, cv = draft_topk_tree(self.draft, catch_tokens, n_catch, draft_len, dk, dv, D, K, N,
                                                         ctx)
            buf = buffers_from_parents(parents, D, K)
            depth, mask, children, paths = buf.depth, buf.ancestor_mask, buf.children, buf.paths
        else:
            b = self.buffers
            if self.is_chain:
                tokens, q, ck, cv = draft_chain(self.draft, catch_tokens, n_catch, draft_len, dk, dv, D, temp, top_k,
                                                top_p, req.uniforms(D), ctx, req.filtered)
            else:
                tokens, q, ck, cv = draft_static_tree(self.draft, catch_tokens, n_catch, draft_len, dk, dv,
                                                      self.template, ctx)
            depth, mask = b.depth, b.ancestor_mask.unsqueeze(0)
            children, paths = b.children.unsqueeze(0), b.paths.unsqueeze(0)
        commit_kv(dk, dv, ck, cv, draft_len.unsqueeze(1) + torch.arange(D + 1))

        if self.config.scorer == "batch_expansion":
            out = expanded_verify(self.model, tokens, *self.leaves, root, self.k_cache, self.v_cache, ctx)
        else:
            out = tree_verify(self.model, tokens, depth, mask, root, self.k_cache, self.v_cache, ctx)

        method = self.config.acceptance
        if method == "greedy" or (method == "rejection" and req.greedy):
            res = accept_greedy(tokens, out.logits, paths)
        elif method == "rejection":
            res = accept_rejection(tokens, out.logits, q, children, req.uniforms(self.num_nodes + 1),
                                   temp, top_k, top_p, max_depth=D, filtered=req.filtered)
        else:
            res = accept_typical(tokens, out.logits, paths, temp, top_k, top_p,
                                 self.config.posterior_threshold, self.config.posterior_alpha, req.filtered)
        commit_path(self.k_cache, self.v_cache, out.new_k, out.new_v, res.node_ids, root)
        accepted = res.tokens[0].tolist()  # the step's one device→host read
        n = sum(t >= 0 for t in accepted) - 1
        self.draft_len = root_pos + 1
        s = self.stats
        s["num_drafts"] += 1
        s["num_draft_tokens"] += D
        s["num_accepted_tokens"] += n
        for i in range(n):
            s["accepted_per_position"][i] += 1
        return accepted[:n + 1]
