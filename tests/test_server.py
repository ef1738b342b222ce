"""`specair serve` end to end: a real server process on localhost, a real HTTP client.

One server for the module: a tiny random Llama with the default model's real tokenizer, speculating with
layer_skip, batch buckets 1,2,4 (four sequence slots) and two waiting places, in float64 so that batched and
solo greedy runs agree exactly (no float32 near-tie can flip a token between batch shapes). Engine failures
are injected in a second, in-process server, around the real engine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import save_tiny

from specair.runtime.params import SamplingParams

SPEC = {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 3}
SLOTS, MAX_WAITING, MAX_CONTEXT = 4, 2, 512
MODEL = "tiny-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, default_hf_dir: Path) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny("llama", path, vocab_size=49152)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (default_hf_dir / name).exists():
            shutil.copy(default_hf_dir / name, path / name)
    return path


@contextmanager
def serving(args: list[str], log: Path) -> Iterator[str]:
    """A real `specair serve` with these flags on a free port, until the block ends; yields its base URL and
    checks it exited cleanly."""
    port = _free_port()
    cmd = [sys.executable, "-m", "specair.runtime.cli", "serve", "--port", str(port), *args]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited with {proc.returncode}:\n{log.read_text()}")
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the server did not come up in 300 s:\n{log.read_text()}")
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    # uvicorn shuts down gracefully on SIGTERM, then re-raises the signal: -SIGTERM is a clean exit too.
    text = log.read_text()
    assert proc.returncode in (0, -signal.SIGTERM) and "Traceback" not in text, (proc.returncode, text)


@pytest.fixture(scope="module")
def url(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    args = ["--model", str(tiny_dir), "--speculative-config", json.dumps(SPEC), "--max-num-seqs", "4",
            "--kv-cache-memory-bytes", "256M", "--max-waiting", str(MAX_WAITING), "--max-context", str(MAX_CONTEXT),
            "--dtype", "fp64", "--served-model-name", MODEL, "--threads", "1", "--log-level", "warning"]
    with serving(args, tmp_path_factory.mktemp("server") / "server.log") as base:
        yield base


# ---- helpers ---------------------------------------------------------------------------------------------------


def post(url: str, path: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60, **kw)


def complete(url: str, **body: Any) -> dict[str, Any]:
    r = post(url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def chat(url: str, **body: Any) -> dict[str, Any]:
    r = post(url, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def stream(url: str, path: str, **body: Any) -> list[dict[str, Any]]:
    """Every chunk of a streamed request; asserts the SSE framing and the final [DONE]."""
    chunks, done = [], False
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            assert not done, "data after [DONE]"
            if line == "data: [DONE]":
                done = True
            else:
                chunks.append(json.loads(line[len("data: "):]))
    assert done and chunks
    return chunks


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """/metrics as {(sample name, labels without model_name): value}."""
    r = httpx.get(url + "/metrics", timeout=10)
    assert r.status_code == 200
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            labels = {k: v for k, v in s.labels.items() if k != "model_name"}
            out[(s.name, frozenset(labels.items()))] = s.value
    return out


def metric(m: dict, name: str, **labels: str) -> float:
    return m.get((name, frozenset(labels.items())), 0.0)


def wait_idle(url: str, timeout: float = 20) -> dict:
    """Metrics once no request runs or waits (requests aborted by earlier tests may still be winding down)."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        if metric(m, "specair:num_requests_running") == 0 and metric(m, "specair:num_requests_waiting") == 0:
            return m
        assert time.monotonic() < deadline, "the server did not go idle"
        time.sleep(0.05)


