"""Interleaved timing of onnx graph files side by side, caches bound in place as the engine binds them.

Every fused-attention cache input (`k_cache.<i>`) is bound together with its `.present` output to the same
buffer, like OrtGraph does, so the graph runs as it does in the engine; integer inputs are the token id 5
and the position (--position); float inputs are random caches, zeros elsewhere. The files run in turn,
--calls calls per block, --blocks blocks each, on one process-wide thread pool:

    python benchmarks/graph_ab.py --threads 2 DIR_A/decode.b1.c2048.greedy.onnx DIR_B/decode.b1.c2048.greedy.onnx
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def session(path: str, position: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.use_per_session_threads = False
    s = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    io, keep = s.io_binding(), []
    outs = {o.name for o in s.get_outputs()}
    for o in s.get_outputs():
        if not o.name.endswith(".present"):
            io.bind_output(o.name, "cpu")
    rng = np.random.default_rng(0)
    for i in s.get_inputs():
        shape = [d if isinstance(d, int) else 1 for d in i.shape]
        if "int64" in i.type:
            a = np.full(shape, 5 if "tok" in i.name else position, np.int64)
        elif "float" in i.type:
            a = rng.random(shape, dtype=np.float32) if "cache" in i.name else np.zeros(shape, np.float32)
        else:
            a = np.ones(shape, bool)
        keep.append(a)
        io.bind_cpu_input(i.name, a)
        if i.name + ".present" in outs:
            io.bind_output(i.name + ".present", "cpu", 0, np.float32, list(a.shape), a.ctypes.data)
    return s, io, keep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("graphs", nargs="+")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--position", type=int, default=200, help="cache length / position of the step")
    ap.add_argument("--blocks", type=int, default=40)
    ap.add_argument("--calls", type=int, default=10)
    args = ap.parse_args()
    import onnxruntime as ort

    ort.capi._pybind_state.set_global_thread_pool_sizes(args.threads, 1)
    runs = [session(p, args.position) for p in args.graphs]
    for s, io, _ in runs:
        for _ in range(5):
            s.run_with_iobinding(io)
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(args.blocks):
        for (s, io, _), t in zip(runs, times):
            t0 = time.perf_counter()
            for _ in range(args.calls):
                s.run_with_iobinding(io)
            t.append((time.perf_counter() - t0) / args.calls * 1e3)
    for path, t in zip(args.graphs, times):
        print(f"{path}: median {statistics.median(t):.2f} ms, min {min(t):.2f} ms per call")


if __name__ == "__main__":
    main()
