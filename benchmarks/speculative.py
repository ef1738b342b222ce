"""Eager speculative configurations against autoregressive decoding on the same model, in one run.

Every configuration decodes every prompt, interleaved prompt by prompt after a warm-up, greedy,
batch 1. Prints tokens/s, speedup over autoregressive (per prompt, then the mean, as Spec-Bench
does), tau (tokens per target pass) and whether the output equals autoregressive greedy — and so
compares the tree scorer with the batch-expansion scorer on the same trees.

    python benchmarks/speculative.py [--model PATH] [--max-tokens 96] [--configs FILE.json] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys

import torch
from tqdm import tqdm

from specair.models.checkpoint import load_checkpoint
from specair.models.llama import build_model, truncated
from specair.runtime.params import SamplingParams
from specair.runtime.reference import ReferenceDecoder
from specair.compile.spec_config import SpeculativeConfig
from specair.runtime.speculative import SpeculativeDecoder

PROMPTS = [
    "Explain how a hash map works, with an example in Python.",
    "List the planets of the solar system in order, with one fact about each.",
    "Rewrite this sentence in the passive voice: The committee approved the new budget.",
    "What are three tips for learning a new language?",
]

CONFIGS = [
    {"method": "layer_skip", "num_layers": 12, "num_speculative_tokens": 3},
    {"method": "layer_skip", "num_layers": 12, "num_speculative_tokens": 3, "tree": "kary:3x2"},
    {"method": "layer_skip", "num_layers": 12, "num_speculative_tokens": 3, "tree": "kary:3x2",
     "scorer": "batch_expansion"},
    {"method": "layer_skip", "num_layers": 12, "num_speculative_tokens": 4, "tree": "topk:3x10"},
]


def name(cfg: dict | None) -> str:
    if cfg is None:
        return "autoregressive"
    extra = "".join(f" {k}={v}" for k, v in cfg.items() if k not in ("method", "num_speculative_tokens"))
    return f"{cfg['method']} k={cfg['num_speculative_tokens']}{extra}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--configs", help="JSON file with a list of speculative configs")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    ckpt = load_checkpoint(args.model)
    model, tok = build_model(ckpt.config, ckpt.state_dict), ckpt.tokenizer
    configs = json.load(open(args.configs)) if args.configs else CONFIGS
    decoders = {"autoregressive": ReferenceDecoder(model, tok, max_context=1024)}
    for cfg in configs:
        spec = SpeculativeConfig.parse(cfg)
        if spec.method == "layer_skip":
            draft = truncated(model, spec.num_layers)
        else:
            d = load_checkpoint(spec.model)
            draft = build_model(d.config, d.state_dict)
        decoders[name(cfg)] = SpeculativeDecoder(model, draft, spec, tok, max_context=1024)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
               for p in PROMPTS]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    for dec in decoders.values():  # warm-up
        dec.generate(prompts[0], SamplingParams(max_tokens=8, ignore_eos=True))
    rows: dict[str, dict] = {n: {"tok_s": [], "speedup": [], "tau": [], "same": 0} for n in decoders}
    for ids in tqdm(prompts, desc="prompts", file=sys.stderr):
        ref = None
        for n, dec in decoders.items():
            res = dec.generate(ids, params)
            ref = ref or res
            r = rows[n]
            r["tok_s"].append(res.decode_tokens_per_s)
            r["speedup"].append(res.decode_tokens_per_s / ref.decode_tokens_per_s)
            r["tau"].append(res.extra["spec"]["mean_accepted_length"] if "spec" in res.extra else 1.0)
            r["same"] += res.token_ids == ref.token_ids
    report = {
        "model": ckpt.source, "threads": torch.get_num_threads(), "cpu": platform.machine(),
        "torch": torch.__version__, "max_tokens": args.max_tokens, "prompts": len(prompts),
        "configs": {n: {"decode_tok_s": statistics.mean(r["tok_s"]), "speedup": statistics.mean(r["speedup"]),
                        "tau": statistics.mean(r["tau"]), "greedy_equal_to_autoregressive": f"{r['same']}/{len(prompts)}"}
                    for n, r in rows.items()},
    }
    print(f"{'configuration':<70} {'tok/s':>7} {'speedup':>8} {'tau':>5} {'= AR':>5}")
    for n, r in report["configs"].items():
        print(f"{n:<70} {r['decode_tok_s']:7.1f} {r['speedup']:7.2f}x {r['tau']:5.2f} "
              f"{r['greedy_equal_to_autoregressive']:>5}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