def wait_for(url: str, cond: Any, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while not cond(m := scrape(url)):
        assert time.monotonic() < deadline, "timed out waiting on the metrics"
        time.sleep(0.02)
    return m


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert isinstance(body["error"]["type"], str) and body["error"]["type"]
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


GREEDY = {"temperature": 0, "ignore_eos": True}


# ---- tests -----------------------------------------------------------------------------------------------------


def test_models_health_and_metric_names(url: str) -> None:
    assert httpx.get(url + "/health").status_code == 200
    models = httpx.get(url + "/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == MAX_CONTEXT
    m = scrape(url)
    names = {name for name, _ in m}
    for counter in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
                    "prompt_tokens", "generation_tokens", "request_success", "batch_bucket_steps",
                    "prefix_cache_queries", "prefix_cache_hits"):
        assert f"specair:{counter}_total" in names, counter
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert f"specair:{hist}_count" in names, hist
    assert {"specair:num_requests_running", "specair:num_requests_waiting", "specair:kv_cache_bytes",
            "specair:kv_cache_usage_perc"} <= names
    assert 0 <= metric(m, "specair:kv_cache_usage_perc") <= 1
    # The KV gauge reads the caches' resident memory: some while a request decodes, none once it is gone.
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": "Hold on", "max_tokens": 200,
                                                              "ignore_eos": True, "stream": True}, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        m = scrape(url)
        assert metric(m, "specair:kv_cache_bytes") > 0 and 0 < metric(m, "specair:kv_cache_usage_perc") <= 1
    wait_for(url, lambda m: metric(m, "specair:num_requests_running") == 0)
    assert metric(scrape(url), "specair:kv_cache_bytes") == 0
    positions = {dict(lab)["position"] for name, lab in m if name == "specair:spec_decode_num_accepted_tokens_per_pos_total"}
    assert positions == {"0", "1", "2"}
    buckets = {dict(lab)["bucket"] for name, lab in m if name == "specair:batch_bucket_steps_total"}
    assert buckets == {"1", "2", "4"}


def test_streamed_equals_non_streamed(url: str) -> None:
    body = {"prompt": "The quick brown fox", "max_tokens": 24, **GREEDY}
    whole = complete(url, **body)
    assert whole["object"] == "text_completion" and whole["model"] == MODEL
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "length" and choice["text"]
    assert whole["usage"]["completion_tokens"] == 24
    assert whole["usage"]["total_tokens"] == whole["usage"]["prompt_tokens"] + 24
    assert whole["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # eager graphs keep no prefix cache
    spec = whole["spec_decode"]
    assert spec["num_draft_tokens"] == 3 * spec["num_drafts"] > 0
    assert sum(spec["accepted_per_position"]) == spec["num_accepted_tokens"]

    chunks = stream(url, "/v1/completions", **body, stream_options={"include_usage": True})
    assert {c["id"] for c in chunks} == {chunks[0]["id"]} and all(c["object"] == "text_completion" for c in chunks)
    *text_chunks, usage_chunk = chunks
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == choice["text"]
    assert [c["choices"][0]["finish_reason"] for c in text_chunks] == [None] * (len(text_chunks) - 1) + ["length"]
    assert text_chunks[-1]["spec_decode"] == spec  # greedy and alone: the same speculation, step for step

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    reply = chat(url, messages=messages, max_completion_tokens=20, **GREEDY)
    assert reply["object"] == "chat.completion"
    assert reply["choices"][0]["message"]["role"] == "assistant" and reply["choices"][0]["message"]["content"]
    chunks = stream(url, "/v1/chat/completions", messages=messages, max_completion_tokens=20, **GREEDY)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == \
        reply["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["spec_decode"] == reply["spec_decode"]
    # The server applies the chat template: the prompt is longer than the two messages' words.
    assert reply["usage"]["prompt_tokens"] > 10


def test_concurrent_requests_match_solo_runs_and_use_every_bucket(url: str) -> None:
    # Five requests, so one waits for a slot; requests join one per step (one prefill chunk each) and finish at
    # different lengths, so the batch passes through 1, 2, then 3-4 rows and back; two sample (seeded) beside
    # three greedy ones, so the batch mixes sampling graphs.
    requests = [
        ("/v1/completions", {"prompt": "One two three", "max_tokens": 2, **GREEDY}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 18,
                                  "temperature": 0.9, "top_k": 40, "seed": 3, "ignore_eos": True}),
        ("/v1/completions", {"prompt": [17, 4, 99, 1000, 5], "max_tokens": 10, **GREEDY}),
        ("/v1/completions", {"prompt": "Once upon a time, in a land far away,", "max_tokens": 26,
                             "temperature": 0.7, "top_p": 0.9, "seed": 11, "ignore_eos": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Count to ten."}], "max_tokens": 34,
                                  **GREEDY}),
    ]
    greedy = [i for i, (_, body) in enumerate(requests) if body["temperature"] == 0]
    before = wait_idle(url)
    solo = {i: post(url, *requests[i]).json() for i in greedy}
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(lambda pb: post(url, *pb), requests))
    after = wait_idle(url)
    for (path, body), r in zip(requests, together):
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == body["max_tokens"]
    for i in greedy:
        got, alone = together[i].json(), solo[i]
        assert got["usage"] == alone["usage"]
        assert got["choices"][0] == alone["choices"][0], requests[i]  # the same text, the same finish
    for bucket in ("1", "2", "4"):
        steps = metric(after, "specair:batch_bucket_steps_total", bucket=bucket) - \
            metric(before, "specair:batch_bucket_steps_total", bucket=bucket)
        assert steps > 0, f"batch bucket {bucket} never ran"


