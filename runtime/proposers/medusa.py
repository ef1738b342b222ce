"""Medusa: heads on the target's last hidden state, each guessing one position further; their top-k
candidates fill a static tree in one small graph (no cache, no draft loop)."""

from __future__ import annotations

from specair.compile.catalog import Catalog, GraphSpec
from specair.compile.graph_def import GraphKey
from specair.compile.plan import Plan
from specair.compile.spec_config import SpeculativeConfig, TreeShape
from specair.graphs.heads import medusa_tree
from specair.models.errors import InputError
from specair.models.medusa import load_medusa
from specair.runtime.proposers.base import LastHiddenHead, Proposal, Step, register


@register
class Medusa(LastHiddenHead):
    method = "medusa"
    shipped = "medusa"
    lookahead_key = "medusa_num_heads"

    loader = staticmethod(load_medusa)

    @classmethod
    def check_tree(cls, config: SpeculativeConfig, tree: TreeShape) -> None:
        if tree.dynamic:
            raise InputError("Medusa heads do not condition on the parent token: use a static tree "
                             "(a choice list, 'kary:DxW' or 'mc_sim_7b_63'), not 'topk:KxN'")

    def graph_keys(self, plan: Plan) -> list[GraphKey]:
        shapes = sorted({i for v in plan.variants for i in plan.shapes(v)})
        return [self.draft_key(b, 0, "", i) for b in plan.batch_buckets for i in shapes]

    def draft_key(self, B: int, ctx: int, variant: str, shape: int) -> GraphKey:
        return GraphKey("draft", B, shape=shape)

    def build_graph(self, key: GraphKey, cat: Catalog) -> GraphSpec:
        B, template = key.batch, self.trees[key.shape].template
        inputs = {"hidden": cat.zeros(B, cat.hidden_size, dtype=cat.target.dtype), "root": cat.zeros(B)}
        return GraphSpec(medusa_tree, {"draft": self.draft},
                         {"template": template, "buffers": cat.on_device(template.buffers())}, inputs, ["tree_tokens"])

    def propose(self, step: Step) -> Proposal:
        key = self.draft_key(step.B, step.ctx, step.variant, step.shape)
        out = self.graphs(key, hidden=self.hidden(step), root=step.root)
        return Proposal(out["tree_tokens"])
