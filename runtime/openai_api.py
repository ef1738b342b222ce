"""OpenAI's API as `specair serve` speaks it: request bodies (pydantic, strict), error bodies and the response
pieces shared by the endpoints. Shapes follow OpenAI's API as vLLM's server implements it, with vLLM's extensions
`top_k`, `ignore_eos` and `add_generation_prompt`, and one of specair's own: `spec_decode`, a request's
speculation statistics.

Errors have OpenAI's body, `{"error": {"message", "type", "param", "code"}}`: 400 for a request that cannot be
served as written (never 422), 404 for an unknown model or path, 429 when the engine's queue is full, 500 when
the engine fails on a request (the others keep going), 503 when the engine has stopped.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from specair.models.errors import SpecairError
from specair.runtime.async_engine import EngineDeadError, RequestFailedError
from specair.runtime.params import MAX_TEMPERATURE, MIN_TEMPERATURE, GenerationResult, SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions


# ---------------------------------------------------------------------------------------------------------------
# Errors


class ApiError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def api_error_from(e: BaseException) -> ApiError:
    """The HTTP answer for an exception raised while admitting or serving a request."""
    from specair.runtime.engine import QueueFullError

    if isinstance(e, ApiError):
        return e
    if isinstance(e, QueueFullError):
        return ApiError(429, f"the server is busy: {e}; retry later", code="queue_full", type="rate_limit_error")
    if isinstance(e, EngineDeadError):
        return ApiError(503, f"the engine is not serving: {e}", code="engine_dead")
    if isinstance(e, RequestFailedError):
        return ApiError(500, str(e), code="engine_error")
    if isinstance(e, SpecairError):  # InputError and kin: the request as written cannot be served
        return ApiError(400, str(e))
    return ApiError(500, f"internal error: {e!r}", code="internal_error")


def validation_message(err: dict[str, Any]) -> tuple[str, str | None]:
    """A readable message and the offending parameter for one pydantic error."""
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    kind, msg = err.get("type", ""), str(err.get("msg", "invalid value"))
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", msg)
        return f"the request body is not valid JSON: {detail}", None
    if kind == "extra_forbidden":
        return f"unknown or unsupported field '{param}'", param
    if kind == "missing":
        if param is None:
            return "the request body is empty: send a JSON object", None
        return f"missing required field '{param}'", param
    msg = msg.removeprefix("Value error, ")
    if param is None:
        return f"the request body must be a JSON object: {msg}", None
    return f"{param}: {msg}", param


# ---------------------------------------------------------------------------------------------------------------
# Request bodies


# The values of unimplemented OpenAI options that ask for nothing (the only ones accepted).
NO_OP_VALUES: dict[str, list[Any]] = {
    "presence_penalty": [0], "frequency_penalty": [0], "logit_bias": [None, {}], "logprobs": [None, False],
    "top_logprobs": [None, 0], "echo": [False], "best_of": [None, 1], "suffix": [None],
    "response_format": [None, {"type": "text"}],
}


class _Strict(BaseModel):
    # Unknown fields are errors (a typo must not be silently ignored); no string-to-number coercion.
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False,
                               description=f"0 is greedy; otherwise at least {MIN_TEMPERATURE}")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="0 or -1 disables (vLLM's convention)")
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False
    user: str | None = None
    # OpenAI options specair does not implement: accepted at their no-op values, which many clients send
    # explicitly, and refused otherwise (see _only_default).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    @field_validator("presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "echo",
                     "best_of", "suffix", "response_format", check_fields=False)
    @classmethod
    def _only_default(cls, v: Any, info: ValidationInfo) -> Any:
        if v not in NO_OP_VALUES[info.field_name]:
            raise ValueError(f"{json.dumps(v)} is not supported: specair does not implement {info.field_name}; "
                             "omit it")
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if 0 < v < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}")
        return v

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported (one choice per request); send several requests instead")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> str | list[str] | None:
        if v is not None and (v == "" or any(not s for s in ([v] if isinstance(v, str) else v))):
            raise ValueError("stop strings must be non-empty")
        return v

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=max(self.top_k, 0), seed=self.seed, stop=stop, ignore_eos=self.ignore_eos)

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream=true", param="stream_options")


class CompletionRequest(SamplingRequest):
    prompt: str | list[int]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        if isinstance(v, list) and v and all(isinstance(x, str) for x in v):
            raise ValueError("a list of prompts is not supported; send one request per prompt")
        if isinstance(v, list) and any(isinstance(x, list) for x in v):
            raise ValueError("a list of token-id prompts is not supported; send one request per prompt")
        if not isinstance(v, (str, list)) or (isinstance(v, list) and not all(
                isinstance(x, int) and not isinstance(x, bool) for x in v)):
            raise ValueError("prompt must be a string or a list of token ids (integers)")
        return v


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Required except for an assistant turn, as OpenAI's schema has it (checked even when absent).
    content: str | list[TextPart] | None = Field(None, validate_default=True)
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None and info.data.get("role", "assistant") != "assistant":
            raise ValueError(f"a {info.data['role']} message needs content (a string or a list of text parts)")
        if isinstance(v, list):
            for i, part in enumerate(v):
                if not isinstance(part, dict):
                    raise ValueError(f"content part {i} must be an object like "
                                     '{"type": "text", "text": "..."}')
                if part.get("type") != "text":
                    raise ValueError(f"content part of type {part.get('type')!r} is not supported; "
                                     "only text parts are")
        return v

    def as_template_input(self) -> dict[str, Any]:
        text = self.content if isinstance(self.content, str) or self.content is None else \
            "".join(p.text for p in self.content)
        msg: dict[str, Any] = {"role": self.role, "content": text or ""}
        if self.name is not None:
            msg["name"] = self.name
        return msg


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    add_generation_prompt: bool = True
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None


def spec_decode_stats(result: GenerationResult) -> dict[str, Any] | None:
    """The request's speculation statistics for the `spec_decode` response field (None when not speculating)."""
    spec = result.extra.get("spec")
    if not spec:
        return None
    out = dict(spec)
    drafted = spec.get("num_draft_tokens") or 0
    out["acceptance_rate"] = spec.get("num_accepted_tokens", 0) / drafted if drafted else None
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in out.items()}


def usage(result: GenerationResult) -> dict[str, Any]:
    return {"prompt_tokens": result.num_prompt_tokens, "completion_tokens": result.num_generated_tokens,
            "total_tokens": result.num_prompt_tokens + result.num_generated_tokens,
            "prompt_tokens_details": {"cached_tokens": result.num_cached_tokens}}


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
