"""What one all-reduce costs between tensor-parallel CPU ranks on this host: gloo's against specair's
shared-memory collective (models/shm_collectives), for a decode step's activation row up to a prefill chunk's,
one thread per rank, median µs over 1,000 calls after 100 warm-up calls:

    python benchmarks/collectives.py [--world 2]

A decode step of the sharded default model runs 61 all-reduces (two per layer and the embedding's) and one
gather of the logits.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specair.models import shm_collectives

SIZES = (576, 8 * 576, 128 * 576)


def _rank(rank: int, world: int, init: str, shm_path: str, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    shm = shm_collectives.ShmGroup(shm_path, rank, world, dist.group.WORLD, 60)
    dist.barrier()
    for n in SIZES:
        x = torch.full((n,), float(rank + 1))
        for name, op in (("gloo", lambda: dist.all_reduce(x.clone())), ("shm", lambda: shm.all_reduce(x))):
            for _ in range(100):
                op()
            times = []
            for _ in range(1000):
                t0 = time.perf_counter()
                op()
                times.append(time.perf_counter() - t0)
            if rank == 0:
                out[(name, n)] = statistics.median(times) * 1e6
    assert torch.equal(shm.all_reduce(x), torch.full((SIZES[-1],), float(world * (world + 1) // 2)))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp()
    shm_path = os.path.join(shm_collectives.mapping_dir(args.world) or tmp, f"specair-bench-{os.getpid()}")
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, (args.world, f"file://{tmp}/store", shm_path, out), nprocs=args.world)
        results = dict(out)
    os.unlink(shm_path)
    print(f"| floats | gloo µs | shared memory µs | gloo / shared memory |  ({args.world} ranks)")
    print("|---|---|---|---|")
    for n in SIZES:
        g, s = results[("gloo", n)], results[("shm", n)]
        print(f"| {n} | {g:.1f} | {s:.1f} | {g / s:.1f}× |")


if __name__ == "__main__":
    main()
