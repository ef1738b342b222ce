"""Every graph a plan needs, as GraphDefs with example inputs: the one list that `specair compile`
compiles, artifacts load, and the runtime dispatches by key.

Keys: `prefill.{target|draft}.b{B}.c{C}`, `decode.b{B}.c{C}.{variant}`, `draft.b{B}.c{C}[.{variant}]`
(`draft.b{B}[.{variant}]` for heads on the target's hidden state, which read no cache), `verify.b{B}.c{C}`,
`tree.b{B}` (per-row buffers of a topk tree), `accept.b{B}.{method}[.{variant}]`. An n-gram proposer runs on
the host: its plans have no draft graphs.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import Tensor

from specair.compile.graph_def import GraphDef, GraphModule
from specair.compile.plan import Plan
from specair.compile.spec_config import CACHED_DRAFTS
from specair.graphs.acceptance import accept_greedy, accept_rejection, accept_typical
from specair.graphs.draft import draft_chain, draft_static_tree, draft_topk_tree
from specair.graphs.heads import medusa_tree, mlp_speculator_chain
from specair.graphs.steps import decode_step, prefill_chunk
from specair.graphs.tree import buffers_from_parents
from specair.graphs.verify import expanded_verify, leaf_paths, tree_verify
from specair.models.llama import Transformer

L = torch.long


def uniform_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """Uniforms enter graphs as float32 (float64 for float64 models): fine enough for inverse-CDF and
    accept tests, and a type every backend takes (Ascend has no float64)."""
    return torch.float64 if model_dtype == torch.float64 else torch.float32


class Catalog:
    """The graphs of one (target, draft, plan). GraphDefs are built on demand and cached."""

    def __init__(self, target: Transformer, plan: Plan, draft: Transformer | None = None) -> None:
        self.target, self.draft, self.plan = target, draft, plan
        self.spec = plan.speculative
        if self.spec is not None and draft is None and self.spec.method != "ngram":
            raise ValueError(f"a {self.spec.method} plan needs its draft model or heads")
        self._defs: dict[str, GraphDef] = {}
        self._caches: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}

    # ---- keys ---------------------------------------------------------------------------------------

    def acceptance(self, greedy: bool) -> str:
        """The acceptance graph method a request uses."""
        method = self.spec.acceptance
        return "greedy" if method == "greedy" or (method == "rejection" and greedy) else method

    def key(self, kind: str, batch: int, ctx: int = 0, variant: str = "", method: str = "") -> str:
        parts = {
            "prefill.target": f"b{batch}.c{ctx}", "prefill.draft": f"b{batch}.c{ctx}",
            "decode": f"b{batch}.c{ctx}.{variant}", "verify": f"b{batch}.c{ctx}", "tree": f"b{batch}",
            "draft": (f"b{batch}" if self._heads else f"b{batch}.c{ctx}")
                     + (f".{self._filtered(variant)}" if self._chain else ""),
            "accept": f"b{batch}.{method}" + (f".{self._filtered(variant)}" if method != "greedy" else ""),
        }
        return f"{kind}.{parts[kind]}"

    def keys(self) -> list[str]:
        """Every key of the plan, in compile order."""
        p, out = self.plan, []
        for b in p.batch_buckets:
            for c in p.ctx_buckets:
                out.append(self.key("prefill.target", b, c))
                out += [self.key("decode", b, c, v) for v in p.variants]
                if self.spec:
                    if self.spec.method in CACHED_DRAFTS:
                        out.append(self.key("prefill.draft", b, c))
                    if self.spec.method != "ngram":
                        out += [self.key("draft", b, c, v) for v in p.variants]
                    out.append(self.key("verify", b, c))
            if self.spec:
                if p.tree.kind == "topk":
                    out.append(self.key("tree", b))
                out += [self.key("accept", b, variant=v, method=self.acceptance(v == "greedy")) for v in p.variants]
        return list(dict.fromkeys(out))

    @property
    def _chain(self) -> bool:
        """Sampled chains: the draft graph depends on the sampling variant."""
        return self.plan.tree is not None and self.plan.tree.kind == "chain" and self.spec.method != "medusa"

    @property
    def _heads(self) -> bool:
        return self.spec is not None and self.spec.method in ("medusa", "mlp_speculator")

    @staticmethod
    def _filtered(variant: str) -> str:
        return "filtered" if variant == "filtered" else "plain"

    # ---- graphs -------------------------------------------------------------------------------------

    def graph(self, key: str) -> GraphDef:
        if key not in self._defs:
            # Inference tensors, like everything the runtime passes: compiled graphs guard on it.
            with torch.inference_mode():
                self._defs[key] = self._build(key)
        return self._defs[key]

    def _build(self, key: str) -> GraphDef:
        parts = key.split(".")
        kind = parts[0] if parts[0] not in ("prefill",) else f"{parts[0]}.{parts[1]}"
        fields = {p[0]: p[1:] for p in parts if p[:1] in ("b", "c") and p[1:].isdigit()}
        B, C = int(fields["b"]), int(fields.get("c", 0))
        variant = parts[-1] if parts[-1] in ("greedy", "plain", "filtered") else ""
        builders: dict[str, Callable[..., tuple]] = {
            "prefill.target": functools.partial(self._prefill, self.target),
            "prefill.draft": functools.partial(self._prefill, self.draft),
            "decode": self._decode, "draft": self._draft, "verify": self._verify, "tree": self._tree,
            "accept": self._accept,
        }
        method = parts[2] if kind == "accept" else ""
        fn, models, static, inputs, in_names, out_names = builders[kind](B=B, C=C, variant=variant, method=method)
        return GraphDef(key, GraphModule(fn, models, static), tuple(inputs), tuple(in_names), tuple(out_names))

    def _on_device(self, tensors):
        """Static index tensors moved to the models' device once, so no graph copies from the host."""
        dev = self.target.tok_embeddings.weight.device
        moved = [t.to(dev) if isinstance(t, Tensor) else tuple(x.to(dev) for x in t) for t in tensors]
        return type(tensors)(*moved) if hasattr(tensors, "_fields") else tuple(moved)

    def caches(self, model: Transformer, B: int) -> tuple[Tensor, Tensor]:
        """Example caches, one pair per model and batch bucket shared by all its graphs: a cache of a
        large bucket is gigabytes, and every context bucket's graph would otherwise hold its own."""
        key = (id(model), B)
        if key not in self._caches:
            self._caches[key] = model.empty_cache(B, self.plan.slots)
        return self._caches[key]

    def _sampling(self, B: int) -> list[Tensor]:
        dt = self.target.dtype
        return [torch.zeros(B, dtype=dt), torch.zeros(B, dtype=L), torch.ones(B, dtype=dt)]

    def _prefill(self, model: Transformer, B: int, C: int, **_):
        chunk = self.plan.prefill_chunk
        k, v = self.caches(model, B)
        inputs = [torch.zeros(B, chunk, dtype=L), torch.zeros(B, dtype=L), torch.ones(B, dtype=L), k, v]
        names = ["tokens", "cache_len", "n_valid", "k_cache", "v_cache"]
        role = "target" if model is self.target else "draft"
        fn = prefill_chunk
        if role == "draft" and self.spec.method == "eagle":  # entry p pairs token p+1 with target hidden p
            fn = _eagle_prefill_graph
            inputs.append(torch.zeros(B, chunk, self._hidden_size, dtype=self.target.dtype))
            names.append("input_hidden")
        return fn, {role: model}, {"ctx": C}, inputs, names, ["logits", "hidden", "new_k", "new_v"]

    @property
    def _hidden_size(self) -> int:
        return self.target.config.hidden_size

    def _decode(self, B: int, C: int, variant: str, **_):
        k, v = self.caches(self.target, B)
        inputs = [torch.zeros(B, dtype=L), torch.zeros(B, dtype=L), k, v, *self._sampling(B),
                  torch.zeros(B, dtype=uniform_dtype(self.target.dtype))]
        return (decode_step, {"target": self.target}, {"ctx": C, "variant": variant}, inputs,
                ["tokens", "cache_len", "k_cache", "v_cache", "temperature", "top_k", "top_p", "uniform"],
                ["next_tokens", "logits", "hidden", "new_k", "new_v"])

    def _draft(self, B: int, C: int, variant: str, **_):
        tree = self.plan.tree
        D = tree.depth
        method = self.spec.method
        if method == "medusa":
            return (medusa_tree, {"draft": self.draft},
                    {"template": tree.template, "buffers": self._on_device(tree.template.buffers())},
                    [torch.zeros(B, self._hidden_size, dtype=self.target.dtype), torch.zeros(B, dtype=L)],
                    ["hidden", "root"], ["tree_tokens", "draft_probs"])
        if method == "mlp_speculator":
            return (_mlp_chain_graph, {"draft": self.draft}, {"k": D, "filtered": variant == "filtered"},
                    [torch.zeros(B, self._hidden_size, dtype=self.target.dtype), torch.zeros(B, dtype=L),
                     *self._sampling(B), torch.zeros(B, D, dtype=uniform_dtype(self.target.dtype))],
                    ["hidden", "root", "temperature", "top_k", "top_p", "uniforms"], ["tree_tokens", "draft_probs"])
        k, v = self.caches(self.draft, B)
        base = [torch.zeros(B, D + 1, dtype=L), torch.ones(B, dtype=L), torch.zeros(B, dtype=L), k, v]
        names = ["catch_tokens", "n_catch", "draft_len", "k_cache", "v_cache"]
        outs = ["tree_tokens", "draft_probs", "catch_k", "catch_v"]
        if tree.kind == "chain":
            fn = _draft_chain_graph
            static = {"k": D, "ctx": C, "filtered": variant == "filtered"}
            base += [*self._sampling(B), torch.zeros(B, D, dtype=uniform_dtype(self.target.dtype))]
            names += ["temperature", "top_k", "top_p", "uniforms"]
        elif tree.kind == "static":
            fn, static = draft_static_tree, {"template": tree.template, "ctx": C,
                                             "buffers": self._on_device(tree.template.buffers())}
        else:
            fn = draft_topk_tree
            static = {"depth": D, "topk": tree.topk, "num_nodes": tree.num_nodes - 1, "ctx": C}
            outs = ["tree_tokens", "parents", "draft_probs", "catch_k", "catch_v"]
        if method == "eagle":  # the catch-up entries' target hidden states
            static = {**static, "draft_fn": fn}
            fn = _eagle_draft_graph
            base.append(torch.zeros(B, D + 1, self._hidden_size, dtype=self.target.dtype))
            names.append("catch_hidden")
        return fn, {"draft": self.draft}, static, base, names, outs

    def _verify(self, B: int, C: int, **_):
        tree = self.plan.tree
        T = tree.num_nodes
        k, v = self.caches(self.target, B)
        outs = ["logits", "hidden", "new_k", "new_v"]
        if self.spec.scorer == "batch_expansion":
            buf = tree.template.buffers()
            lp, where, index = leaf_paths(buf.paths, buf.children)
            return (_expanded_verify_graph, {"target": self.target}, {"ctx": C, "paths": self._on_device((lp, where, index))},
                    [torch.zeros(B, T, dtype=L), torch.zeros(B, dtype=L), k, v],
                    ["tree_tokens", "root_pos", "k_cache", "v_cache"], outs)
        return (tree_verify, {"target": self.target}, {"ctx": C},
                [torch.zeros(B, T, dtype=L), torch.zeros(B, T, dtype=L),
                 torch.eye(T, dtype=torch.bool).expand(B, T, T).contiguous(), torch.zeros(B, dtype=L), k, v],
                ["tree_tokens", "depth", "tree_mask", "root_pos", "k_cache", "v_cache"], outs)

    def _tree(self, B: int, **_):
        tree = self.plan.tree
        parents = torch.arange(-1, tree.num_nodes - 1, dtype=L).expand(B, -1).contiguous()
        return (buffers_from_parents, {}, {"max_depth": tree.depth, "max_width": tree.max_width}, [parents],
                ["parents"], ["depth", "ancestor_mask", "children", "paths"])

    def _accept(self, B: int, variant: str, method: str, **_):
        tree = self.plan.tree
        T, D, W = tree.num_nodes, tree.depth, tree.max_width
        V = self.target.config.vocab_size
        dt = self.target.dtype
        tokens, logits = torch.zeros(B, T, dtype=L), torch.zeros(B, T, V, dtype=dt)
        paths = torch.zeros(B, T, D + 1, dtype=L)
        outs = ["num_accepted", "tokens", "node_ids"]
        filtered = variant == "filtered"
        if method == "greedy":
            return accept_greedy, {}, {}, [tokens, logits, paths], ["tree_tokens", "target_logits", "paths"], outs
        if method == "typical":
            s = self.spec
            return (accept_typical, {}, {"posterior_threshold": s.posterior_threshold,
                                         "posterior_alpha": s.posterior_alpha, "filtered": filtered},
                    [tokens, logits, paths, *self._sampling(B)],
                    ["tree_tokens", "target_logits", "paths", "temperature", "top_k", "top_p"], outs)
        return (accept_rejection, {}, {"max_depth": D, "filtered": filtered},
                [tokens, logits, torch.zeros(B, T, V, dtype=dt), torch.zeros(B, T, W, dtype=L),
                 torch.zeros(B, T + 1, dtype=uniform_dtype(self.target.dtype)), *self._sampling(B)],
                ["tree_tokens", "target_logits", "draft_probs", "children", "uniforms", "temperature", "top_k",
                 "top_p"], outs)


