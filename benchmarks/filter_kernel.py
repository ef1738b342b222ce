"""specair.ort::FilteredProbs (compile/kernels/sampling.cpp) beside graphs/sampling.py's sort, per call, on
rows × 49,152 logits drawn from N(0, 2.5), for top-p alone, top-k alone and both:

    python benchmarks/filter_kernel.py [--threads 1] [--vocab 49152]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

from specair.compile import kernels
from specair.graphs.sampling import logits_to_probs


def session(shape: list[int], threads: int) -> ort.InferenceSession:
    node = helper.make_node(kernels.FILTER, ["x", "k", "p"], ["y"], domain=kernels.DOMAIN)
    graph = helper.make_graph([node], "filter", [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, shape),
        helper.make_tensor_value_info("k", TensorProto.INT64, [shape[0]]),
        helper.make_tensor_value_info("p", TensorProto.FLOAT, [shape[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(kernels.DOMAIN, 1)])
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(kernels.library()))
    so.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def timed(fn, n: int = 20) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=49152)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("| rows | top-k | top-p | FilteredProbs ms | sort ms | × |\n|---|---|---|---|---|---|")
    for rows in (1, 8, 32):
        x = np.random.default_rng(0).normal(0, 2.5, (rows, args.vocab)).astype(np.float32)
        s = session([rows, args.vocab], args.threads)
        for k, p in ((0, 0.95), (50, 1.0), (40, 0.9)):
            kk, pp = np.full(rows, k, np.int64), np.full(rows, p, np.float32)
            ours = timed(lambda: s.run(None, {"x": x, "k": kk, "p": pp}))
            X, K, P, T = torch.from_numpy(x), torch.from_numpy(kk), torch.from_numpy(pp), torch.ones(rows)
            theirs = timed(lambda: logits_to_probs(X, T, K, P))
            print(f"| {rows} | {k or '–'} | {p if p < 1 else '–'} | {ours:.2f} | {theirs:.2f} | {theirs / ours:.1f} |")


if __name__ == "__main__":
    main()
