"""`specair serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) with Prometheus metrics.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both stream with `"stream": true` as server-sent
events), GET /v1/models, GET /health, GET /metrics. The request, response and error bodies are OpenAI's, as
`openai_api.py` defines them; every response (the last chunk of a stream) carries `spec_decode` when the server
speculates.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import sys
import threading
import time
import uuid
from contextlib import asynccontextmanager
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specair.models.errors import InputError, SpecairError
from specair.runtime.async_engine import AsyncEngine, RequestFailedError, RequestStream
from specair.runtime.metrics import ServerMetrics
from specair.runtime.openai_api import (DEFAULT_COMPLETION_MAX_TOKENS, ApiError, ChatCompletionRequest,
                                        CompletionRequest, SamplingRequest, api_error_from, sse, spec_decode_stats,
                                        usage, validation_message)
from specair.runtime.params import GenerationResult, SamplingParams

logger = logging.getLogger("specair.serve")

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left; nobody reads it, the access log does


# ---------------------------------------------------------------------------------------------------------------
# Serving


class OpenAIServer:
    """The HTTP handlers over one AsyncEngine."""

    def __init__(self, async_engine: AsyncEngine, model_name: str, *, tokenizer: Any, max_context: int,
                 model_root: str | None = None) -> None:
        self.engine, self.model_name, self.tokenizer = async_engine, model_name, tokenizer
        self.max_context, self.model_root = max_context, model_root or model_name
        self.created = int(time.time())

    # -- admission ------------------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    def max_tokens_for(self, requested: int | None, default: int | None, num_prompt: int, param: str) -> int:
        """The generation budget: the request's, checked against the context, else the default that fits."""
        if num_prompt >= self.max_context:
            raise ApiError(400, f"This model's maximum context length is {self.max_context} tokens, but the "
                                f"prompt has {num_prompt} tokens (at least one more is needed to generate). "
                                "Please shorten the prompt.", param="prompt", code="context_length_exceeded")
        room = self.max_context - num_prompt
        if requested is None:
            return room if default is None else min(default, room)
        if requested > room:
            raise ApiError(400, f"This model's maximum context length is {self.max_context} tokens. However, you "
                                f"requested {num_prompt + requested} tokens ({num_prompt} in the prompt, "
                                f"{requested} for the completion). Please reduce the length of the prompt or "
                                f"{param}.", param=param, code="context_length_exceeded")
        return requested

    def completion_prompt(self, req: CompletionRequest) -> list[int]:
        if isinstance(req.prompt, str):
            if not req.prompt:
                raise ApiError(400, "the prompt is empty", param="prompt")
            if self.tokenizer is None:
                raise ApiError(400, "this model has no tokenizer; send the prompt as a list of token ids",
                               param="prompt")
            ids = self.tokenizer.encode(req.prompt)
        else:
            ids = list(req.prompt)
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        return ids

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer, so no chat template; use /v1/completions with "
                                "token ids", param="messages")
        try:
            ids = self.tokenizer.encode_chat([m.as_template_input() for m in req.messages],
                                             add_generation_prompt=req.add_generation_prompt)
        except InputError as e:
            raise ApiError(400, str(e), param="messages") from None
        if not ids:
            raise ApiError(400, "the chat template rendered these messages as an empty prompt", param="messages")
        return ids

    def submit(self, ids: list[int], params: SamplingParams, request_id: str) -> RequestStream:
        try:
            return self.engine.add_request(ids, params, request_id)
        except Exception as e:  # noqa: BLE001 -- every admission failure becomes an HTTP answer
            raise api_error_from(e) from None

    # -- endpoints ------------------------------------------------------------------------------------------

    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        req.check_stream_options()
        ids = self.completion_prompt(req)
        params = self._params(req, req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, len(ids), "max_tokens")
        rid = f"cmpl-{uuid.uuid4().hex}"
        stream = self.submit(ids, params, rid)
        head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_name}

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            def chunk(text: str, result: GenerationResult | None) -> dict[str, Any] | None:
                if result is None and not text:
                    return None
                body = {**head, "choices": [{"index": 0, "text": text, "logprobs": None,
                                             "finish_reason": result.finish_reason if result else None,
                                             "stop_reason": None}]}
                if result is not None and (spec := spec_decode_stats(result)) is not None:
                    body["spec_decode"] = spec
                return body

            return self._sse(stream, head, chunk, include_usage)

        result = await self._wait_result(stream, raw)
        if result is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        body = {**head, "choices": [{"index": 0, "text": result.text, "logprobs": None,
                                     "finish_reason": result.finish_reason, "stop_reason": None}],
                "usage": usage(result)}
        if (spec := spec_decode_stats(result)) is not None:
            body["spec_decode"] = spec
        return JSONResponse(body, headers={"X-Request-Id": rid})

    async def chat_completions(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        req.check_stream_options()
        ids = self.chat_prompt(req)
        requested, param = ((req.max_completion_tokens, "max_completion_tokens")
                            if req.max_completion_tokens is not None else (req.max_tokens, "max_tokens"))
        params = self._params(req, requested, None, len(ids), param)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        stream = self.submit(ids, params, rid)
        head = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.model_name}

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            chunk_head = {**head, "object": "chat.completion.chunk"}
            # The role comes first, alone, as OpenAI and vLLM send it: it tells the client the request is admitted.
            opening = {**chunk_head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}]}

            def chunk(text: str, result: GenerationResult | None) -> dict[str, Any] | None:
                if result is None and not text:
                    return None
                body = {**chunk_head, "choices": [{"index": 0, "delta": {"content": text} if text else {},
                                                   "logprobs": None,
                                                   "finish_reason": result.finish_reason if result else None}]}
                if result is not None and (spec := spec_decode_stats(result)) is not None:
                    body["spec_decode"] = spec
                return body

            return self._sse(stream, chunk_head, chunk, include_usage, opening)

        result = await self._wait_result(stream, raw)
        if result is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        body = {**head, "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                                     "logprobs": None, "finish_reason": result.finish_reason}],
                "usage": usage(result)}
        if (spec := spec_decode_stats(result)) is not None:
            body["spec_decode"] = spec
        return JSONResponse(body, headers={"X-Request-Id": rid})

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "specair",
            "root": self.model_root, "parent": None, "max_model_len": self.max_context}]}

    # -- helpers --------------------------------------------------------------------------------------------

    def _params(self, req: SamplingRequest, requested: int | None, default: int | None, num_prompt: int,
                param: str) -> SamplingParams:
        max_tokens = self.max_tokens_for(requested, default, num_prompt, param)
        try:
            return req.sampling_params(max_tokens)
        except InputError as e:
            raise ApiError(400, str(e)) from None

    async def _wait_result(self, stream: RequestStream, raw: Request) -> GenerationResult | None:
        """The request's result; None when the client disconnected first (the request is then aborted)."""

        async def collect() -> GenerationResult:
            async for event in stream:
                if event.result is not None:
                    return event.result
            raise RequestFailedError("the engine ended the request without a result")

        async def disconnected() -> None:
            while (await raw.receive())["type"] != "http.disconnect":
                pass

        work, watch = asyncio.ensure_future(collect()), asyncio.ensure_future(disconnected())
        try:
            done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
            stream.abort()  # frees the slot unless the request finished
        if work not in done:
            logger.info("client went away before %s finished: aborted", stream.request_id)
            return None
        try:
            return work.result()
        except Exception as e:  # noqa: BLE001 -- one request's failure is its own 500, never the server's
            raise api_error_from(e) from None

    def _sse(self, stream: RequestStream, head: dict[str, Any], make_chunk: Any, include_usage: bool,
             opening: dict[str, Any] | None = None) -> StreamingResponse:
        """Server-sent events: `make_chunk(text, result)` turns each engine event into a chunk (or None to skip
        it); a usage chunk follows the last one when asked for; `data: [DONE]` ends the stream."""

        async def body() -> AsyncIterator[bytes]:
            try:
                if opening is not None:
                    yield sse(opening)
                async for event in stream:
                    result = event.result
                    payload = make_chunk(event.text, result)
                    if payload is not None:
                        yield sse(payload)
                    if result is not None and include_usage:
                        yield sse({**head, "choices": [], "usage": usage(result)})
            except Exception as e:  # noqa: BLE001 -- the response has started: report in-band, as vLLM does
                err = api_error_from(e)
                logger.warning("request %s failed: %s", stream.request_id, err.message)
                yield sse(err.body())
            finally:
                stream.abort()  # a client that went away frees its slot now, not when the generator is collected
            yield sse("[DONE]")

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"X-Request-Id": stream.request_id, "Cache-Control": "no-cache"})


