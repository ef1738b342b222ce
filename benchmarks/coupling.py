"""What exact acceptance costs a sampled draft chain: per-token acceptance probabilities, computed exactly.

On the default model's greedy answers to the shipped chat prompts, the target and a layer-skip draft (its first
--layers layers) are run teacher-forced; at every answer position, with p and q the two distributions at
--temperature, the chance that one drafted token is accepted is:
- exact acceptance, the draft sampling with the target's uniform (specair): the overlap of the two inverse
  CDFs' intervals, sum_x |[F(x-), F(x)) ∩ [G(x-), G(x))|;
- speculative rejection sampling (vLLM's default, what specair had before): sum_x min(p(x), q(x));
- exact acceptance with an independently sampled draft: sum_x p(x) q(x).

    python benchmarks/coupling.py [--prompts 8] [--max-tokens 64] [--layers 12,20] [--temperature 0.8,1.0]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

PROMPTS = Path(__file__).with_name("prompts.jsonl")


def acceptance(p: torch.Tensor, q: torch.Tensor) -> dict[str, float]:
    """Mean acceptance probabilities of one drafted token over positions; p, q [N, V]."""
    F, G = p.cumsum(-1), q.cumsum(-1)
    overlap = (torch.minimum(F, G) - torch.maximum(F - p, G - q)).clamp(min=0).sum(-1)
    return {"coupled": overlap.mean().item(), "rejection": torch.minimum(p, q).sum(-1).mean().item(),
            "independent": (p * q).sum(-1).mean().item()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--layers", default="12,20", help="layer-skip drafts to measure (comma-separated)")
    ap.add_argument("--temperature", default="0.8,1.0")
    ap.add_argument("--threads", type=int)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from specair.models.llama import truncated
    from specair.runtime.llm import LLM
    from specair.runtime.params import SamplingParams

    llm = LLM()
    target = llm.engine.target
    chats = [json.loads(line)["messages"] for line in PROMPTS.read_text().splitlines()[:args.prompts]]
    answers = llm.chat(chats, SamplingParams(max_tokens=args.max_tokens))
    layers = [int(x) for x in args.layers.split(",")]
    temps = [float(x) for x in args.temperature.split(",")]
    logits: dict[str, list[torch.Tensor]] = {"target": [], **{str(n): [] for n in layers}}
    with torch.inference_mode():
        for chat, ans in zip(chats, answers):
            prompt = llm.encode_chat(chat)
            ids = torch.tensor([prompt + ans.token_ids])
            T = ids.shape[1]
            for name, model in [("target", target)] + [(str(n), truncated(target, n)) for n in layers]:
                k, v = model.empty_cache(1, 1)
                out = model(ids, torch.arange(T)[None], torch.zeros(1, dtype=torch.long), k, v)
                logits[name].append(out.logits[0, len(prompt) - 1:T - 1].double())
    rows = []
    for n in layers:
        for t in temps:
            p = (torch.cat(logits["target"]) / t).softmax(-1)
            q = (torch.cat(logits[str(n)]) / t).softmax(-1)
            rows.append({"layers": n, "temperature": t, "positions": p.shape[0], **acceptance(p, q)})
    print("| layer-skip draft | temperature | positions | exact, coupled draft (specair) | rejection sampling "
          "| exact, independent draft |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layers']} layers | {r['temperature']} | {r['positions']} | {r['coupled']:.3f} | "
              f"{r['rejection']:.3f} | {r['independent']:.3f} |")


if __name__ == "__main__":
    main()
