"""Reference (autoregressive) decode speed next to HF transformers generate() on the same weights.

Runs both engines interleaved prompt by prompt in one process after a warm-up, greedy, batch 1, and
prints tokens/s, their ratio and the memory-bandwidth floor (weight bytes / measured bandwidth).

    python benchmarks/reference_decode.py [--model PATH] [--max-tokens 128] [--rounds 3] [--threads N] [--profile]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch
from tqdm import tqdm

from specair.models.checkpoint import load_checkpoint
from specair.models.default_model import default_model_dir
from specair.models.llama import build_model
from specair.runtime.params import SamplingParams
from specair.runtime.reference import ReferenceDecoder

PROMPTS = [
    "Explain how a hash map works, with an example in Python.",
    "Write a short poem about the sea at night.",
    "Summarise the causes of the French Revolution in five sentences.",
    "What are three tips for learning a new language?",
]


def measure_bandwidth(nbytes: int = 1 << 29, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: the best of several full reductions over a buffer larger than cache."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def profile_decode_step(model, steps: int = 10) -> dict:
    """Where one greedy decode step's time goes: all ops vs the matrix multiplies (torch.profiler)."""
    from torch.profiler import profile

    from specair.graphs.steps import decode_step

    k, v = model.empty_cache(1, 256)
    args = (torch.tensor([5]), torch.tensor([100]), k, v, torch.zeros(1), torch.zeros(1, dtype=torch.long),
            torch.ones(1), torch.zeros(1))
    with torch.inference_mode():
        for _ in range(3):
            decode_step(model, *args, ctx=128, variant="greedy")
        t = time.perf_counter()
        for _ in range(steps):
            decode_step(model, *args, ctx=128, variant="greedy")
        wall = (time.perf_counter() - t) / steps
        with profile() as prof:
            for _ in range(steps):
                decode_step(model, *args, ctx=128, variant="greedy")
    events = prof.key_averages()
    mm = sum(e.self_cpu_time_total for e in events if e.key in ("aten::mm", "aten::addmm")) / steps / 1e3
    return {"step_ms": wall * 1e3, "matmul_ms": mm, "ops_per_step": sum(e.count for e in events) / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF checkpoint dir (default: the converted default model)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--profile", action="store_true", help="also break one decode step down (torch.profiler)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    path = args.model or str(default_model_dir())
    ckpt = load_checkpoint(path)
    model = build_model(ckpt.config, ckpt.state_dict)
    tok = ckpt.tokenizer
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # Like --ignore-eos: EOS may be generated but does not stop (min_new_tokens would forbid it instead).
    hf.generation_config.eos_token_id = None
    decoder = ReferenceDecoder(model, tok, max_context=2048)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
               for p in PROMPTS]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)

    def run_specair(ids):
        r = decoder.generate(ids, params)
        return r.decode_tokens_per_s, r.token_ids

    def run_hf(ids):
        x = torch.tensor([ids])
        with torch.no_grad():
            t0 = time.perf_counter()
            hf.generate(x, max_new_tokens=1, do_sample=False)
            t1 = time.perf_counter()
            out = hf.generate(x, max_new_tokens=args.max_tokens, do_sample=False)
            assert out.shape[1] == len(ids) + args.max_tokens
            t2 = time.perf_counter()
        # Decode rate: the whole run minus a one-token run (prefill + first token).
        return (args.max_tokens - 1) / ((t2 - t1) - (t1 - t0)), out[0, len(ids):].tolist()

    run_specair(prompts[0][:16]), run_hf(prompts[0][:16])  # warm-up
    rates = {"specair": [], "transformers": []}
    agree = []
    for _ in tqdm(range(args.rounds), desc="rounds", file=sys.stderr):
        for ids in prompts:
            s, s_ids = run_specair(ids)
            h, h_ids = run_hf(ids)
            rates["specair"].append(s)
            rates["transformers"].append(h)
            agree.append(s_ids == h_ids)
    bw = measure_bandwidth()
    weight_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    result = {
        "model": path, "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "specair_decode_tok_s": statistics.median(rates["specair"]),
        "transformers_decode_tok_s": statistics.median(rates["transformers"]),
        "greedy_outputs_identical": f"{sum(agree)}/{len(agree)}",
        "measured_read_bandwidth_GB_s": bw / 1e9, "weight_bytes": weight_bytes,
        "bandwidth_floor_tok_s": bw / weight_bytes,
    }
    result["ratio_specair_over_transformers"] = result["specair_decode_tok_s"] / result["transformers_decode_tok_s"]
    result["fraction_of_bandwidth_floor"] = result["specair_decode_tok_s"] / result["bandwidth_floor_tok_s"]
    result["floor_ms_per_token"] = 1e3 / result["bandwidth_floor_tok_s"]
    if args.profile:
        result["decode_step_profile"] = profile_decode_step(model)
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
