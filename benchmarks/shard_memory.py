"""What one tensor-parallel rank holds after loading, against the whole model: parameters and peak RSS
of `load_checkpoint` + `build_model`, each in a fresh process (docs/tensor-parallel.md):

  python benchmarks/shard_memory.py [--model PATH] [--world 2] [--dtype fp32]
"""

import argparse
import json
import resource
import subprocess
import sys


def measure(model: str | None, dtype: str, rank: int | None, world: int) -> dict:
    from specair.models.checkpoint import load_checkpoint
    from specair.models.llama import TensorParallel, build_model
    from specair.runtime.build import DTYPES

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    shard = None if rank is None else (rank, world)
    ckpt = load_checkpoint(model, DTYPES[dtype], progress=False, shard=shard)
    tp = None if shard is None else TensorParallel(None, *shard)
    built = build_model(ckpt.config, ckpt.state_dict, DTYPES[dtype], tp)
    return {"rank": rank, "params": sum(p.numel() for p in built.parameters()),
            "peak_rss_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the default model)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)  # one child's measurement
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(measure(a.model, a.dtype, a.rank, a.world)))
        return
    for rank in [None, *range(a.world)]:
        cmd = [sys.executable, __file__, "--child", "--world", str(a.world), "--dtype", a.dtype]
        cmd += ["--model", a.model] if a.model else []
        cmd += ["--rank", str(rank)] if rank is not None else []
        r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        who = "whole" if rank is None else f"rank {rank} of {a.world}"
        print(f"{who:>12}: {r['params'] / 1e6:6.1f} M parameters, peak RSS +{r['peak_rss_mb']:.0f} MB")


if __name__ == "__main__":
    main()