def test_metrics_agree_with_responses(url: str) -> None:
    before = wait_idle(url)
    bodies = [{"prompt": "Metrics are counted", "max_tokens": 15, **GREEDY},
              {"prompt": "per request", "max_tokens": 9, "temperature": 1.0, "seed": 5, "ignore_eos": True},
              {"prompt": "Stop early", "max_tokens": 12, "temperature": 0}]
    with ThreadPoolExecutor(3) as pool:
        responses = list(pool.map(lambda b: complete(url, **b), bodies))
    chunks = stream(url, "/v1/completions", prompt="and streamed", max_tokens=11, stream_options={"include_usage": True},
                    **GREEDY)
    responses.append({"spec_decode": chunks[-2]["spec_decode"], "usage": chunks[-1]["usage"],
                      "choices": chunks[-2]["choices"]})
    after = wait_idle(url)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    specs = [r["spec_decode"] for r in responses]
    assert delta("specair:spec_decode_num_drafts_total") == sum(s["num_drafts"] for s in specs) > 0
    assert delta("specair:spec_decode_num_draft_tokens_total") == sum(s["num_draft_tokens"] for s in specs)
    assert delta("specair:spec_decode_num_accepted_tokens_total") == sum(s["num_accepted_tokens"] for s in specs)
    for pos in range(3):
        assert delta("specair:spec_decode_num_accepted_tokens_per_pos_total", position=str(pos)) == \
            sum(s["accepted_per_position"][pos] for s in specs)
    assert delta("specair:generation_tokens_total") == sum(r["usage"]["completion_tokens"] for r in responses)
    assert delta("specair:prompt_tokens_total") == sum(r["usage"]["prompt_tokens"] for r in responses)
    reasons = [r["choices"][0]["finish_reason"] for r in responses]
    for reason in ("stop", "length"):
        assert delta("specair:request_success_total", finished_reason=reason) == reasons.count(reason)
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert delta(f"specair:{hist}_count") == len(responses)
    # One inter-token interval per streamed output after the first; every request had more than one.
    assert delta("specair:inter_token_latency_seconds_count") >= len(responses)


BAD_REQUESTS = [
    # (path, body (bytes are sent raw), status, param)
    ("/v1/completions", b'{"prompt": "unterminated', 400, None),
    ("/v1/completions", b'["not", "an", "object"]', 400, None),
    ("/v1/completions", {"prompt": "hi", "max_tokenz": 5}, 400, "max_tokenz"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 2}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, 400, "logprobs"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["two", "prompts"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": MAX_CONTEXT}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": list(range(MAX_CONTEXT))}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 49152]}, 400, None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": 3.861078197945001e+307}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": 1e-300}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "stop": ["ok", ""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": None}, {"role": "user", "content": "hi"}]},
     400, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": ["hi"]}]}, 400, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", b"", 400, None),
    ("/v1/completions", b"", 400, None),
    ("/v1/chat/completions", b"{}", 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**6},
     400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "nope"}, 404, "model"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS,
                         ids=[f"{p.rsplit('/', 1)[1]}-{i}" for i, (p, *_) in enumerate(BAD_REQUESTS)])
def test_bad_input_gets_openai_error_and_server_keeps_serving(url: str, path: str, body: Any, status: int,
                                                              param: str | None) -> None:
    if isinstance(body, bytes):
        r = httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    else:
        r = post(url, path, body)
    err = assert_openai_error(r, status, param)
    assert "'None'" not in err["message"] and (param is None or param.rsplit(".", 1)[-1] in err["message"]), err
    assert complete(url, prompt="still here", max_tokens=2)["usage"]["completion_tokens"] >= 1


