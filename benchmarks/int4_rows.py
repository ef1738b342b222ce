"""What an int4 linear layer costs per row: specair's own MatMulQ4_1 (compile/kernels, what the int4 path runs
for Q4_1 weights), onnxruntime's MatMulNBits (block 32) at accuracy levels 4 (int8 activations) and 0 (float),
and torch's int4-packed CPU matmul, for M = 1..32 rows of activations, on the default model's shapes. One
node per session, the process-wide thread pool, median of 15 × 20 calls (µs), and each kernel's M-row cost
over its one-row cost:

    python benchmarks/int4_rows.py --threads 2

A verify pass of T tokens runs every linear layer at M = T, so this is what sets its cost over a decode step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import numpy as np

# SmolLM2-135M (K × N): q|k|v packed, o, gate|up packed, down, the LM head; and the 576 × 192, 576 × 1536
SHAPES = [(576, 960), (576, 576), (576, 192), (576, 1536), (576, 3072), (1536, 576), (576, 49152)]
ROWS = (1, 2, 5, 9, 16, 32)


def median_us(f: Callable[[], object], rounds: int = 15, calls: int = 20) -> float:
    """Median over `rounds` of the mean time of `calls` calls, in µs, after `calls` warm-up calls."""
    for _ in range(calls):
        f()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def mnb_session(K: int, N: int, M: int, level: int):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    nb = K // 32
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.integers(0, 256, (N, nb, 16), dtype=np.uint8), "q"),
             numpy_helper.from_array(rng.random(N * nb, dtype=np.float32), "s"),
             numpy_helper.from_array(np.zeros(N * ((nb + 1) // 2), np.uint8), "z")]
    node = helper.make_node("MatMulNBits", ["x", "q", "s", "z"], ["y"], domain="com.microsoft", K=K, N=N, bits=4,
                            block_size=32, accuracy_level=level)
    graph = helper.make_graph([node], "mnb", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [M, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [M, N])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.use_per_session_threads = False
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def q4_1_session(K: int, N: int, M: int):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from specair.compile import kernels

    rng = np.random.default_rng(0)
    packed, scales, mins = kernels.pack_q4_1(rng.integers(0, 16, (N, K), dtype=np.uint8),
                                             rng.random((N, K // 32), dtype=np.float32),
                                             rng.random((N, K // 32), dtype=np.float32))
    inits = [numpy_helper.from_array(a, n) for a, n in ((packed, "p"), (scales, "s"), (mins, "m"))]
    node = helper.make_node(kernels.OP, ["x", "p", "s", "m"], ["y"], domain=kernels.DOMAIN, K=K, N=N)
    graph = helper.make_graph([node], "q4_1", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [M, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [M, N])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(kernels.DOMAIN, 1)])
    so = ort.SessionOptions()
    so.use_per_session_threads = False
    so.register_custom_ops_library(str(kernels.library()))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def row(name: str, K: int, N: int, cells: list[float]) -> None:
    ratios = " / ".join(f"{c / cells[0]:.2f}" for c in cells[1:])
    print(f"| {K} × {N} | {name} | " + " | ".join(f"{c:.0f}" for c in cells) + f" | {ratios} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-torch", action="store_true", help="skip torch's int4-packed matmul")
    ap.add_argument("--all", action="store_true", help="MatMulNBits at accuracy level 0 too (float activations)")
    args = ap.parse_args()
    import onnxruntime as ort
    import torch

    ort.capi._pybind_state.set_global_thread_pool_sizes(args.threads, 1)
    torch.set_num_threads(args.threads)
    from specair.compile import kernels

    print(f"specair's kernel runs {kernels.isa()} here")
    print("| weight (K × N) | kernel | " + " | ".join(f"M={m}" for m in ROWS) + " | × M=1 at M=" +
          ",".join(map(str, ROWS[1:])) + " |")
    print("|---|---|" + "---|" * (len(ROWS) + 1))
    for K, N in SHAPES:
        sessions = [("specair MatMulQ4_1", lambda M: q4_1_session(K, N, M))]
        sessions += [(f"MatMulNBits level {level}", lambda M, level=level: mnb_session(K, N, M, level))
                     for level in ((4, 0) if args.all else (4,))]
        for name, make in sessions:
            cells = []
            for M in ROWS:
                s, x = make(M), np.random.rand(M, K).astype(np.float32)
                cells.append(median_us(lambda: s.run(None, {"x": x})))
            row(name, K, N, cells)
        if not args.no_torch:
            packed = torch._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (N, K), dtype=torch.int32), 1)
            scales_zeros = torch.rand(K // 32, N, 2)
            cells = []
            for M in ROWS:
                x = torch.rand(M, K)
                cells.append(median_us(lambda: torch._weight_int4pack_mm_for_cpu(x, packed, 32, scales_zeros)))
            row("torch int4pack (fp32)", K, N, cells)


if __name__ == "__main__":
    main()
