"""MLPSpeculator (IBM / vLLM `mlp_speculator`): a chain of small MLP stages on the target's last hidden
state, each sampling one token and feeding it to the next (no cache)."""

from __future__ import annotations

from specair.compile.catalog import Catalog, GraphSpec
from specair.compile.graph_def import GraphKey
from specair.compile.plan import Plan
from specair.compile.spec_config import SpeculativeConfig, TreeShape
from specair.graphs.heads import mlp_speculator_chain
from specair.models.errors import InputError
from specair.models.mlp_speculator import load_mlp_speculator
from specair.runtime.proposers.base import LastHiddenHead, Proposal, Step, register


@register
class MLPSpeculatorProposer(LastHiddenHead):
    method = "mlp_speculator"
    lookahead_key = "n_predict"

    loader = staticmethod(load_mlp_speculator)

    @classmethod
    def check_tree(cls, config: SpeculativeConfig, tree: TreeShape) -> None:
        if tree.kind != "chain":
            raise InputError("method 'mlp_speculator' proposes a chain; drop 'tree'")

    def draft_key(self, B: int, ctx: int, variant: str, shape: int) -> GraphKey:
        return GraphKey("draft", B, variant=Catalog.sampled(variant), shape=shape)

    def graph_keys(self, plan: Plan) -> list[GraphKey]:
        return list(dict.fromkeys(self.draft_key(b, 0, v, i) for b in plan.batch_buckets for v in plan.variants
                                  for i in plan.shapes(v)))

    def build_graph(self, key: GraphKey, cat: Catalog) -> GraphSpec:
        B, k = key.batch, self.trees[key.shape].depth
        inputs = {"hidden": cat.zeros(B, cat.hidden_size, dtype=cat.target.dtype), "root": cat.zeros(B),
                  **cat.sampling(B), "uniforms": cat.uniforms(B, k)}
        return GraphSpec(mlp_speculator_chain, {"draft": self.draft},
                         {"k": k, "filtered": key.variant == "filtered"}, inputs, ["tree_tokens"])

    def propose(self, step: Step) -> Proposal:
        key = self.draft_key(step.B, step.ctx, step.variant, step.shape)
        out = self.graphs(key, hidden=self.hidden(step), root=step.root,
                          **step.sampling, uniforms=step.uniforms)
        return Proposal(out["tree_tokens"])
