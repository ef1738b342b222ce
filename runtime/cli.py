"""The `specair` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Iterator

import torch

from specair.compile.quantize import QUANTIZE_CHOICES
from specair.models.errors import InputError, SpecairError

from specair.runtime.build import DTYPES, log
from specair.runtime.prompts import read_prompt_file


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
        records = [rec for _, rec in read_prompt_file(args.prompts)]
    for rec in records:
        if "messages" in rec:
            yield tokenizer.encode_chat(rec["messages"])
        elif args.chat:
            yield tokenizer.encode_chat([{"role": "user", "content": rec["prompt"]}])
        else:
            yield tokenizer.encode(rec["prompt"])


def _sampling(args: argparse.Namespace):
    from specair.runtime.params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)


def _engine(args: argparse.Namespace):
    from specair.runtime.build import open_engine, parse_spec

    parse_spec(args.speculative_config)  # fail on a bad config before loading anything
    backend = None if args.artifacts and args.backend == "auto" else args.backend
    return open_engine(args.model, args.dtype, args.speculative_config, backend, args.artifacts,
                       args.max_context, args.threads, getattr(args, "batch_buckets", (1,)),
                       quantize=getattr(args, "quantize", None), device=getattr(args, "device", None),
                       tensor_parallel_size=getattr(args, "tensor_parallel_size", 1))


def _stream(engine, ids: list[int], params, echo: bool):
    """Run one request to the end, printing its text as it comes; return its GenerationResult."""
    rid = engine.add_request(ids, params)
    while True:
        for ev in engine.step():
            if ev.request_id != rid:
                continue
            if echo:
                print(ev.text, end="", flush=True)
            if ev.result is not None:
                return ev.result


def _summary(res) -> str:
    spec = res.extra.get("spec")
    tau = f" | {spec['mean_accepted_length']:.2f} tokens per target pass" if spec else ""
    return (f"[{res.num_prompt_tokens} prompt tokens, {res.prefill_tokens_per_s:.1f} tok/s prefill, "
            f"ttft {res.ttft_s * 1000:.0f} ms | {res.num_generated_tokens} generated, "
            f"{res.decode_tokens_per_s:.1f} tok/s decode{tau} | finish: {res.finish_reason}]")


def _loaded(engine, params) -> None:
    t0 = time.perf_counter()
    if n := engine.load_graphs(params):
        log(f"loaded {n} graphs in {time.perf_counter() - t0:.1f}s")


def cmd_generate(args: argparse.Namespace) -> None:
    params = _sampling(args)
    engine = _engine(args)
    _loaded(engine, params)
    for ids in read_prompts(args, engine.tokenizer):
        res = _stream(engine, ids, params, echo=not args.json)
        if args.json:
            print(json.dumps({**res.to_json(), "backend": engine.graphs.backend.name}, ensure_ascii=False),
                  flush=True)
        else:
            print(flush=True)
            log(_summary(res))


def cmd_chat(args: argparse.Namespace) -> None:
    """An interactive chat: the model's chat template, streamed replies, speed and τ after each."""
    params = _sampling(args)
    engine = _engine(args)
    _loaded(engine, params)
    tok = engine.tokenizer
    if tok is None:
        raise InputError("this checkpoint has no tokenizer, so it cannot chat")
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    log("specair chat: type a message; /reset starts over, /exit (or Ctrl-D) quits")
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return
        if line.strip() in ("/exit", "/quit"):
            return
        if line.strip() == "/reset":
            messages = list(system)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        ids = tok.encode_chat(messages)
        try:
            res = _stream(engine, ids, params, echo=True)
        except InputError as e:  # e.g. the conversation outgrew the context: say so, keep chatting
            messages.pop()
            log(f"specair: {e}; /reset to start over")
            continue
        print(flush=True)
        messages.append({"role": "assistant", "content": res.text})
        log(_summary(res))


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def cmd_compile(args: argparse.Namespace) -> None:
    if args.tensor_parallel_size != 1:
        raise InputError("specair compile builds one process's graphs; with --tensor-parallel-size, generate, chat "
                         "and serve compile each rank's shard into specair's cache at start-up")
    from specair.runtime.build import compile_plan

    compile_plan(args.model, args.dtype, args.speculative_config, args.backend, args.out, args.buckets,
                 args.max_context, tuple(v for v in args.variants.split(",") if v), args.prefill_chunk, args.threads,
                 args.self_contained, args.quantize)


def cmd_check_onnx(args: argparse.Namespace) -> int:
    from specair.compile.onnx_ops import main_check_onnx

    return main_check_onnx(args.files)


