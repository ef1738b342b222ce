"""Teacher-forced agreement of onnx decode graphs with fp32 transformers on the shipped chat prompts.

For each of --prompts prompts, transformers' fp32 greedy answer of --max-tokens tokens is the text; every
decode graph (a `decode.b1.c*.greedy.onnx` file of an artifact directory with fused attention) is fed that
text token by token (its caches bound in place, so the graph's own K/V writes are the cache), and at each
answer position its argmax and log-softmax are compared with transformers': the share of positions with the
same next token and the mean / p95 KL(fp32 || graph) in nats. No divergence compounds.

    python benchmarks/teacher_forced.py --threads 2 DIR/decode.b1.c2048.greedy.onnx [MORE.onnx ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

PROMPTS = Path(__file__).with_name("prompts.jsonl")


def references(model_dir: str, n: int, max_tokens: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for line in PROMPTS.read_text().splitlines()[:n]:
        ids = tok.apply_chat_template(json.loads(line)["messages"], add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        with torch.no_grad():
            seq = hf.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)
            logp = torch.log_softmax(hf(seq).logits[0].double(), -1)
        out.append((seq[0].tolist(), len(ids), logp))
    return out


def agreement(path: str, refs) -> tuple[float, float, float, int]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.use_per_session_threads = False
    s = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    names = [o.name for o in s.get_outputs() if not o.name.endswith(".present")]
    same, kls = 0, []
    for ids, P, ref in refs:
        io = s.io_binding()
        for name in names:  # first, so get_outputs() lists them before the in-place cache outputs
            io.bind_output(name, "cpu")
        caches = [np.zeros(i.shape, np.float32) for i in s.get_inputs() if ".present" not in i.name and "cache." in i.name]
        for i, a in zip([i for i in s.get_inputs() if "cache." in i.name], caches):
            io.bind_cpu_input(i.name, a)
            io.bind_output(i.name + ".present", "cpu", 0, np.float32, list(a.shape), a.ctypes.data)
        for t in range(len(ids) - 1):
            io.bind_cpu_input("tokens", np.array([ids[t]], np.int64))
            io.bind_cpu_input("cache_len", np.array([t], np.int64))
            s.run_with_iobinding(io)
            if t >= P - 1:
                logits = torch.from_numpy(io.get_outputs()[names.index("logits")].numpy()[0]).double()
                same += int(logits.argmax() == ref[t].argmax())
                kls.append(float((ref[t].exp() * (ref[t] - torch.log_softmax(logits, -1))).sum()))
    return same / len(kls), float(np.mean(kls)), float(np.percentile(kls, 95)), len(kls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("graphs", nargs="+")
    ap.add_argument("--model", help="HF fp32 directory (default: the default model's)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import onnxruntime as ort

    from specair.models.default_model import default_model_dir

    ort.capi._pybind_state.set_global_thread_pool_sizes(args.threads, 1)
    refs = references(args.model or str(default_model_dir()), args.prompts, args.max_tokens)
    for path in args.graphs:
        same, kl, p95, n = agreement(path, refs)
        print(f"{path}: same next token {same:.4f} over {n} positions, mean KL {kl:.5f}, p95 KL {p95:.5f}")


if __name__ == "__main__":
    main()
