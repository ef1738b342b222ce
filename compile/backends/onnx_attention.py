"""Fused attention for onnxruntime: each layer's attention as one com.microsoft GroupQueryAttention node that
reads the layer's whole KV cache in place.

Exported as plain ONNX, a layer's attention is ~35 nodes, and the cache reaches it through a Slice to the
context bucket and a Gather per layer: onnxruntime has no views, so both copy the cache on every step.
GroupQueryAttention (the kernel ONNX Runtime GenAI runs on CPU) takes the layer's cache buffer
[B, Hkv, S, D] itself and per-row lengths (`seqlens_k` = committed length + T - 1), reads only the used
slots, and writes the step's K/V into the buffer at slots cache_len..cache_len+T-1 when its `present`
outputs are bound to the same memory (past/present buffer sharing). Those slots lie past the committed
length, where nothing reads until the runtime commits there (prefill and decode commit exactly what was
written; a verify commits the accepted path over it), so the graphs stay correct under the runtime's
contract that only commits change what attention can see.

Capture: while a graph is exported, `use_attention(kernel)` routes every layer through `kernel`, which
traces `_Fused` (a `specair::FusedAttention` node, RoPE included) where the fused op applies, and
`rope_attend` elsewhere; then `lower_fused_attention` turns each node into two com.microsoft RotaryEmbedding
nodes (q and k, indexing the whole RoPE tables by position, so trees rotate by depth) and GroupQueryAttention,
replaces the Slice/Gather chain in front of its cache inputs by one graph input per layer (`k_cache.<layer>`)
and adds the in-place outputs (`k_cache.<layer>.present`), which OrtGraph binds to the caller's cache.
With `row_independent` (where specair's kernel library builds) the node is `specair.ort::CacheAttention`
instead, GroupQueryAttention's contract computed so that a verify row equals the decode step of its token
bit for bit (compile/kernels/attention.h). Where nothing else reads the rotated q and k, either kernel takes
the packed projection and applies RoPE itself (`_pack_rotary`).
Applies when the step has no earlier uncached tokens (`k_prev`), no sliding window, float32, and one row
or one token per row (the CPU kernel takes several new tokens after a cache only at batch 1); a tree's
visibility among its T tokens enters as `attention_bias` over the slots, on top of the kernel's causal
mask (a tree lists parents before children, so ancestors are always earlier).
"""

from __future__ import annotations

import torch
from torch import Tensor

from specair.compile import kernels
from specair.models.llama import AttentionInputs, rope_attend
from specair.models.llama import static_shape as _static_shape

DOMAIN = "specair"
FUSED = "FusedAttention"
PRESENT = ".present"


class _Fused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, positions, cos, sin, k_past, v_past, mask, seqlens, bias, scale, shape, slots):  # noqa: ARG004
        B, T, H, Hkv, D = shape
        c, s = cos[positions].unsqueeze(2), sin[positions].unsqueeze(2)
        out, k_rot = rope_attend(q, k, v, c, s, k_past, v_past, mask, None, None, scale, (H, Hkv))
        return out, k_rot.reshape(B, T, Hkv * D)

    @staticmethod
    def symbolic(g, q, k, v, positions, cos, sin, k_past, v_past, mask, seqlens, bias, scale, shape, slots):  # noqa: ARG004
        args = [q, k, v, k_past, v_past, seqlens, positions, cos, sin]
        if bias is not None and not bias.node().mustBeNone():
            args.append(bias)
        B, T, H, Hkv, D = shape
        out, k_rot, k_present, v_present = g.op(
            f"{DOMAIN}::{FUSED}", *args, outputs=4, kv_heads_i=Hkv, slots_i=slots, scale_f=scale, batch_i=B,
            tokens_i=T, heads_i=H, head_dim_i=D)
        out.setType(q.type().with_sizes([B, T, H * D]))  # static types keep the exporter's shapes static
        k_rot.setType(q.type().with_sizes([B, T, Hkv * D]))
        for present in (k_present, v_present):
            present.setType(q.type().with_sizes([B, Hkv, slots, D]))
        return out, k_rot


