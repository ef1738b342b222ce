"""Fewer, larger operators on specair's kernels: a decode step of a small model is mostly per-operator overhead.

After quantization, each `specair.ort::RMSNorm` or `SwiGLU` whose output feeds only block products becomes
their prologue (MatMulBlocks normalises or gates each row itself before quantizing it), and a residual `Add`
of a block product's output becomes that product's residual input. Every fused step computes what the
operator it replaces computes, row by row, so the graph stays row-independent and its values are unchanged.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from specair.compile import kernels

_RESIDUAL = 4  # MatMulBlocks' inputs: x, records, super, RMSNorm weight, residual


def _attr(node: Any, name: str) -> Any:
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return None


def _set_input(node: Any, i: int, name: str) -> None:
    while len(node.input) <= i:
        node.input.append("")
    node.input[i] = name


def _topological(nodes: list[Any]) -> list[Any]:
    """`nodes` ordered so each comes after the producers of its inputs (stable where already so)."""
    produced = {o for n in nodes for o in n.output}
    out, pending, done = [], list(nodes), {i for n in nodes for i in n.input if i not in produced}
    while pending:
        rest = []
        for n in pending:
            if all(not i or i in done for i in n.input):
                out.append(n)
                done.update(n.output)
            else:
                rest.append(n)
        if len(rest) == len(pending):
            raise ValueError("onnx_fusion: the graph has a cycle")
        pending = rest
    return out


def fuse_rowwise(model: Any) -> int:
    """Fold RMSNorm/SwiGLU operators into the MatMulBlocks they feed, and residual Adds into the MatMulBlocks
    whose output they add; returns how many operators it removed."""
    import onnx
    from onnx import helper

    g = model.graph
    outputs = {o.name for o in g.output}
    consumers: dict[str, list[Any]] = defaultdict(list)
    producer: dict[str, Any] = {}
    for n in g.node:
        for i in n.input:
            consumers[i].append(n)
        for o in n.output:
            producer[o] = n
    blocks = lambda n: n.op_type == kernels.OP and n.domain == kernels.DOMAIN  # noqa: E731
    removed = set()
    for n in g.node:
        if n.domain != kernels.DOMAIN or n.op_type not in (kernels.RMSNORM, kernels.SWIGLU):
            continue
        users = consumers[n.output[0]]
        if n.output[0] in outputs or not users or any(
                not blocks(u) or list(u.input).index(n.output[0]) != 0 or _attr(u, "prologue") for u in users):
            continue
        for u in users:
            u.input[0] = n.input[0]
            if n.op_type == kernels.RMSNORM:
                u.attribute.extend([helper.make_attribute("prologue", "rmsnorm"),
                                    helper.make_attribute("epsilon", float(_attr(n, "epsilon")))])
                _set_input(u, 3, n.input[1])
            else:
                u.attribute.append(helper.make_attribute("prologue", "swiglu"))
        removed.add(id(n))

    # static shapes as the exporter recorded them (onnx's inference cannot see through specair's operators)
    shapes = {}
    infos = list(g.value_info) + list(g.input) + list(g.output)
    try:
        inferred = onnx.shape_inference.infer_shapes(model).graph
        infos += list(inferred.value_info)
    except Exception:  # noqa: BLE001 - the recorded shapes alone
        pass
    for vi in infos:
        dims = vi.type.tensor_type.shape.dim
        if vi.name not in shapes and vi.type.tensor_type.HasField("shape") and dims and all(
                d.HasField("dim_value") for d in dims):
            shapes[vi.name] = [d.dim_value for d in dims]
    for n in g.node:
        if n.op_type != "Add" or n.domain or len(n.input) != 2:
            continue
        for i in (0, 1):
            m, r = producer.get(n.input[i]), n.input[1 - i]
            # a residual is computed (a bias is a weight, broadcast) and, where shapes are recorded, the same
            # shape; MatMulBlocks checks the shape again when it runs
            known = [shapes[t] for t in (r, n.input[i], n.output[0]) if t in shapes]
            same = r in producer and all(k == known[0] for k in known)
            if (m is not None and blocks(m) and id(m) not in removed and same and m.output[0] not in outputs
                    and len(consumers[m.output[0]]) == 1 and not (len(m.input) > _RESIDUAL and m.input[_RESIDUAL])):
                _set_input(m, _RESIDUAL, r)
                m.output[0] = n.output[0]
                removed.add(id(n))
                break
    if removed:
        kept = [n for n in g.node if id(n) not in removed]
        del g.node[:]
        g.node.extend(_topological(kept))
    return len(removed)