def test_openai_options_at_their_no_op_values_are_accepted(url: str) -> None:
    noop = {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "logprobs": None, "user": "me"}
    assert complete(url, prompt="hi", max_tokens=2, echo=False, best_of=1, **noop)["usage"]["completion_tokens"] == 2
    reply = chat(url, messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}], max_tokens=2,
                 top_logprobs=0, response_format={"type": "text"}, **noop)
    assert reply["usage"]["completion_tokens"] == 2


def test_unknown_path_and_non_json_body(url: str) -> None:
    assert_openai_error(httpx.get(url + "/v1/nothing"), 404)
    err = assert_openai_error(httpx.post(url + "/v1/completions", content=b'{"prompt": "hi"}',
                                         headers={"content-type": "text/plain"}), 400)
    assert "application/json" in err["message"]


def _open_stream(client: httpx.Client, max_tokens: int) -> httpx.Response:
    req = client.build_request("POST", "/v1/completions", json={
        "prompt": "a long answer", "max_tokens": max_tokens, "stream": True, **GREEDY})
    r = client.send(req, stream=True)
    assert r.status_code == 200, r.read()
    return r


def test_full_queue_gives_429_and_disconnects_free_their_slots(url: str) -> None:
    before = wait_idle(url)
    long = MAX_CONTEXT - 8
    clients = [httpx.Client(base_url=url, timeout=60) for _ in range(SLOTS + MAX_WAITING)]
    try:
        running = [_open_stream(c, long) for c in clients[:SLOTS]]
        # Read a first token (the request holds a slot), keeping each line iterator alive: a discarded one
        # closes its connection.
        lines = [r.iter_lines() for r in running]
        for it in lines:
            assert next(it).startswith("data: ")
        waiting = [_open_stream(c, long) for c in clients[SLOTS:]]  # admitted (200) into the queue
        m = scrape(url)
        assert metric(m, "specair:num_requests_running") == SLOTS
        assert metric(m, "specair:num_requests_waiting") == MAX_WAITING
        err = assert_openai_error(post(url, "/v1/completions", {"prompt": "one too many", "max_tokens": 2}), 429)
        assert err["code"] == "queue_full"
        err = assert_openai_error(post(url, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "me too"}], "max_tokens": 2}), 429)
        # Leave the queue first, so no freed slot admits (and prefills) a queued request before it goes.
        for r in waiting:
            r.close()
        wait_for(url, lambda m: metric(m, "specair:num_requests_waiting") == 0)
        for r in running:
            r.close()
    finally:
        for c in clients:
            c.close()
    # Every dropped stream is aborted: the slots free long before the 504-token answers could have finished.
    after = wait_idle(url, timeout=10)
    aborted = metric(after, "specair:request_success_total", finished_reason="abort") - \
        metric(before, "specair:request_success_total", finished_reason="abort")
    assert aborted == SLOTS + MAX_WAITING
    again = complete(url, prompt="a long answer", max_tokens=3)
    assert again["usage"]["completion_tokens"] == 3
    # Prompt tokens count once prefilled: the running requests' prompts, not those aborted in the queue.
    assert metric(after, "specair:prompt_tokens_total") - metric(before, "specair:prompt_tokens_total") == \
        SLOTS * again["usage"]["prompt_tokens"]


def test_client_leaving_before_a_non_streamed_answer_aborts_it(url: str) -> None:
    before = wait_idle(url)
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "never read", "max_tokens": MAX_CONTEXT - 8, **GREEDY}).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_for(url, lambda m: metric(m, "specair:num_requests_running") == 1)
    after = wait_idle(url, timeout=10)
    assert metric(after, "specair:request_success_total", finished_reason="abort") - \
        metric(before, "specair:request_success_total", finished_reason="abort") == 1


# ---- engine failures (in-process: the only way to make a healthy engine fail on cue) ---------------------------

POISON_SEED = 666  # a request with this seed makes the wrapped engine's next step fail, naming that request
EXPLODE_SEED = 667  # a request with this seed breaks inside the engine, in its own text assembly


class EngineFault(RuntimeError):
    def __init__(self, request_id: str | None = None) -> None:
        super().__init__(f"injected fault ({request_id or 'no request named'})")
        if request_id is not None:
            self.request_id = request_id