def _tree_bias(cache_len: Tensor, tree_mask: Tensor, T: int, slots: int, dtype: torch.dtype) -> Tensor:
    """Additive bias [B, 1, T, slots]: 0, except finfo.min where a step token must not see another one."""
    B = cache_len.shape[0]
    cols = (cache_len.view(B, 1, 1, 1) + torch.arange(T, device=cache_len.device).view(1, 1, 1, T)).expand(B, 1, T, T)
    hidden = torch.where(tree_mask.expand(B, T, T).unsqueeze(1), 0.0, torch.finfo(dtype).min).to(dtype)
    return torch.zeros(B, 1, T, slots, dtype=dtype, device=cache_len.device).scatter(3, cols, hidden)




def fused_kernel(slots: int):
    """The attention kernel for `use_attention` while exporting graphs whose caches have `slots` slots."""

    def kernel(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_past: Tensor, v_past: Tensor,
               mask: Tensor, k_prev: Tensor | None, v_prev: Tensor | None, scale: float, heads: tuple[int, int],
               inputs: AttentionInputs) -> tuple[Tensor, Tensor]:
        B, T, HD = _static_shape(q)
        H, Hkv = heads
        D = HD // H
        tree = inputs.tree_mask
        if (k_prev is not None or inputs.sliding_window is not None or q.dtype != torch.float32
                or not (B == 1 or T == 1) or (tree is not None and _static_shape(tree)[-1] != T)
                # GroupQueryAttention refuses RoPE tables shorter than the cache plus the new tokens.
                or _static_shape(inputs.rope[0])[0] < slots + T):
            return rope_attend(q, k, v, cos, sin, k_past, v_past, mask, k_prev, v_prev, scale, heads)
        seqlens = (inputs.cache_len + (T - 1)).to(torch.int32)
        bias = None if tree is None or T == 1 else _tree_bias(inputs.cache_len, tree, T, slots, q.dtype)
        out, k_rot = _Fused.apply(q, k, v, inputs.positions, *inputs.rope, k_past, v_past, mask, seqlens, bias,
                                  scale, (B, T, H, Hkv, D), slots)
        return out, k_rot.view(B, T, Hkv, D)

    return kernel


def _constant(g, name: str, producers: dict | None = None):
    """The value of `name` if it is constant: an initializer, a Constant, or a few shape-only ops over
    constants (the exporter runs without constant folding); else None."""
    import numpy as np
    from onnx import helper, numpy_helper

    for t in g.initializer:
        if t.name == name:
            return numpy_helper.to_array(t)
    producers = producers if producers is not None else {o: n for n in g.node for o in n.output}
    n = producers.get(name)
    if n is None:
        return None
    if n.op_type == "Constant":
        return numpy_helper.to_array(n.attribute[0].t)
    args = [_constant(g, i, producers) if i else None for i in n.input]
    if not args or args[0] is None:
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
    if n.op_type in ("Unsqueeze", "Squeeze"):
        axes = attrs.get("axes", None if len(args) < 2 or args[1] is None else args[1].ravel().tolist())
        x = args[0]
        if n.op_type == "Squeeze":
            return np.squeeze(x, axis=tuple(axes)) if axes is not None else np.squeeze(x)
        for a in sorted(int(a) % (x.ndim + len(axes)) for a in axes):
            x = np.expand_dims(x, a)
        return x
    if n.op_type == "Concat" and all(a is not None for a in args):
        return np.concatenate(args, axis=attrs["axis"])
    if n.op_type in ("Identity", "Cast"):
        return args[0]
    return None


