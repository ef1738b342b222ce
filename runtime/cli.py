"""The `specair` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Iterator

import torch

from specair.models.errors import InputError, SpecairError

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load(model_path: str | None, dtype: str) -> tuple[Any, Any]:
    """The model and its tokenizer (None for checkpoints without one) from a path, or the default model."""
    from specair.models.checkpoint import load_checkpoint
    from specair.models.llama import build_model

    t0 = time.perf_counter()
    ckpt = load_checkpoint(model_path, dtype=DTYPES[dtype])
    model = build_model(ckpt.config, ckpt.state_dict, DTYPES[dtype])
    log(f"loaded {ckpt.source} ({ckpt.config.model_type}, {ckpt.config.num_layers} layers, {dtype}) "
        f"in {time.perf_counter() - t0:.1f}s")
    return model, ckpt.tokenizer


def read_prompts(args: argparse.Namespace, tokenizer: Any) -> Iterator[list[int]]:
    """Token ids for each prompt given by --prompt, --prompts or --prompt-ids."""
    if args.prompt_ids is not None:
        try:
            ids = json.loads(args.prompt_ids)
        except json.JSONDecodeError as e:
            raise InputError(f"--prompt-ids is not a JSON list of token ids: {e}") from None
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise InputError("--prompt-ids must be a JSON list of integers")
        yield ids
        return
    if tokenizer is None:
        raise InputError("this checkpoint has no tokenizer; pass token ids with --prompt-ids")
    if args.prompt is not None:
        records: list[dict] = [{"messages": [{"role": "user", "content": args.prompt}]} if args.chat
                               else {"prompt": args.prompt}]
    else:
        records = list(_read_jsonl(args.prompts))
    for rec in records:
        if "messages" in rec:
            yield tokenizer.encode(tokenizer.apply_chat_template(rec["messages"]), add_special_tokens=False)
        elif args.chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": rec["prompt"]}])
            yield tokenizer.encode(text, add_special_tokens=False)
        else:
            yield tokenizer.encode(rec["prompt"])


def _read_jsonl(path: str) -> Iterator[dict]:
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except OSError as e:
        raise InputError(f"cannot read prompts file {path}: {e.strerror}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        ok_prompt = isinstance(rec, dict) and isinstance(rec.get("prompt"), str)
        ok_msgs = isinstance(rec, dict) and isinstance(rec.get("messages"), list) and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in rec["messages"])
        if not (ok_prompt or ok_msgs):
            raise InputError(f'{path}:{n}: expected {{"prompt": "..."}} or '
                             f'{{"messages": [{{"role": ..., "content": ...}}, ...]}}')
        yield rec


def make_decoder(model: Any, tokenizer: Any, spec_json: str | None, dtype: str, max_context: int | None) -> Any:
    """The reference decoder, or a speculative one as --speculative-config describes."""
    from specair.runtime.reference import ReferenceDecoder

    if spec_json is None:
        return ReferenceDecoder(model, tokenizer, max_context=max_context)
    from specair.models.llama import truncated
    from specair.runtime.spec_config import SpeculativeConfig
    from specair.runtime.speculative import SpeculativeDecoder

    spec = SpeculativeConfig.parse(spec_json)
    if spec.method == "layer_skip":
        draft = truncated(model, spec.num_layers)
    else:
        draft, draft_tok = load(spec.model, dtype)
        if tokenizer is not None and draft_tok is not None and tokenizer.backend.get_vocab() != draft_tok.backend.get_vocab():
            raise InputError(f"the draft model {spec.model} has a different tokenizer than the target; "
                             "a draft must share the target's vocabulary")
    log(f"speculating with {spec.method} (k={spec.num_speculative_tokens}, tree={spec.tree or 'chain'}, "
        f"acceptance={spec.acceptance})")
    return SpeculativeDecoder(model, draft, spec, tokenizer, max_context=max_context)


def cmd_generate(args: argparse.Namespace) -> None:
    from specair.runtime.params import SamplingParams
    from specair.runtime.spec_config import SpeculativeConfig

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    if args.speculative_config is not None:
        SpeculativeConfig.parse(args.speculative_config)  # fail on a bad config before loading anything
    model, tokenizer = load(args.model, args.dtype)
    decoder = make_decoder(model, tokenizer, args.speculative_config, args.dtype, args.max_context)
    for ids in read_prompts(args, tokenizer):
        for event in decoder.stream(ids, params):
            if not args.json:
                print(event.text, end="", flush=True)
        res = event.result
        if args.json:
            print(json.dumps(res.to_json(), ensure_ascii=False), flush=True)
        else:
            print(flush=True)
            spec = res.extra.get("spec")
            tau = f" | {spec['mean_accepted_length']:.2f} tokens per target pass" if spec else ""
            log(f"[{res.num_prompt_tokens} prompt tokens, {res.prefill_tokens_per_s:.1f} tok/s prefill, "
                f"ttft {res.ttft_s * 1000:.0f} ms | {res.num_generated_tokens} generated, "
                f"{res.decode_tokens_per_s:.1f} tok/s decode{tau} | finish: {res.finish_reason}]")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specair", description="Speculative decoding as ahead-of-time compiled graphs.")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("--model", help="HF checkpoint dir, GGUF file or llama2.c .bin (default: SmolLM2-135M-Instruct)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompts", metavar="FILE.jsonl", help='one {"prompt": ...} or {"messages": [...]} per line')
    src.add_argument("--prompt-ids", metavar="JSON_LIST", help="prompt as token ids, e.g. '[1, 2, 3]'")
    g.add_argument("--chat", action="store_true", help="wrap --prompt in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    g.add_argument("--max-context", type=int, help="tokens of context to allocate (default: the model's)")
    g.add_argument("--threads", type=int, help="CPU threads for torch")
    g.add_argument("--speculative-config", metavar="JSON",
                   help='e.g. \'{"method": "layer_skip", "num_layers": 8, "num_speculative_tokens": 4}\'')
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt on stdout")
    g.set_defaults(func=cmd_generate)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    try:
        args.func(args)
    except SpecairError as e:
        log(f"specair: error: {e}")
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
