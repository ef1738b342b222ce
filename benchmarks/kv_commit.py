"""What committing a step's K/V costs: `graphs.kv.commit_kv` (an indexed write of (row, slot) pairs) against
`scatter_` along the slots, on the default model's cache shape (30 layers, 3 KV heads, head dim 64, 1024
slots), per dtype and (rows, tokens per row); median of 5 × 5 calls (ms):

    python benchmarks/kv_commit.py --threads 2

torch's CPU `scatter_` runs element by element for bfloat16 and float16, which is why commit_kv indexes.
"""

from __future__ import annotations

import argparse

import torch

from specair.benchmarks.int4_rows import median_us
from specair.graphs.kv import commit_kv

L, HKV, SLOTS, D = 30, 3, 1024, 64
CASES = ((1, 1), (1, 5), (8, 9), (64, 1), (1, 64))  # (rows, tokens per row): decode, verify, batches, a chunk


def scatter_commit(k: torch.Tensor, v: torch.Tensor, nk: torch.Tensor, nv: torch.Tensor, slots: torch.Tensor) -> None:
    index = slots.view(1, *slots.shape, 1).unsqueeze(2).expand(nk.shape)
    k.scatter_(3, index, nk)
    v.scatter_(3, index, nv)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    torch.set_num_threads(ap.parse_args().threads)
    print("| dtype | rows × tokens | commit_kv ms | scatter_ ms |\n|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for B, T in CASES:
            k, v = (torch.zeros(L, B, HKV, SLOTS, D, dtype=dtype) for _ in range(2))
            nk, nv = (torch.randn(L, B, HKV, T, D).to(dtype) for _ in range(2))
            slots = torch.randint(0, SLOTS - T, (B, 1)) + torch.arange(T)
            ours = median_us(lambda: commit_kv(k, v, nk, nv, slots), 5, 5) / 1e3
            ref = k.clone()
            scatter = median_us(lambda: scatter_commit(k, v, nk, nv, slots), 5, 5) / 1e3
            assert torch.equal(ref, k)  # both write the same values
            print(f"| {str(dtype).removeprefix('torch.')} | {B} × {T} | {ours:.2f} | {scatter:.2f} |", flush=True)


if __name__ == "__main__":
    main()