def _keeps_rows(g, n, inputs: dict) -> bool:
    """Whether Slice node n keeps all of axes 0 and 1 (layers, rows) of its input (rank 5 when unknown)."""
    vals = [_constant(g, x) if i < len(n.input) and n.input[i] else None for i, x in
            enumerate(list(n.input) + [""] * (5 - len(n.input)))][1:5]
    starts, ends, axes, steps = vals
    if starts is None or ends is None:
        return False
    rank = len(inputs[n.input[0]].type.tensor_type.shape.dim) if n.input[0] in inputs else 5
    axes = range(len(starts)) if axes is None else [int(a) % rank for a in axes.ravel()]
    steps = [1] * len(starts) if steps is None else steps.ravel()
    for a, b, e, st in zip(axes, starts.ravel(), ends.ravel(), steps):
        if a in (0, 1) and (int(b) != 0 or int(st) != 1 or int(e) < 2**31 - 1):
            return False
    return True


def _cache_source(g, producers: dict, inputs: dict, name: str) -> tuple[str, int]:
    """The graph input and layer a fused node's cache operand is a slice of (through Slice over slots,
    Gather or Split over layers, Squeeze/Unsqueeze/Identity); else the export cannot fuse it."""
    from specair.compile.backends.onnx import OnnxExportError

    layer, start = None, name
    while name not in inputs:
        n = producers.get(name)
        if n is None:
            raise OnnxExportError(f"fused attention: cache operand {start!r} is not a slice of a graph input")
        if n.op_type == "Slice":
            if not _keeps_rows(g, n, inputs):
                raise OnnxExportError(f"fused attention: cache operand {start!r} is sliced across layers or rows")
        elif n.op_type == "Gather":
            axis = next((a.i for a in n.attribute if a.name == "axis"), 0)
            idx = _constant(g, n.input[1])
            if axis != 0 or idx is None or idx.ndim != 0:
                raise OnnxExportError(f"fused attention: cache operand {start!r} is not one layer of a cache")
            layer = int(idx)
        elif n.op_type == "Split":
            axis = next((a.i for a in n.attribute if a.name == "axis"), 0)
            if axis != 0:
                raise OnnxExportError(f"fused attention: cache operand {start!r} is not one layer of a cache")
            layer = list(n.output).index(name)
        elif n.op_type not in ("Squeeze", "Unsqueeze", "Identity"):
            raise OnnxExportError(f"fused attention: cache operand {start!r} comes through a {n.op_type} node")
        name = n.input[0]
    if layer is None:
        raise OnnxExportError(f"fused attention: cache operand {start!r} is a whole cache, not one layer")
    return name, layer