def build_app(engine: Any, *, served_model_name: str | None = None, batch_buckets: tuple[int, ...] = (),
              model_root: str | None = None) -> FastAPI:
    """The FastAPI app serving `engine` (a specair.runtime.engine.Engine); its stepping thread starts with the
    app's lifespan and stops with it."""
    model_name = served_model_name or getattr(engine, "model_name", None) or "specair"
    # The engine's own plan knows the buckets (an artifact directory's may differ from the command line's);
    # per-position counters exist from the start for its lookahead depth (more appear if needed).
    buckets = tuple(getattr(getattr(engine, "plan", None), "batch_buckets", None) or batch_buckets)
    metrics = ServerMetrics(model_name, buckets, engine.plan.max_depth, engine.max_context)
    async_engine = AsyncEngine(engine, metrics)
    server = OpenAIServer(async_engine, model_name, tokenizer=engine.tokenizer, max_context=engine.max_context,
                          model_root=model_root)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)

    app = FastAPI(title="specair", lifespan=lifespan)
    app.state.server, app.state.async_engine = server, async_engine

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        message, param = validation_message(errors[0]) if errors else ("invalid request", None)
        content_type = request.headers.get("content-type", "")
        if param is None and "json" not in content_type:
            message += f" (the body was sent as {content_type or 'no content type'}; send application/json)"
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
        return ApiError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return ApiError(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None).response()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await server.completions(req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await server.chat_completions(req, raw)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return server.models()

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.alive:
            return ApiError(503, f"the engine is not serving: {async_engine.dead_reason or 'not started'}",
                            code="engine_dead").response()
        return Response(status_code=200)

    @app.get("/metrics")
    def metrics_endpoint() -> Response:  # sync, so it runs in the thread pool: the KV gauge reads smaps
        data, content_type = metrics.render()
        return Response(data, media_type=content_type)

    return app


# ---------------------------------------------------------------------------------------------------------------
# Command line


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive batch sizes, got {text!r}")
    return tuple(sorted(set(values)))


_SIZE_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _size(text: str) -> int:
    """Bytes from "4294967296", "4G", "4GiB", "4GB" or "1.5G" (K, M, G, T are powers of 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m or float(m[1]) <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive size such as 4G or 512M, got {text!r}")
    return int(float(m[1]) * _SIZE_UNITS[m[2].upper()])


def _buckets_up_to(n: int) -> tuple[int, ...]:
    """Batch buckets for at most n sequences: the powers of two below n, then n."""
    return tuple(sorted({2**i for i in range(n.bit_length()) if 2**i < n} | {n}))


def add_serve_parser(subparsers: Any) -> None:
    """Register `specair serve` on the CLI's subparsers."""
    from specair.runtime.build import AUTO, DTYPES

    p = subparsers.add_parser("serve", help="serve an OpenAI-compatible HTTP API with Prometheus metrics",
                              description="OpenAI-compatible server: /v1/completions, /v1/chat/completions, "
                                          "/v1/models, /health, /metrics.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", help="HF checkpoint dir, GGUF file or llama2.c .bin (default: SmolLM2-135M-Instruct)")
    p.add_argument("--speculative-config", metavar="JSON", default=AUTO,
                   help='e.g. \'{"method": "layer_skip", "num_layers": 8, "num_speculative_tokens": 4}\'; default '
                        'auto: n-gram prompt lookup where the graphs are row-independent and one sequence runs '
                        '(--batch-buckets 1), plain decoding elsewhere; none: plain decoding')
    p.add_argument("--backend", default=AUTO,
                   help="auto (default): the fastest configuration here (onnxruntime, the default model's weights as "
                        "exact int4; eager with --tensor-parallel-size), compiled once into specair's cache for "
                        "these batch buckets and loaded afterwards; or eager, inductor, aoti, onnx, cuda, npu: "
                        "graphs compiled as they are first needed")
    p.add_argument("--device", help="where models, caches and graph inputs live (default: the backend's device: cpu, cuda for the cuda backend, npu for npu)")
    p.add_argument("--artifacts", metavar="DIR", help="serve from a `specair compile` directory, compiling nothing")
    p.add_argument("--quantize", choices=("none", "int4", "int8"),
                   help="onnx backend: weight-only quantization of every linear layer and the LM head")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--max-context", type=int,
                   help="tokens of context per sequence (default: the model's; 2048 with --backend auto)")
    p.add_argument("--threads", type=int, help="CPU threads for torch and onnxruntime")
    p.add_argument("--batch-buckets", type=_int_list, metavar="1,2,4,8",
                   help="batch buckets; the largest is the number of concurrent sequences (default 1,2,4,8)")
    p.add_argument("--max-num-seqs", type=int, metavar="N",
                   help="most sequences running at once (vLLM's name): batch buckets 1, 2, 4, ... below N, then N")
    p.add_argument("--kv-cache-memory-bytes", type=_size, metavar="SIZE",
                   help="KV cache budget, e.g. 2G: a request starts only while the caches fit it with every running "
                        "request at its longest (prompt + max_tokens); default: no budget")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="keep prompts' KV across requests, so a prompt that starts as an earlier one prefills only "
                        "past what they share (on where that is exact: row-independent graphs, the default path; "
                        "default on)")
    p.add_argument("--max-waiting", type=int, default=64, metavar="N",
                   help="requests queued beyond the running ones before answering 429 (default 64)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="shard the model over N processes (torch.distributed; default 1)")
    p.add_argument("--served-model-name", help="the model name clients send (default: the engine's model name)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    """Load the model, build the engine and serve until interrupted."""
    import uvicorn

    from specair.runtime.llm import LLM

    if args.max_waiting < 0:
        raise InputError(f"--max-waiting must be >= 0, got {args.max_waiting}")
    buckets = args.batch_buckets or (1, 2, 4, 8)
    if args.max_num_seqs is not None:
        if args.max_num_seqs < 1:
            raise InputError(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}")
        if args.batch_buckets and max(args.batch_buckets) != args.max_num_seqs:
            raise InputError(f"--max-num-seqs {args.max_num_seqs} disagrees with --batch-buckets "
                             f"{','.join(map(str, args.batch_buckets))}, whose largest is the number of sequences")
        buckets = args.batch_buckets or _buckets_up_to(args.max_num_seqs)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    llm = LLM(args.model, args.speculative_config, backend=args.backend, artifacts=args.artifacts,
              dtype=args.dtype, max_context=args.max_context, batch_buckets=buckets, threads=args.threads,
              max_waiting=args.max_waiting, quantize=args.quantize, device=args.device,
              tensor_parallel_size=args.tensor_parallel_size, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
              enable_prefix_caching=args.enable_prefix_caching)
    llm.engine.graphs.load_pending()  # every compiled graph now, so no session load lands inside a request
    app = build_app(llm.engine, served_model_name=args.served_model_name, batch_buckets=buckets,
                    model_root=args.model)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("binding %s: the server has no authentication, so anyone who can reach this address can "
                       "use it", args.host)
    logger.info("serving %s on http://%s:%d (%d sequence slots, up to %d waiting)",
                app.state.server.model_name, args.host, args.port, llm.engine.num_slots, args.max_waiting)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=5))
    fatal: list[str] = []

    def stop(reason: str) -> None:  # answer 503 for a moment, then exit non-zero
        logger.error("the engine stopped serving: %s; exiting", reason)
        fatal.append(reason)
        threading.Timer(FATAL_EXIT_DELAY_S, lambda: setattr(server, "should_exit", True)).start()

    app.state.async_engine.on_fatal.append(stop)
    try:
        server.run()
    finally:
        llm.close()
    return 1 if fatal else 0


FATAL_EXIT_DELAY_S = 2.0


def main(argv: list[str] | None = None) -> int:
    """`python -m specair.runtime.server [options]`: `specair serve` without the rest of the CLI."""
    parser = argparse.ArgumentParser(prog="python -m specair.runtime.server")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        return cmd_serve(args)
    except SpecairError as e:
        print(f"specair: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
