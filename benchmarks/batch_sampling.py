"""What a batch's sampling variant costs on the default path: 8 conversations × 64 tokens through `LLM()` (the
compiled int4 path, batch buckets 1, 2, 4, 8), greedy, with temperature only ("plain" graphs) and with top-p
("filtered" graphs, a sort over the vocabulary), aggregate tokens/s after a warm-up:

    python benchmarks/batch_sampling.py [--threads 2] [--rows 8]

A server's batch runs the costliest variant any of its rows needs, so one top-p request sets its step's cost.
"""

from __future__ import annotations

import argparse
import time

from specair.runtime.llm import LLM
from specair.runtime.params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    llm = LLM(max_context=2048, threads=args.threads, enable_prefix_caching=False)  # each variant prefills whole
    convs = [[{"role": "user", "content": f"Tell me about topic number {i}."}] for i in range(args.rows)]
    n = args.max_tokens
    for name, params in [("greedy", SamplingParams(max_tokens=n, ignore_eos=True)),
                         ("plain (temperature 0.8)", SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.8,
                                                                    seed=1)),
                         ("filtered (top-p 0.95)", SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.8,
                                                                  top_p=0.95, seed=1))]:
        llm.chat(convs[:2], params)
        t0 = time.perf_counter()
        results = llm.chat(convs, params)
        wall = time.perf_counter() - t0
        print(f"{name}: {sum(len(r.token_ids) for r in results) / wall:.1f} tok/s over {args.rows} rows")


if __name__ == "__main__":
    main()