def lower_fused_attention(model, row_independent: bool = False) -> int:
    """Rewrite every specair::FusedAttention node of an exported model into GroupQueryAttention over
    per-layer cache inputs with in-place outputs (see the module docstring). Returns how many."""
    import onnx
    from onnx import TensorProto, helper

    g = model.graph
    fused = [n for n in g.node if n.domain == DOMAIN and n.op_type == FUSED]
    if not fused:
        return 0
    producers = {o: n for n in g.node for o in n.output}
    inputs = {vi.name: vi for vi in g.input}
    added: set[str] = set()
    before: dict[str, list] = {}  # GroupQueryAttention node name -> the RotaryEmbedding nodes feeding it
    for n in fused:
        a = {x.name: helper.get_attribute_value(x) for x in n.attribute}
        past = []
        for operand in n.input[3:5]:
            src, layer = _cache_source(g, producers, inputs, operand)
            name = f"{src}.{layer}"
            if name not in added:
                t = inputs[src].type.tensor_type
                dims = [d.dim_value for d in t.shape.dim][1:]
                g.input.append(helper.make_tensor_value_info(name, t.elem_type, dims))
                g.output.append(helper.make_tensor_value_info(name + PRESENT, t.elem_type, dims))
                added.add(name)
            past.append(name)
        total = f"{n.output[0]}/total"
        g.initializer.append(helper.make_tensor(total, TensorProto.INT32, [], [a["slots"]]))
        q, k, v, _, _, seqlens, positions, cos, sin = n.input[:9]
        name = n.name or n.output[0]
        q_rot, k_rot = f"{name}/q_rot", n.output[1]
        # RoPE as nodes of their own, because GroupQueryAttention's do_rotary would leave the rotated K only
        # inside the cache; where the graph returns no new K, _pack_rotary folds them into do_rotary.
        rotary = [helper.make_node("RotaryEmbedding", [x, positions, cos, sin], [y], name=f"{name}/rotary_{c}",
                                   domain="com.microsoft") for c, x, y in (("q", q, q_rot), ("k", k, k_rot))]
        args = [q_rot, k_rot, v] + past + [seqlens, total]
        if row_independent:
            op, domain = kernels.ATTENTION, kernels.DOMAIN
            args += n.input[9:10]
        else:
            op, domain = "GroupQueryAttention", "com.microsoft"
            if len(n.input) > 9:  # cos_cache, sin_cache, position_ids unused: RoPE is applied before
                args += ["", "", "", n.input[9]]
        gqa = helper.make_node(op, args, [n.output[0]] + [p + PRESENT for p in past], name=name, domain=domain,
                               num_heads=a["heads"], kv_num_heads=a["kv_heads"], scale=a["scale"])
        n.CopyFrom(gqa)
        before[name] = rotary
        B, T, H, Hkv, D = a["batch"], a["tokens"], a["heads"], a["kv_heads"], a["head_dim"]
        for out, width in ((n.output[0], H * D), (q_rot, H * D), (k_rot, Hkv * D)):
            g.value_info.append(helper.make_tensor_value_info(out, TensorProto.FLOAT, [B, T, width]))
    nodes = [r for n in g.node for r in before.get(n.name, []) + [n]]
    del g.node[:]
    g.node.extend(nodes)
    _drop_written_kv(g)
    _drop_dead(g)
    _pack_rotary(g)
    _drop_dead(g)
    for imp in list(model.opset_import):
        if imp.domain == DOMAIN:
            model.opset_import.remove(imp)
    for domain in ("com.microsoft",) + ((kernels.DOMAIN,) if row_independent else ()):
        if not any(imp.domain == domain for imp in model.opset_import):
            model.opset_import.append(onnx.helper.make_opsetid(domain, 1))
    return len(fused)


# graph output -> the GroupQueryAttention input it stacks, layer by layer (a chain's verify returns every
# node's K/V at its own slot, like a prefill chunk)
IN_PLACE = {"new_k": 1, "new_v": 2, "path_k": 1, "path_v": 2}


def _drop_written_kv(g) -> None:
    """Drop the `new_k` / `new_v` outputs when they only stack what every layer's GroupQueryAttention already
    wrote into the caller's cache at slots cache_len.. (its K after RoPE, its V), in layer order: the caller
    would commit exactly those values to exactly those slots, so the graph returns nothing for them
    (OrtGraph returns None, which KVSlots.commit reads as "written in place")."""
    producers = {o: n for n in g.node for o in n.output}
    written: dict[tuple[str, int], int] = {}  # (tensor, GQA input index) -> layer
    for n in g.node:
        if (n.op_type, n.domain) in (("GroupQueryAttention", "com.microsoft"), (kernels.ATTENTION, kernels.DOMAIN)):
            layer = int(n.input[3].rpartition(".")[2])
            for i in IN_PLACE.values():
                written[n.input[i], i] = layer

    def source(name: str) -> str:
        while name in producers and producers[name].op_type in ("Unsqueeze", "Transpose", "Reshape", "Identity"):
            name = producers[name].input[0]
        return name

    for out in [o for o in g.output if o.name in IN_PLACE]:
        stack = producers.get(out.name)
        if stack is None or stack.op_type != "Concat" or [a.i for a in stack.attribute if a.name == "axis"] != [0]:
            continue
        layers = [written.get((source(x), IN_PLACE[out.name])) for x in stack.input]
        if layers == list(range(len(layers))) and len(layers) == len(written) // len(set(IN_PLACE.values())):
            g.output.remove(out)


