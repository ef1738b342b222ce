"""What Ascend ATC (`atc --framework=5`) accepts from an ONNX file, and a checker for exported graphs.

Sources (Huawei CANN documentation, "支持ONNX算子清单" / "Supported ONNX Operators"):

- Operator list: CANN 8.0.0 commercial edition, 算子清单 > AI框架算子支持清单 > 支持ONNX算子清单,
  https://www.hiascend.com/doc_center/source/zh/canncommercial/800/apiref/aolapi/operatorlist_00176.html
  Its overview page (operatorlist_00177 in the CANN community docs, operatorlist_0004 in 8.0.RC2.2) says the
  list follows ONNX 1.12.0 and ONNX Runtime 1.14.0, that the opset of each operator is given on the operator's
  own page, and that the ONNX operator list applies to the Atlas inference series (310-class boards).
  ATC_OPS below is that list spelled with ONNX's own operator names (the page writes "Argmax", "Cumsum",
  "LogSoftMax"), minus Ascend-only entries that are no ONNX operators (AdaptiveAvgPool2D, AscendAntiQuant,
  AscendQuant, BatchMultiClassNMS, Corr, DeformableConv2D, DynSeqOuter, EmbeddingBag, LSTMP,
  MovingSumWithSigmoid, RoiExtractor).
- Older boards: CANN 5.0.4's list (fwoperatorlist/operatorlist_0071.html) lacks the ops in NOT_IN_CANN_5.
- Opsets: CANN 5.0.4's ATC guide (atctool/atlasatc_16_0164.html) accepts "ONNX 1.8.0, opset v9~v13";
  CANN 7.0's (canncommercial/700/inferapplicationdev/atctool/atlasatc_16_0201.html) "ONNX 1.12.0, opset
  v9~v18". ATC_OPSETS is the range every documented release accepts; pass `opsets=(9, 18)` for CANN >= 7.
  The IR version is bounded by ONNX 1.12.0 (IR version 8).
- Per-operator dtype limits are documented op by op; DTYPE_LIMITS holds the ones cited below, not all of
  them (e.g. ScatterElements' data is float16/float/int32 only, atlasoxol_09_0139; TopK's input
  float16/float only, canncommercial/700 atlasoxol_09_0162). Other dtype limits are not checked here.

Per-operator opset ranges (each operator's own page) are not encoded; the pages read for this module all
cover opset 13 (TopK and Sigmoid "Opset v8 ... v18", ScatterElements "v11 ... v18", Sum "v8 ... v16").
Trilu exists only from opset 14, so an opset-13 export cannot contain it (specair's exporter lowers
`tril` without it). If no list fits a board, this module is the conservative reading of the pages above,
not a replacement for running ATC itself.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Standard-domain ONNX operators on CANN 8.0.0's ONNX operator list (see the module docstring).
ATC_OPS: frozenset[str] = frozenset("""
Abs Acos Acosh Add AffineGrid And ArgMax ArgMin Asin Asinh Atan Atanh AveragePool BatchNormalization BitShift
BitwiseAnd BitwiseNot BitwiseOr BitwiseXor Cast Ceil Celu Clip Compress Concat Constant ConstantOfShape Conv
ConvTranspose Cos Cosh CumSum DepthToSpace Det Div Dropout Einsum Elu Equal Erf Exp Expand EyeLike Flatten Floor
Gather GatherElements GatherND Gemm GlobalAveragePool GlobalLpPool GlobalMaxPool Greater GreaterOrEqual
GridSample GRU Hardmax HardSigmoid HardSwish Identity If InstanceNormalization IsInf IsNaN LayerNormalization
LeakyRelu Less LessOrEqual Log LogSoftmax LpNormalization LpPool LRN LSTM MatMul Max MaxPool MaxRoiPool MaxUnpool
Mean MeanVarianceNormalization Min Mod Mul Multinomial Neg NonMaxSuppression NonZero Not OneHot Or Pad Pow
RandomNormal RandomNormalLike RandomUniform RandomUniformLike Range Reciprocal ReduceL1 ReduceL2 ReduceLogSum
ReduceLogSumExp ReduceMax ReduceMean ReduceMin ReduceProd ReduceSum ReduceSumSquare Relu Reshape Resize
ReverseSequence RoiAlign Round PRelu Scatter ScatterElements ScatterND Selu Shape Shrink Sigmoid Sign Sin Sinh
Size Slice Softmax SoftmaxCrossEntropyLoss Softplus Softsign SpaceToDepth Split Sqrt Squeeze Sub Sum Tan Tanh
TfIdfVectorizer ThresholdedRelu Tile TopK Transpose Trilu Unsqueeze Where Xor
""".split())

# On CANN 8.0.0's list but not on CANN 5.0.4's: pass `ops=ATC_OPS - NOT_IN_CANN_5` for boards still on CANN 5.x.
NOT_IN_CANN_5: frozenset[str] = frozenset(
    "BitwiseAnd BitwiseNot BitwiseOr BitwiseXor Einsum GridSample GRU IsInf IsNaN LayerNormalization RandomNormal "
    "SoftmaxCrossEntropyLoss Tan Trilu".split())

# On the list, but specair's graphs take randomness as inputs (DESIGN.md): a random op is a bug in a graph.
RANDOM_OPS: frozenset[str] = frozenset(
    "RandomNormal RandomNormalLike RandomUniform RandomUniformLike Multinomial Bernoulli".split())

ATC_OPSETS: tuple[int, int] = (9, 13)
MAX_IR_VERSION = 8  # ONNX 1.12.0

# op -> {input index: allowed ONNX element type names}, only where a CANN page says so (module docstring).
DTYPE_LIMITS: dict[str, dict[int, frozenset[str]]] = {
    "ScatterElements": {0: frozenset({"FLOAT16", "FLOAT", "INT32"}), 2: frozenset({"FLOAT16", "FLOAT", "INT32"})},
    "TopK": {0: frozenset({"FLOAT16", "FLOAT"})},
}


def _dims_problem(kind: str, vi) -> str | None:
    t = vi.type.tensor_type
    if not t.HasField("shape"):
        return f"{kind} {vi.name!r} has no static shape (unknown rank)"
    bad = [d.dim_param or "?" for d in t.shape.dim if not (d.HasField("dim_value") and d.dim_value > 0)]
    if bad:
        dims = ["{}".format(d.dim_value if d.HasField("dim_value") else (d.dim_param or "?")) for d in t.shape.dim]
        return (f"{kind} {vi.name!r} has dynamic dims [{', '.join(dims)}]: "
                "ATC needs static shapes (or --dynamic_dims gears)")
    return None


def check_onnx(path: str | Path, opsets: tuple[int, int] = ATC_OPSETS, ops: frozenset[str] = ATC_OPS) -> list[str]:
    """Problems that would keep `atc --framework=5` from converting the ONNX file at path (empty if none found):
    an opset outside `opsets`, operators outside `ops` (or outside the standard domain), random operators,
    dynamic input/output dims, external data (ATC wants one self-contained file), float64 tensors, an IR
    version newer than ONNX 1.12 reads, and the per-operator dtype limits in DTYPE_LIMITS."""
    import onnx
    from onnx import TensorProto

    model = onnx.load(str(path), load_external_data=False)
    problems: list[str] = []
    if model.ir_version > MAX_IR_VERSION:
        problems.append(f"IR version {model.ir_version} is newer than ONNX 1.12 (IR {MAX_IR_VERSION}), "
                        "which CANN reads")
    lo, hi = opsets
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            if not lo <= imp.version <= hi:
                problems.append(f"opset {imp.version} is outside the ATC-accepted range {lo}-{hi}")
        elif imp.domain != "ai.onnx.ml":
            problems.append(f"uses operator domain {imp.domain!r}: ATC reads only the standard ONNX domain")
    g = model.graph
    if g.sparse_initializer:
        problems.append("has sparse initializers, which ATC does not read")

    def walk(graph):
        for node in graph.node:
            yield node
            for a in node.attribute:
                if a.g.node:
                    yield from walk(a.g)
                for sub in a.graphs:
                    yield from walk(sub)

    nodes = list(walk(g))
    unknown: dict[str, int] = {}
    for node in nodes:
        name = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
        if node.domain not in ("", "ai.onnx") or node.op_type not in ops:
            unknown[name] = unknown.get(name, 0) + 1
        elif node.op_type in RANDOM_OPS:
            problems.append(f"random operator {node.op_type} (node {node.name!r}): feed randomness as an input")
    for name, n in sorted(unknown.items()):
        problems.append(f"operator {name} ({n} node{'s' if n > 1 else ''}) is not on CANN's ONNX operator list")
    for vi in g.input:
        if p := _dims_problem("input", vi):
            problems.append(p)
    for vi in g.output:
        if p := _dims_problem("output", vi):
            problems.append(p)

    external = [t.name for t in g.initializer if t.data_location == TensorProto.EXTERNAL]
    external += [n.name or n.output[0] for n in nodes for a in n.attribute
                 if a.HasField("t") and a.t.data_location == TensorProto.EXTERNAL]
    if external:
        problems.append(f"{len(external)} tensors are stored as external data (e.g. {external[0]!r}): ATC needs one "
                        "self-contained file; export with OnnxBackend(self_contained=True) / export_self_contained")

    # Element types: graph IO, initializers, constants, casts, and (where inference works) every value.
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False).graph
    except Exception:  # noqa: BLE001 - inference is a best effort; the rest of the check stands
        inferred = g
    types: dict[str, int] = {}
    for vi in list(inferred.input) + list(inferred.output) + list(inferred.value_info):
        types[vi.name] = vi.type.tensor_type.elem_type
    for t in g.initializer:
        types[t.name] = t.data_type
    io_names = [vi.name for vi in list(g.input) + list(g.output)]
    doubles = sorted((n for n, t in types.items() if t == TensorProto.DOUBLE), key=lambda n: (n not in io_names, n))
    doubles += [f"Cast node {n.name!r}" for n in nodes if n.op_type == "Cast"
                and any(a.name == "to" and a.i == TensorProto.DOUBLE for a in n.attribute)]
    doubles += [f"Constant node {n.name!r}" for n in nodes for a in n.attribute
                if a.HasField("t") and a.t.data_type == TensorProto.DOUBLE]
    if doubles:
        problems.append(f"{len(doubles)} float64 tensors (e.g. {doubles[0]!r}): ATC and Ascend cores have no float64")

    type_name = TensorProto.DataType.Name
    for node in nodes:
        for idx, allowed in DTYPE_LIMITS.get(node.op_type, {}).items():
            if idx < len(node.input) and node.input[idx] in types:
                et = types[node.input[idx]]
                if et and type_name(et) not in allowed:
                    problems.append(f"{node.op_type} node {node.name!r} input {idx} is {type_name(et).lower()}; "
                                    f"CANN documents only {', '.join(sorted(a.lower() for a in allowed))}")
    return problems


def main_check_onnx(paths: list[str]) -> int:
    """CLI hook: check each file, print one line per problem (`path: problem`); 0 if none, else 1."""
    bad = False
    for path in paths:
        try:
            problems = check_onnx(path)
        except Exception as e:  # noqa: BLE001 - an unreadable file is reported like any other problem
            problems = [f"cannot read it as ONNX: {type(e).__name__}: {e}"]
        for p in problems:
            print(f"{path}: {p}")
        bad = bad or bool(problems)
    sys.stdout.flush()
    return 1 if bad else 0