class FaultyEngine:
    """The real engine, whose `step()` raises on cue before doing any work (so the engine's own state stays
    sound): once for a request added with POISON_SEED, and `fail_steps` times when set."""

    def __init__(self, engine: Any) -> None:
        self._engine, self.poisoned, self.fail_steps = engine, None, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def add_request(self, prompt_ids: Any, params: Any, request_id: str | None = None) -> str:
        rid = self._engine.add_request(prompt_ids, params, request_id)
        if params.seed == POISON_SEED:
            self.poisoned = rid
        if params.seed == EXPLODE_SEED:
            from test_engine import Exploding

            with self._engine.sched._lock:
                next(s for s in self._engine.sched._inbox if s.request_id == rid).text = Exploding(3)
        return rid

    def step(self) -> list:
        if self.poisoned is not None:
            rid, self.poisoned = self.poisoned, None
            raise EngineFault(rid)
        if self.fail_steps:
            self.fail_steps -= 1
            raise EngineFault()
        return self._engine.step()


@pytest.fixture(scope="module")
def faulty(tiny_dir: Path) -> Any:
    import threading

    import uvicorn

    from specair.runtime.llm import LLM
    from specair.runtime.server import build_app

    engine = FaultyEngine(LLM(str(tiny_dir), SPEC, dtype="fp64", max_context=128, batch_buckets=(1, 2)).engine)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, batch_buckets=(1, 2)), host="127.0.0.1", port=port,
                                           log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    wait_for_health = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < wait_for_health and thread.is_alive(), "in-process server did not start"
        time.sleep(0.05)
    yield base, engine
    server.should_exit = True
    thread.join(15)


def test_engine_error_fails_its_request_only_and_serving_goes_on(faulty: Any) -> None:
    url, engine = faulty
    body = {"prompt": "A survivor", "max_tokens": 48, **GREEDY}
    alone = complete(url, **body)
    with ThreadPoolExecutor(1) as pool:
        survivor = pool.submit(complete, url, **body)
        wait_for(url, lambda m: metric(m, "specair:num_requests_running") == 1)  # in flight before the poison
        r = post(url, "/v1/completions", {"prompt": "poison", "max_tokens": 24, "temperature": 1.0,
                                          "seed": POISON_SEED})
        err = assert_openai_error(r, 500)
        assert err["code"] == "engine_error" and err["type"] == "server_error"
        assert survivor.result()["choices"] == alone["choices"]

    # A failure that names no request fails every request in flight (here a stream: the error comes in-band).
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        engine.fail_steps = 1
        rest = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert "error" in rest[-1] and rest[-1]["error"]["code"] == "engine_error"
    assert complete(url, **body)["choices"] == alone["choices"]
    assert scrape(url)[("specair:request_failure_total", frozenset())] == 2


def test_a_request_that_breaks_in_the_engine_fails_alone(faulty: Any) -> None:
    """The engine names the sequence that raised: its request gets a 500, the one decoding beside it in the
    same steps is unharmed and equal to its solo run."""
    url, _ = faulty
    body = {"prompt": "A survivor", "max_tokens": 48, **GREEDY}
    alone = complete(url, **body)
    failures = metric(scrape(url), "specair:request_failure_total")
    with ThreadPoolExecutor(1) as pool:
        survivor = pool.submit(complete, url, **body)
        wait_for(url, lambda m: metric(m, "specair:num_requests_running") == 1)
        err = assert_openai_error(post(url, "/v1/completions", {"prompt": "explode", "max_tokens": 24, **GREEDY,
                                                                 "seed": EXPLODE_SEED}), 500)
        assert err["code"] == "engine_error" and "broken on purpose" in err["message"]
        assert survivor.result()["choices"] == alone["choices"]
    assert metric(scrape(url), "specair:request_failure_total") == failures + 1


def test_engine_failing_step_after_step_is_declared_dead(faulty: Any) -> None:
    url, engine = faulty
    engine.fail_steps = 10
    r = post(url, "/v1/completions", {"prompt": "doomed", "max_tokens": 5})
    assert r.status_code in (500, 503)  # failed with the first step, or refused once the engine was dead
    deadline = time.monotonic() + 10
    while httpx.get(url + "/health").status_code == 200:
        assert time.monotonic() < deadline, "the engine was not declared dead"
        time.sleep(0.05)
    assert_openai_error(httpx.get(url + "/health"), 503)
    assert assert_openai_error(post(url, "/v1/completions", {"prompt": "anyone?", "max_tokens": 2}), 503)["code"] \
        == "engine_dead"