def _head_norm(producers, readers, name: str) -> tuple[str, str, float] | None:
    """If `name` is Reshape(RMSNorm(Reshape(x), w)) with nothing else reading the steps (Qwen3's per-head q/k
    norm between the projection's Split and RoPE, on specair's RMSNorm), return (x, w, epsilon)."""
    outer = producers.get(name)
    norm = producers.get(outer.input[0]) if outer is not None and outer.op_type == "Reshape" else None
    if norm is None or (norm.op_type, norm.domain) != (kernels.RMSNORM, kernels.DOMAIN):
        return None
    inner = producers.get(norm.input[0])
    if inner is None or inner.op_type != "Reshape" or readers[outer.input[0]] != 1 or readers[norm.input[0]] != 1:
        return None
    eps = next((a.f for a in norm.attribute if a.name == "epsilon"), None)
    return (inner.input[0], norm.input[1], eps) if eps is not None else None


def _pack_rotary(g) -> None:
    """Where nothing but the attention node reads the rotated q and k (the graph returns no new K), let it
    take the packed q|k|v projection and apply RoPE itself (do_rotary, same tables and positions): the
    Split and both RotaryEmbedding nodes go. specair's attention also takes a per-head RMSNorm of q and k
    between the two (Qwen3's q_norm and k_norm), so their Reshape and RMSNorm nodes go too."""
    from onnx import helper

    producers = {o: n for n in g.node for o in n.output}
    readers: dict[str, int] = {}
    for n in g.node:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1
    for n in g.node:
        ours = n.op_type == kernels.ATTENTION and n.domain == kernels.DOMAIN
        if not (ours or n.op_type == "GroupQueryAttention" and n.domain == "com.microsoft") or n.input[1] == "":
            continue
        rq, rk = producers.get(n.input[0]), producers.get(n.input[1])
        if not (rq is not None and rk is not None and rq.op_type == rk.op_type == "RotaryEmbedding"
                and readers[n.input[0]] == readers[n.input[1]] == 1 and rq.input[1:] == rk.input[1:]):
            continue
        q_in, k_in, norms = rq.input[0], rk.input[0], []
        nq, nk = _head_norm(producers, readers, q_in), _head_norm(producers, readers, k_in)
        if ours and nq is not None and nk is not None and nq[2] == nk[2]:
            (q_in, q_w, eps), (k_in, k_w, _) = nq, nk
            norms = [q_w, k_w]
        split = producers.get(q_in)
        axis = next((a.i for a in split.attribute if a.name == "axis"), 0) if split is not None else None
        if (split is None or split.op_type != "Split" or axis not in (-1, 2)
                or list(split.output) != [q_in, k_in, n.input[2]]):
            continue
        positions, cos, sin = rq.input[1:4]
        if ours:
            bias = n.input[7] if len(n.input) > 7 else ""
            args = [split.input[0], "", ""] + list(n.input[3:7]) + [bias, positions, cos, sin] + norms
        else:
            args = [split.input[0], "", ""] + list(n.input[3:7]) + [cos, sin, positions] + list(n.input[10:])
        del n.input[:]
        n.input.extend(args)
        n.attribute.append(helper.make_attribute("do_rotary", 1))
        if norms:
            n.attribute.append(helper.make_attribute("epsilon", eps))


def _drop_dead(g) -> None:
    """Remove nodes nothing reads (the cache slices the fused nodes replaced), then unread graph inputs."""
    outputs = {o.name for o in g.output}
    while True:
        read = {i for n in g.node for i in n.input} | outputs
        dead = [n for n in g.node if not any(o in read for o in n.output)]
        if not dead:
            break
        for n in dead:
            g.node.remove(n)
    read = {i for n in g.node for i in n.input}
    for vi in [vi for vi in g.input if vi.name not in read]:
        g.input.remove(vi)