def _sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--backend", default="auto",
                   help="auto (default): the fastest configuration here (onnxruntime on specair's kernels, a GGUF "
                        "file's weights read as stored), compiled ahead of time into specair's cache on first use and loaded afterwards; "
                        "or eager, inductor, aoti, onnx, cuda, npu: graphs compiled as they are first needed")
    p.add_argument("--device", help="where models, caches and graph inputs live (default: the backend's device: cpu, cuda for the cuda backend, npu for npu)")
    p.add_argument("--quantize", choices=QUANTIZE_CHOICES,
                   help="onnx: weight-only quantization of every linear layer (int4: specair's block kernels, a GGUF "
                        "file's weights as stored and float weights rounded onto Q4_K's shape (Q4_1 where K is not a "
                        "multiple of 256); int8: 8-bit "
                        "blocks of 32 like Q8_0); default: auto's choice (int4 for quantized GGUF files and float "
                        "checkpoints of 100M+ parameters), none, or what --artifacts hold")
    p.add_argument("--artifacts", metavar="DIR", help="run from a `specair compile` directory, compiling nothing")


def _model_options(p: argparse.ArgumentParser, spec_default: str | None = None) -> None:
    p.add_argument("--model", help="HF checkpoint dir, GGUF file or llama2.c .bin (default: SmolLM2-135M-Instruct)")
    auto = ("; default auto: n-gram prompt lookup where the graphs are row-independent (the default path), so "
            "speculation cannot change the output, plain decoding elsewhere; none: plain decoding"
            if spec_default == "auto" else "")
    p.add_argument("--speculative-config", metavar="JSON", default=spec_default,
                   help='e.g. \'{"method": "layer_skip", "num_layers": 8, "num_speculative_tokens": 4}\'' + auto)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--max-context", type=int, help="tokens of context to allocate (default: the model's; 2048 with --backend auto)")
    p.add_argument("--threads", type=int, help="CPU threads for torch and onnxruntime (per rank with --tensor-parallel-size)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="shard the model over N processes started by specair (torch.distributed; default 1)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specair", description="Speculative decoding as ahead-of-time compiled graphs.")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one or more prompts")
    _model_options(g, "auto")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompts", metavar="FILE.jsonl", help='one {"prompt": ...} or {"messages": [...]} per line')
    src.add_argument("--prompt-ids", metavar="JSON_LIST", help="prompt as token ids, e.g. '[1, 2, 3]'")
    g.add_argument("--chat", action="store_true", help="wrap --prompt in the model's chat template")
    _sampling_options(g)
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt on stdout")
    g.set_defaults(func=cmd_generate)

    ch = sub.add_parser("chat", help="chat interactively (chat template, streamed replies, tokens/s and τ)")
    _model_options(ch, "auto")
    _sampling_options(ch)
    ch.add_argument("--system", help="a system message to start the conversation with")
    ch.set_defaults(func=cmd_chat)

    c = sub.add_parser("compile", help="compile every graph of a bucket plan ahead of time")
    _model_options(c)
    c.add_argument("--backend", required=True, help="eager, inductor, aoti, onnx, cuda or npu")
    c.add_argument("--out", required=True, metavar="DIR", help="artifact directory to write")
    c.add_argument("--buckets", type=_int_list, default=(1, 2, 4, 8), help="batch buckets (default 1,2,4,8)")
    c.add_argument("--variants", default="greedy,filtered",
                   help="sampling graph variants among greedy,plain,filtered (default greedy,filtered)")
    c.add_argument("--prefill-chunk", type=int, default=128)
    c.add_argument("--quantize", choices=QUANTIZE_CHOICES, default="none",
                   help="onnx: weight-only quantization of every linear layer, LM head included (int4: MatMulNBits, "
                        "blocks of 32 like GGUF Q4_1; int8: 8-bit blocks of 32 like Q8_0; default none)")
    c.add_argument("--self-contained", action="store_true",
                   help="onnx: embed the weights in every file (for Ascend ATC) instead of one shared weights file")
    c.set_defaults(func=cmd_compile)

    from specair.benchmarks.run import add_bench_parser
    from specair.benchmarks.soak import add_soak_parser
    from specair.runtime.server import add_serve_parser

    from specair.training.cli import add_train_parser

    add_serve_parser(sub)
    add_bench_parser(sub)
    add_soak_parser(sub)
    add_train_parser(sub)

    o = sub.add_parser("check-onnx", help="report anything in ONNX files that Ascend ATC would not accept")
    o.add_argument("files", nargs="+")
    o.set_defaults(func=cmd_check_onnx)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    try:
        rc = args.func(args)
    except SpecairError as e:
        log(f"specair: error: {e}")
        return 2
    except KeyboardInterrupt:
        return 130
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())
