"""Every graph a plan needs, as GraphDefs with named example inputs: the one list that `specair compile`
compiles, artifacts load, and the runtime dispatches by `GraphKey`.

The catalogue owns the target's graphs: `prefill` per chunk size (batch bucket 1: prompts are prefilled one
at a time),
`decode` per sampling variant, and `verify` (score the tree and accept from it) per acceptance method
and variant. A proposer declares its own graphs (`graph_keys`) and builds them (`build_graph`) with the
catalogue's helpers; the catalogue knows proposers only through those two methods and a few flags.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Protocol, Sequence

import torch
from torch import Tensor, nn

from specair.compile.graph_def import GraphDef, GraphKey, GraphModule
from specair.compile.plan import Plan
from specair.graphs.steps import decode_step, prefill_chunk
from specair.graphs.verify import leaf_paths, verify_and_accept
from specair.models.llama import Transformer

L = torch.long
SAMPLING = ("temperature", "top_k", "top_p")


def uniform_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """Uniforms enter graphs as float32 (float64 for float64 models): fine enough for inverse-CDF and
    accept tests, and a type every backend takes (Ascend has no float64)."""
    return torch.float64 if model_dtype == torch.float64 else torch.float32


class GraphSpec(NamedTuple):
    """What a builder returns: the function, the models it reads, its static arguments, and named inputs
    (example tensors fixing every shape) and outputs. Inputs reach `fn` as keyword arguments."""

    fn: Callable[..., Any]
    models: dict[str, nn.Module]
    static: dict[str, Any]
    inputs: dict[str, Tensor]
    outputs: Sequence[str]


class ProposerGraphs(Protocol):
    """What the catalogue needs of a proposer (runtime/proposers implements it)."""

    def graph_keys(self, plan: Plan) -> list[GraphKey]: ...

    def build_graph(self, key: GraphKey, catalog: "Catalog") -> GraphSpec: ...


class Catalog:
    """The graphs of one (target, proposer, plan). GraphDefs are built on demand and cached."""

    def __init__(self, target: Transformer, plan: Plan, proposer: ProposerGraphs | None = None) -> None:
        if (plan.speculative is None) != (proposer is None):
            raise ValueError("a speculative plan needs its proposer, and only a speculative plan takes one")
        self.target, self.plan, self.proposer = target, plan, proposer
        self._defs: dict[GraphKey, GraphDef] = {}
        self._caches: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
        # Example caches only fix shapes for a trace; where graphs take caches of any length (eager) they live on
        # the meta device, which holds no memory (at a long context they are gigabytes per batch bucket).
        self.meta_example_caches = False

    # ---- keys ---------------------------------------------------------------------------------------

    def acceptance(self, greedy: bool) -> str:
        """The acceptance method of the verify graph a step uses (exact reduces to greedy matching)."""
        method = self.plan.speculative.acceptance
        return "greedy" if method == "greedy" or (method == "exact" and greedy) else method

    @staticmethod
    def sampled(variant: str) -> str:
        """The variant of a graph that samples but has no greedy form: greedy rows run on the plain one."""
        return "filtered" if variant == "filtered" else "plain"

    def verify_key(self, batch: int, ctx: int, variant: str, shape: int = 0) -> GraphKey:
        method = self.acceptance(variant == "greedy")
        return GraphKey("verify", batch, ctx, method, "" if method == "greedy" else self.sampled(variant),
                        shape=shape)

    def keys(self) -> list[GraphKey]:
        """Every graph of the plan, in compile order; none that the runtime never dispatches."""
        p, out = self.plan, []
        for c in p.ctx_buckets:
            out += [GraphKey("prefill", 1, c, chunk=p.chunk_key(t)) for t in p.chunk_buckets]
        for b in p.batch_buckets:
            for c in p.ctx_buckets:
                out += [GraphKey("decode", b, c, variant=v) for v in p.variants]
                if p.speculative:
                    out += [self.verify_key(b, c, v, i) for v in p.variants for i in p.shapes(v)]
        if self.proposer is not None:
            out += self.proposer.graph_keys(p)
        return list(dict.fromkeys(out))

    # ---- graphs -------------------------------------------------------------------------------------

    def graph(self, key: GraphKey) -> GraphDef:
        if key not in self._defs:
            # Inference tensors, like everything the runtime passes: compiled graphs guard on it.
            with torch.inference_mode():
                builders = {"prefill": self._prefill, "decode": self._decode, "verify": self._verify}
                spec = builders[key.kind](key) if key.kind in builders else self.proposer.build_graph(key, self)
                names = tuple(spec.inputs)
                module = GraphModule(spec.fn, spec.models, spec.static, names)
                self._defs[key] = GraphDef(key.name, module, tuple(spec.inputs.values()), names, tuple(spec.outputs))
        return self._defs[key]

    # ---- helpers for builders (the catalogue's and proposers') ----------------------------------------

    @property
    def device(self) -> torch.device:
        return self.target.tok_embeddings.weight.device

    def on_device(self, tensors: Any) -> Any:
        """Static index tensors moved to the models' device once, so no graph copies from the host."""
        dev = self.device
        moved = [t.to(dev) if isinstance(t, Tensor) else tuple(x.to(dev) for x in t) for t in tensors]
        return type(tensors)(*moved) if hasattr(tensors, "_fields") else tuple(moved)

    def zeros(self, *shape: int, dtype: torch.dtype = L) -> Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def caches(self, model: nn.Module, B: int) -> dict[str, Tensor]:
        """Example caches, one pair per model and batch bucket shared by all its graphs: a cache of a
        large bucket is gigabytes, and every context bucket's graph would otherwise hold its own."""
        key = (id(model), B)
        if key not in self._caches:
            self._caches[key] = model.empty_cache(B, self.plan.slots,
                                                  "meta" if self.meta_example_caches else self.device)
        k, v = self._caches[key]
        return {"k_cache": k, "v_cache": v}

    def sampling(self, B: int) -> dict[str, Tensor]:
        dt = self.target.dtype
        return {"temperature": self.zeros(B, dtype=dt), "top_k": self.zeros(B),
                "top_p": torch.ones(B, dtype=dt, device=self.device)}

    def uniforms(self, *shape: int) -> Tensor:
        return self.zeros(*shape, dtype=uniform_dtype(self.target.dtype))

    @property
    def hidden_size(self) -> int:
        """The width of the target's `hidden` output (its feature size)."""
        return self.target.feature_size

    # ---- the target's graphs --------------------------------------------------------------------------

    def _prefill(self, key: GraphKey) -> GraphSpec:
        B, chunk = key.batch, key.chunk or self.plan.prefill_chunk
        inputs = {"tokens": self.zeros(B, chunk), "cache_len": self.zeros(B),
                  "n_valid": torch.ones(B, dtype=L, device=self.device), **self.caches(self.target, B)}
        return GraphSpec(prefill_chunk, {"target": self.target}, {"ctx": key.ctx}, inputs,
                         ["logits", "hidden", "new_k", "new_v"])

    def _decode(self, key: GraphKey) -> GraphSpec:
        B = key.batch
        inputs = {"tokens": self.zeros(B), "cache_len": self.zeros(B), **self.caches(self.target, B),
                  **self.sampling(B), "uniform": self.uniforms(B)}
        return GraphSpec(decode_step, {"target": self.target}, {"ctx": key.ctx, "variant": key.variant}, inputs,
                         ["next_tokens", "logits", "hidden", "new_k", "new_v"])

    def verify_inputs(self, key: GraphKey, tree_tokens: Tensor, root_pos: Tensor, caches: dict[str, Tensor],
                      parents: Tensor | None, uniforms: Tensor, sampling: dict[str, Tensor]) -> dict[str, Tensor]:
        """The named inputs of verify graph `key`, of those given: parents for a dynamic tree, the uniforms
        for exact acceptance, the sampling parameters unless greedy."""
        inputs = {"tree_tokens": tree_tokens, "root_pos": root_pos, **caches}
        if self.plan.trees[key.shape].dynamic:
            inputs["parents"] = parents
        if key.method == "exact":
            inputs["uniforms"] = uniforms
        if key.method != "greedy":
            inputs.update(sampling)
        return inputs

    def _verify(self, key: GraphKey) -> GraphSpec:
        spec, tree = self.plan.speculative, self.plan.trees[key.shape]
        B, T, D = key.batch, tree.num_nodes, tree.depth
        # A K-ary heap: a valid tree of T nodes within the tree's depth and width.
        heap = (torch.arange(T, dtype=L, device=self.device) - 1).div(tree.max_width, rounding_mode="floor")
        inputs = self.verify_inputs(key, self.zeros(B, T), self.zeros(B), self.caches(self.target, B),
                                    heap.expand(B, -1).contiguous(), self.uniforms(B, D + 1), self.sampling(B))
        static: dict[str, Any] = {"ctx": key.ctx, "acceptance": key.method, "max_depth": D,
                                  "max_width": tree.max_width, "filtered": key.variant == "filtered"}
        if not tree.dynamic:
            buf = tree.template.buffers()
            static["tree"] = self.on_device(buf)
            static["chain"] = bool((buf.parents == torch.arange(T) - 1).all())
            if spec.scorer == "batch_expansion":
                static["expansion"] = self.on_device(leaf_paths(buf.paths, buf.children))
        if key.method == "typical":
            static.update(posterior_threshold=spec.posterior_threshold, posterior_alpha=spec.posterior_alpha)
        return GraphSpec(verify_and_accept, {"target": self.target}, static, inputs,
                         ["num_accepted", "tokens", "node_ids", "path_hidden", "path_k", "path_v"])