def test_serving_limits_are_checked_before_loading(tiny_dir: Path) -> None:
    """--max-num-seqs must agree with --batch-buckets, and a KV budget is a size: each refused with a message,
    exit code 2, before any model loads."""
    def serve(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "specair.runtime.cli", "serve", "--model", str(tiny_dir), *args],
                              capture_output=True, text=True, timeout=120)

    r = serve("--max-num-seqs", "4", "--batch-buckets", "1,2,8")
    assert r.returncode == 2 and "--max-num-seqs 4 disagrees with --batch-buckets 1,2,8" in r.stderr
    r = serve("--kv-cache-memory-bytes", "lots")
    assert r.returncode == 2 and "expected a positive size such as 4G" in r.stderr


def test_serve_defaults_to_the_compiled_path(tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`specair serve` with no flags serves the compiled path (`--backend auto`: onnxruntime, built once into
    the cache for the server's batch buckets), batching concurrent requests, with eager decoding's greedy
    tokens; a second start loads the cached build instead of compiling it again."""
    from specair.runtime.llm import LLM

    monkeypatch.setenv("SPECAIR_CACHE", str(tmp_path / "cache"))
    prompts = ["The capital of France is", "Once upon a time", "def fib(n):", "Rivers of Europe:"]
    eager = LLM(str(tiny_dir), backend="eager", max_context=128)
    want = [r.text for r in eager.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))]
    for start in ("first", "second"):
        log = tmp_path / f"{start}.log"
        with serving(["--model", str(tiny_dir), "--max-context", "128", "--threads", "1"], log) as base:
            with ThreadPoolExecutor(len(prompts)) as pool:
                outs = list(pool.map(lambda p: complete(base, prompt=p, max_tokens=12, temperature=0,
                                                        ignore_eos=True), prompts))
        assert [o["choices"][0]["text"] for o in outs] == want, start
        built = "compiling" in log.read_text()
        assert built == (start == "first"), log.read_text()
    (art,) = (tmp_path / "cache" / "artifacts").iterdir()
    assert art.name.startswith("onnx-")


def test_a_repeated_prompt_reports_its_cached_tokens(tiny_dir: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """On the exact int4 path the server keeps prompts' KV: a repeated prompt gets the same text, and its usage
    and the prefix-cache counters report the prompt tokens that came from the cache (whole 16-token blocks)."""
    monkeypatch.setenv("SPECAIR_CACHE", str(tmp_path / "cache"))
    args = ["--model", str(tiny_dir), "--quantize", "int4", "--speculative-config", "none", "--batch-buckets", "1",
            "--max-context", "128", "--threads", "1", "--log-level", "warning"]
    body = {"prompt": list(range(5, 45)), "max_tokens": 8, **GREEDY}
    with serving(args, tmp_path / "server.log") as base:
        first, again = complete(base, **body), complete(base, **body)
        m = scrape(base)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert metric(m, "specair:prefix_cache_queries_total") == 80 and metric(m, "specair:prefix_cache_hits_total") == 32


def test_soak_against_a_real_server(tiny_dir: Path, tmp_path: Path) -> None:
    """`specair soak` on a real `specair serve` (eager, two clients, a few seconds): every chat answered under load
    matches its solo run, malformed bodies get 4xx, the tokens counted are the chats' own usage, and the report
    is written; `--server llama.cpp` refuses specair serve's options by name."""
    out = tmp_path / "soak"
    r = subprocess.run([sys.executable, "-m", "specair.runtime.cli", "soak", "--model", str(tiny_dir),
                        "--backend", "eager", "--max-context", "256", "--threads", "1", "--clients", "2",
                        "--minutes", "0.15", "--no-fuzz", "--num-prompts", "2", "--max-tokens", "8", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads((out / "results.json").read_text())
    req = report["requests"]
    chats = req.get("greedy", 0) + req.get("seeded", 0)
    assert chats > 0 and report["server_alive"] and report["hung_clients"] == 0, report
    assert not any(k.endswith(("_failed", "_mismatch")) or k == "5xx" for k in req), report["problems"]
    assert 0 < report["generated_tokens"] <= 8 * chats
    assert (out / "results.md").read_text().startswith("# specair soak (specair)")
    r = subprocess.run([sys.executable, "-m", "specair.runtime.cli", "soak", "--server", "llama.cpp", "--backend",
                        "eager", "--out", str(tmp_path / "llama")], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--backend are specair serve's options" in r.stderr
