"""Training-step throughput of the EAGLE / EAGLE-3 recipes in fp32 and bf16 autocast, on the first
sequences of the default model's distilled set (run `specair train distill --max-prompts 200` first).

    python benchmarks/train_step.py --recipe eagle3 --threads 2

Prints, per precision, the seconds of each step (forward + backward, batch 8) and the tokens per second
over the steps after the first (a warm-up), with the first loss, so runs of two code versions can be
checked to compute the same thing.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", choices=("eagle", "eagle3"), default="eagle3")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from specair.training.distill import _read_index, default_cache_dir, load_distilled
    from specair.training.eagle import EagleRecipe, EagleSettings
    from specair.training.eagle3 import Eagle3Recipe, Eagle3Settings
    from specair.training.setup import DataOptions, TrainingSetup, load_target

    target, tokenizer, fingerprint = load_target(None)
    cache = default_cache_dir(fingerprint)
    ids = sorted(int(i) for i in _read_index(cache))[:15 * args.steps * args.batch_size]
    setup = TrainingSetup(target, tokenizer, fingerprint, load_distilled(cache, ids), DataOptions())
    recipe = (Eagle3Recipe(setup, Eagle3Settings()) if args.recipe == "eagle3"
              else EagleRecipe(setup, EagleSettings()))
    recipe._train = setup.train
    B = args.batch_size
    for precision in ("fp32", "bf16"):
        times, first_loss = [], None
        for b in range(args.steps):
            t = time.perf_counter()
            with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
                out = recipe.train_step(list(range(B * b, B * b + B)), 0)
            out["loss"].backward()
            times.append(time.perf_counter() - t)
            first_loss = float(out["loss"]) if first_loss is None else first_loss
        tokens = sum(setup.train[i].tokens.numel() for i in range(B, B * args.steps))
        print(f"{args.recipe} {precision}: steps {[round(x, 2) for x in times]} s, "
              f"{tokens / sum(times[1:]):.0f} tok/s, first loss {first_loss:.10g}", flush=True)


if __name__ == "__main__":
    main()
