"""The speculative loop: draft → verify → accept → commit, every stage a graph from the GraphSet, one
device→host read (the accepted tokens) per step.
"""

from __future__ import annotations

from typing import Any

import torch

from specair.compile.artifacts import GraphSet
from specair.compile.spec_config import SpeculativeConfig
from specair.graphs.kv import commit_kv, commit_path
from specair.models.errors import InputError
from specair.models.llama import Transformer
from specair.runtime.reference import Decoder, Request


class SpeculativeDecoder(Decoder):
    """Speculative decoding with a draft model (or the target's own first layers) proposing a tree."""

    def __init__(self, model: Transformer, draft: Transformer, config: SpeculativeConfig | None = None,
                 tokenizer: Any = None, max_context: int | None = None, prefill_chunk_size: int = 128,
                 backend: str = "eager", graphs: GraphSet | None = None) -> None:
        if draft.config.vocab_size != model.config.vocab_size:
            raise InputError(f"the draft's vocabulary ({draft.config.vocab_size} tokens) differs from the "
                             f"target's ({model.config.vocab_size}); a draft must share the target's tokenizer")
        super().__init__(model, tokenizer, max_context, prefill_chunk_size, draft=draft, speculative=config,
                         backend=backend, graphs=graphs)
        self.config, self.tree = self.plan.speculative, self.plan.tree
        self.depth = self.tree.depth
        with torch.inference_mode():
            self.draft_caches = draft.empty_cache(1, self.plan.slots)
        if self.tree.kind != "topk":
            b = self.tree.template.buffers()
            with torch.inference_mode():
                self.static = tuple(t.unsqueeze(0).clone() for t in (b.depth, b.ancestor_mask, b.children, b.paths))

    def _start(self, ids: list[int], req: Request) -> int:
        if self.config.acceptance == "greedy" and not req.greedy:
            raise InputError("acceptance 'greedy' needs temperature 0; use 'rejection' to sample exactly")
        self.stats = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                      "accepted_per_position": [0] * self.depth}
        first = super()._start(ids, req)
        self.prefill(ids, role="draft")
        self.draft_len = len(ids)
        return first

    def _stats(self) -> dict[str, Any]:
        s = dict(self.stats)
        s["mean_accepted_length"] = (s["num_accepted_tokens"] + s["num_drafts"]) / max(s["num_drafts"], 1)
        return {"spec": s}

    def _step(self, seq: list[int], req: Request) -> list[int]:
        root_pos, D, tree, cat = len(seq) - 1, self.depth, self.tree, self.catalog
        if root_pos + D + 1 > self.max_context:  # too close to the end of the context to speculate
            self.draft_len = min(self.draft_len, root_pos)
            return self._decode_one(seq, req)
        catch = seq[self.draft_len:]
        catch_tokens = torch.zeros(1, D + 1, dtype=torch.long)
        catch_tokens[0, :len(catch)] = torch.tensor(catch)
        draft_len, root = torch.tensor([self.draft_len]), torch.tensor([root_pos])
        dk, dv = self.draft_caches
        ctx = self.plan.context_bucket(root_pos)  # both models read only committed slots
        variant = self.plan.variant_for(req.variant)
        sampling = (req.temperature, req.top_k, req.top_p)

        draft_in = (catch_tokens, torch.tensor([len(catch)]), draft_len, dk, dv)
        if tree.kind == "chain":
            draft_in += (*sampling, req.uniforms(D))
        out = self.graphs(cat.key("draft", 1, ctx, variant), *draft_in)
        if tree.kind == "topk":
            tokens, parents, q, ck, cv = out
            depth, mask, children, paths = self.graphs(cat.key("tree", 1), parents)
        else:
            tokens, q, ck, cv = out
            depth, mask, children, paths = self.static
        commit_kv(dk, dv, ck, cv, draft_len.unsqueeze(1) + torch.arange(D + 1))

        verify_in = (tokens, root) if self.config.scorer == "batch_expansion" else (tokens, depth, mask, root)
        _, _, new_k, new_v = verify = self.graphs(cat.key("verify", 1, ctx), *verify_in, self.k_cache, self.v_cache)
        logits = verify[0]

        method = cat.acceptance(req.greedy)
        key = cat.key("accept", 1, variant=variant, method=method)
        if method == "greedy":
            _, acc_tokens, node_ids = self.graphs(key, tokens, logits, paths)
        elif method == "typical":
            _, acc_tokens, node_ids = self.graphs(key, tokens, logits, paths, *sampling)
        else:
            _, acc_tokens, node_ids = self.graphs(key, tokens, logits, q, children, req.uniforms(tree.num_nodes + 1),
                                                  *sampling)
        commit_path(self.k_cache, self.v_cache, new_k, new_v, node_ids, root)
        accepted = acc_tokens[0].tolist()  # the step's one device→host read
        n = sum(t >= 0 for t in accepted) - 1
        self.draft_len = root_pos + 1
        s = self.stats
        s["num_drafts"] += 1
        s["num_draft_tokens"] += D
        s["num_accepted_tokens"] += n
        for i in range(n):
            s["accepted_per_position"][i] += 1
        return accepted[:n + 1]