def _draft_chain_graph(draft: Transformer, catch_tokens: Tensor, n_catch: Tensor, draft_len: Tensor,
                       k_cache: Tensor, v_cache: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor,
                       uniforms: Tensor, catch_hidden: Tensor | None = None, *, k: int, ctx: int, filtered: bool):
    return draft_chain(draft, catch_tokens, n_catch, draft_len, k_cache, v_cache, k, temperature, top_k, top_p,
                       uniforms, ctx, filtered, catch_hidden=catch_hidden)


def _mlp_chain_graph(spec, hidden: Tensor, root: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor,
                     uniforms: Tensor, *, k: int, filtered: bool):
    return mlp_speculator_chain(spec, hidden, root, k, temperature, top_k, top_p, uniforms, filtered)


def _eagle_draft_graph(draft, *inputs: Tensor, draft_fn: Callable[..., tuple], **static):
    """An EAGLE draft: the tree/chain function with the catch-up's target hidden states (the last input)."""
    if draft_fn is _draft_chain_graph:
        return draft_fn(draft, *inputs, **static)
    *rest, catch_hidden = inputs
    return draft_fn(draft, *rest, catch_hidden=catch_hidden, **static)


def _eagle_prefill_graph(model, tokens: Tensor, cache_len: Tensor, n_valid: Tensor, k_cache: Tensor,
                         v_cache: Tensor, input_hidden: Tensor, *, ctx: int):
    return prefill_chunk(model, tokens, cache_len, n_valid, k_cache, v_cache, ctx, input_hidden=input_hidden)


def _expanded_verify_graph(model: Transformer, tree_tokens: Tensor, root_pos: Tensor, k_cache: Tensor,
                           v_cache: Tensor, *, ctx: int, paths: tuple[Tensor, Tensor, Tensor]):
    return expanded_verify(model, tree_tokens, *paths, root_pos, k_cache, v_cache, ctx)
