"""Offline acceptance against the engine's, on the same held-out sequences.

Distils the first N held-out prompts of the shipped set with one backend, evaluates a head offline as
training does (from every position, and walking each answer the engine's way), then generates the same
answers in the engine on that backend (greedy, a chain of k) and prints both taus and their ratios.

    python benchmarks/offline_vs_engine.py --method eagle --k 4 --prompts 24 --backend eager
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--method", choices=("eagle", "eagle3"), default="eagle")
    ap.add_argument("--model", help="the head's directory (default: the shipped one)")
    ap.add_argument("--k", type=int, default=4, help="chain length (the offline eval's depth)")
    ap.add_argument("--prompts", type=int, default=24, help="held-out prompts of the shipped set")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--backend", default="eager", help="the engine's backend, for distilling and for the run")
    ap.add_argument("--cache-dir", help="distillation cache (default: a fresh temporary directory)")
    ap.add_argument("--out", help="write the result as JSON here")
    args = ap.parse_args()

    import torch

    from specair.models.eagle3 import default_feature_layers
    from specair.runtime.llm import LLM
    from specair.runtime.params import SamplingParams
    from specair.runtime.proposers import proposer_class
    from specair.training.distill import distill
    from specair.training.prompt_set import load_prompts
    from specair.training.setup import DataOptions, TrainingSetup, load_target

    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer, fingerprint = load_target(None)
    layers = default_feature_layers(target.config.num_layers)
    held = load_prompts(split="heldout")[:args.prompts]
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "heldout.jsonl"
        # Two records kept as "train" so the set has both splits; only the held-out ones are scored.
        f.write_text("".join(json.dumps({**r, "split": "heldout" if i >= 2 else "train"}) + "\n"
                             for i, r in enumerate(load_prompts(split="train")[:2] + held)))
        data = distill(target, fingerprint, None, cache=Path(args.cache_dir or Path(tmp) / "cache"), prompts_path=f,
                       max_new_tokens=args.max_new_tokens, tokenizer=tokenizer,
                       make_llm=lambda: LLM(backend=args.backend, batch_buckets=(1, 4, 16), max_context=1024,
                                            threads=args.threads, features=layers))
        for s in data.sequences:  # read every sequence's states before the temporary cache goes
            s.block = s._block()
    setup = TrainingSetup(target, tokenizer, fingerprint, data, DataOptions(max_new_tokens=args.max_new_tokens))
    cls = proposer_class(args.method)
    head = cls.loader(cls.head_path(args.model), setup.target)
    if args.method == "eagle":
        from specair.training.eagle import EagleRecipe, EagleSettings

        recipe = EagleRecipe.around(setup, EagleSettings(eval_depth=args.k), head)
    else:
        from specair.training.eagle3 import Eagle3Recipe, Eagle3Settings

        recipe = Eagle3Recipe.around(setup, Eagle3Settings(eval_depth=args.k), head)
    offline = recipe.evaluate()["acceptance"]

    spec = {"method": args.method, "num_speculative_tokens": args.k, "tree": "chain"}
    if args.model:
        spec["model"] = args.model
    llm = LLM(speculative_config=spec, backend=args.backend, threads=args.threads, max_context=1024)
    seqs = setup.heldout
    t0 = time.perf_counter()
    results = llm.generate([s.tokens[:s.prompt_len].tolist() for s in seqs],
                           SamplingParams(max_tokens=args.max_new_tokens, temperature=0.0))
    identical = sum(r.token_ids == s.tokens[s.prompt_len:].tolist() for r, s in zip(results, seqs))
    drafts = sum(r.extra["spec"]["num_drafts"] for r in results)
    accepted = sum(r.extra["spec"]["num_accepted_tokens"] for r in results)
    by_pos = [sum(r.extra["spec"]["accepted_per_position"][d] for r in results) / max(drafts, 1)
              for d in range(args.k)]
    engine_tau = 1 + accepted / max(drafts, 1)
    out = {"method": args.method, "k": args.k, "backend": args.backend, "heldout_prompts": len(seqs), "identical_to_distilled": identical,
           "offline_every_position": {"tau_chain": offline["tau_chain"],
                                      "acceptance_by_position": offline["acceptance_by_position"]},
           "offline_engine_walk": {"tau_chain": offline["walk"]["tau_chain"]},
           "engine": {"tau": round(engine_tau, 4), "acceptance_by_position": [round(a, 4) for a in by_pos],
                      "drafts": drafts, "seconds": round(time.perf_counter() - t0, 1)},
           "engine_over_offline": round(engine_tau / offline["tau_chain"], 4),
           "engine_over_walk": round(engine_tau / offline["walk"]["tau_chain"], 4)}
    print(json.dumps(out, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
