"""`specair soak`: a real `specair serve` under N concurrent clients for M minutes.

    specair soak [--clients 16] [--minutes 10] [--speculative-config JSON] [--max-context N]
                 [--batch-buckets 1,2,4,8] [--backend NAME] [--no-fuzz] [--out DIR]
    specair soak --server llama.cpp [--gguf FILE] ...

Serving options left out are `specair serve`'s defaults. `--server llama.cpp` soaks llama.cpp's OpenAI
server (`python -m llama_cpp.server`, from llama-cpp-python) on the default model's GGUF instead, with the same
clients, prompts and fuzzing: the server-to-server comparison. It answers one request at a time (its lock);
it is started with `--interrupt_requests False` so that a new request waits instead of cutting a stream short.
Its streams carry no `usage`; each of their chunks is one token, so the soak counts chunks there.

Before the load, every prompt of a fixed pool runs alone, greedy and seeded (temperature 0.8, top-p 0.95),
through the same server: those are the references. Then each client loops, choosing at random:
- a greedy streamed chat, compared token for token with its solo run;
- a seeded sampled chat (streamed or not), compared likewise;
- an abort: a stream it drops after its first chunks;
- a malformed body (a hand-written list), which must get a 4xx in OpenAI's shape.
Beside them, schemathesis fuzzes the server's own OpenAPI schema (`/openapi.json`) for the whole run, checking
that no response is a 5xx. A sampler records the server's resident memory every 2 s.

The report (`results.json`, `results.md`, `memory.png`): requests by kind, failures, mismatches against the
solo runs, 5xx, hung clients (a request open longer than --hang-s), p50/p99 latency, the tokens the chats
generated under load (their `usage`) per second, schemathesis' verdict, and the memory series (idle, peak,
after the first minute).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specair.benchmarks.run import DEFAULT_PROMPTS, load_prompt_set

# Bodies a client must be refused with a 4xx (raw bytes are sent as they are).
MALFORMED: list[tuple[str, Any]] = [
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": ["hi"]}]}),
    ("/v1/chat/completions", {"messages": "hi"}),
    ("/v1/chat/completions", b""),
    ("/v1/chat/completions", b"{\"messages\": ["),
    ("/v1/completions", b"[1, 2]"),
    ("/v1/completions", {}),
    ("/v1/completions", {"prompt": ""}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}),
    ("/v1/completions", {"prompt": "hi", "n": 3}),
    ("/v1/completions", {"prompt": [1, 2, 10 ** 9]}),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 3}}),
    ("/v1/completions", {"prompt": "hi", "model": "not-this-one"}),
]
SEEDED = {"temperature": 0.8, "top_p": 0.95}

if TYPE_CHECKING:
    import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mb(pid: int) -> float:
    """Resident memory of a process and its children (tensor-parallel workers), in MB."""
    total, pids = 0.0, [pid]
    while pids:
        p = pids.pop()
        try:
            for line in open(f"/proc/{p}/status"):
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
            for t in os.listdir(f"/proc/{p}/task"):
                pids += [int(c) for c in open(f"/proc/{p}/task/{t}/children").read().split()]
        except OSError:
            continue
    return total


class Soak:
    def __init__(self, args: argparse.Namespace, url: str) -> None:
        self.args, self.url = args, url
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.latency: list[float] = []
        self.generated = 0  # completion tokens of the greedy and seeded chats answered under load
        self.problems: list[str] = []
        self.open: dict[int, float] = {}  # client -> start of its request in flight
        self.hung: set[int] = set()
        self.solo: dict[tuple[str, int], list[int] | str] = {}
        self.pool = [r["messages"] for r in load_prompt_set(args.prompts)][:args.num_prompts]

    # ---- one request of each kind -------------------------------------------------------------------------

    def body(self, i: int, seeded: bool, stream: bool) -> dict[str, Any]:
        extra = {**SEEDED, "seed": 1000 + i} if seeded else {"temperature": 0}
        usage = {"stream_options": {"include_usage": True}} if stream else {}
        return {"messages": self.pool[i], "max_tokens": self.args.max_tokens, "stream": stream, **extra, **usage}

    def chat(self, client: httpx.Client, body: dict[str, Any]) -> tuple[int, str, int]:
        """(status, text, generated tokens) of a chat request, streamed or not (a 5xx mid-stream counts as its
        status)."""
        if not body["stream"]:
            r = client.post("/v1/chat/completions", json=body)
            if r.status_code != 200:
                return r.status_code, r.text, 0
            answer = r.json()
            return 200, answer["choices"][0]["message"]["content"], answer["usage"]["completion_tokens"]
        text, tokens, chunks, usage = "", 0, 0, False
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                return r.status_code, r.text, 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return 500, json.dumps(chunk["error"]), 0
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                        usage = True
                    if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                        text += chunk["choices"][0]["delta"]["content"]
                        chunks += 1
        return 200, text, tokens if usage else chunks

    def references(self) -> None:
        import httpx

        with httpx.Client(base_url=self.url, timeout=self.args.hang_s) as c:
            for i in range(len(self.pool)):
                for seeded in (False, True):
                    status, text, _ = self.chat(c, self.body(i, seeded, stream=False))
                    if status != 200:
                        raise SystemExit(f"solo run of prompt {i} failed: {status} {text[:200]}")
                    self.solo["seeded" if seeded else "greedy", i] = text

    def one(self, client: httpx.Client, rng: random.Random) -> None:
        kind = rng.choices(["greedy", "seeded", "abort", "malformed"], weights=[4, 4, 1, 1])[0]
        i = rng.randrange(len(self.pool))
        t0 = time.perf_counter()
        if kind == "malformed":
            path, body = rng.choice(MALFORMED)
            r = (client.post(path, content=body, headers={"content-type": "application/json"})
                 if isinstance(body, bytes) else client.post(path, json=body))
            ok = 400 <= r.status_code < 500 and set(r.json()) == {"error"}
            self.note(kind, r.status_code, ok, f"{path} {body!r:.80} answered {r.status_code}")
        elif kind == "abort":
            with client.stream("POST", "/v1/chat/completions", json=self.body(i, rng.random() < 0.5, True)) as r:
                for n, _ in enumerate(r.iter_lines()):
                    if n >= 3:
                        break
            self.note(kind, r.status_code, r.status_code == 200, f"abort answered {r.status_code}")
        else:
            status, text, tokens = self.chat(client, self.body(i, kind == "seeded", stream=rng.random() < 0.7))
            with self.lock:
                self.generated += tokens
            same = status == 200 and text == self.solo[kind, i]
            self.note(kind, status, status == 200, f"{kind} prompt {i}: {status} {text[:120]!r}")
            if status == 200 and not same:
                self.note(f"{kind}_mismatch", 0, False, f"{kind} prompt {i} differs from its solo run")
        with self.lock:
            self.latency.append(time.perf_counter() - t0)

    def note(self, kind: str, status: int, ok: bool, what: str) -> None:
        with self.lock:
            self.counts[kind] += 1
            if status >= 500:
                self.counts["5xx"] += 1
            if not ok:
                self.counts[f"{kind}_failed"] += 1
                if len(self.problems) < 50:
                    self.problems.append(what)

    def client(self, n: int, until: float) -> None:
        import httpx

        rng = random.Random(n)
        with httpx.Client(base_url=self.url, timeout=self.args.hang_s) as c:
            while time.monotonic() < until:
                self.open[n] = time.monotonic()
                try:
                    self.one(c, rng)
                except httpx.TimeoutException:
                    self.hung.add(n)
                    self.note("timeout", 0, False, f"client {n}: no answer within {self.args.hang_s} s")
                except httpx.TransportError as e:
                    self.note("transport", 0, False, f"client {n}: {e!r}")
                self.open.pop(n, None)


def _fuzz(url: str, out: Path, seconds: float, timeout: float) -> subprocess.Popen | None:
    """schemathesis on the server's own schema for `seconds`; a slow answer under load is not a failure, a
    5xx is."""
    here = Path(sys.executable).parent / "st"  # the virtualenv's, when its bin is not on PATH
    st = str(here) if here.exists() else shutil.which("st")
    if st is None:
        return None
    log = open(out / "schemathesis.log", "w")
    return subprocess.Popen([st, "run", f"{url}/openapi.json", "--checks", "not_a_server_error",
                             "--max-time", str(int(seconds)), "--workers", "1", "--max-examples", "100000",
                             "--request-timeout", str(int(timeout)), "--report", "ndjson",
                             "--report-ndjson-path", str(out / "schemathesis.ndjson")],
                            stdout=log, stderr=subprocess.STDOUT)


def _fuzz_verdict(rc: int | None, cut: bool, log: Path) -> dict[str, Any]:
    """schemathesis' exit code (0: no check failed), whether the soak had to interrupt it, and the responses
    its event stream recorded (written as they come, so an interrupted run's count too) with how many were 5xx."""
    events = log.with_suffix(".ndjson")
    text = events.read_text(errors="replace") if events.exists() else ""
    codes = [int(c) for c in re.findall(r'"status_code":\s*(\d{3})', text)]
    return {"exit_code": rc, "interrupted": cut, "responses": len(codes), "5xx": sum(c >= 500 for c in codes),
            "server_error_in_log": "Server error" in log.read_text(errors="replace"), "log": str(log)}


def _server_command(args: argparse.Namespace, port: int) -> tuple[list[str], str]:
    """The server's command line and the path that answers 200 once it is ready."""
    if args.server == "specair":
        cmd = [sys.executable, "-m", "specair.runtime.server", "--port", str(port), "--log-level", "warning"]
        for flag, value in (("--model", args.model), ("--speculative-config", args.speculative_config),
                            ("--backend", args.backend), ("--max-context", args.max_context),
                            ("--batch-buckets", args.batch_buckets), ("--threads", args.threads),
                            ("--artifacts", args.artifacts)):
            if value:
                cmd += [flag, str(value)]
        return cmd, "/health"
    given = [f for f, v in (("--model", args.model), ("--speculative-config", args.speculative_config),
                            ("--backend", args.backend), ("--batch-buckets", args.batch_buckets),
                            ("--artifacts", args.artifacts)) if v]
    if given:
        raise SystemExit(f"--server llama.cpp serves --gguf; {', '.join(given)} are specair serve's options")
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        raise SystemExit("llama.cpp's server needs llama-cpp-python: pip install 'llama-cpp-python[server]==0.3.36' "
                         "(it compiles llama.cpp, ~7 minutes on 2 cores)")
    if args.gguf is None:
        from specair.models.default_model import default_gguf_path

        args.gguf = str(default_gguf_path())
    threads = str(args.threads or os.cpu_count() or 1)
    return [sys.executable, "-m", "llama_cpp.server", "--model", args.gguf, "--host", "127.0.0.1",
            "--port", str(port), "--n_ctx", str(args.max_context or 2048), "--n_threads", threads,
            "--n_threads_batch", threads, "--interrupt_requests", "False", "--verbose", "False"], "/v1/models"


def run_soak(args: argparse.Namespace) -> dict[str, Any]:
    import httpx  # the dev extra's client; only the soak needs it

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    cmd, ready = _server_command(args, port)
    server = subprocess.Popen(cmd, stdout=open(out / "server.log", "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    memory: list[tuple[float, float]] = []
    try:
        while True:
            if server.poll() is not None:
                raise SystemExit(f"the server exited ({server.returncode}); see {out / 'server.log'}")
            try:
                if httpx.get(f"{url}{ready}").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        soak = Soak(args, url)
        print(f"soak: solo runs of {len(soak.pool)} prompts (greedy and seeded)", file=sys.stderr, flush=True)
        soak.references()
        idle = _rss_mb(server.pid)
        t0 = time.monotonic()
        until = t0 + args.minutes * 60
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(2):
                memory.append((time.monotonic() - t0, _rss_mb(server.pid)))
                now = time.monotonic()
                for n, since in list(soak.open.items()):
                    if now - since > args.hang_s:
                        soak.hung.add(n)

        threading.Thread(target=sample, daemon=True).start()
        fuzz = _fuzz(url, out, max(args.minutes * 60 - 60, 30), args.hang_s) if args.fuzz else None
        clients = [threading.Thread(target=soak.client, args=(n, until)) for n in range(args.clients)]
        print(f"soak: {args.clients} clients for {args.minutes} min", file=sys.stderr, flush=True)
        for c in clients:
            c.start()
        for c in clients:
            c.join()
        load_s = time.monotonic() - t0
        fuzz_rc, fuzz_cut = None, False
        if fuzz is not None:
            # A fuzzed request may still be generating; an interrupted schemathesis still reports what it found.
            for sig, wait in ((None, 60), (signal.SIGINT, 60), (signal.SIGKILL, 10)):
                if sig is not None:
                    fuzz.send_signal(sig)
                    fuzz_cut = True
                try:
                    fuzz_rc = fuzz.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    pass
        stop.set()
        alive = server.poll() is None and httpx.get(f"{url}{ready}").status_code == 200
    finally:
        server.terminate()
        server.wait(30)
    lat = sorted(soak.latency)
    after_first = [m for t, m in memory if t >= 60] or [m for _, m in memory]
    report = {
        "command": " ".join(sys.argv), "server": args.server, "clients": args.clients, "minutes": args.minutes,
        "speculative_config": args.speculative_config, "max_context": args.max_context,
        "batch_buckets": args.batch_buckets, "backend": args.backend,
        "requests": dict(soak.counts), "hung_clients": len(soak.hung), "server_alive": alive,
        "generated_tokens": soak.generated, "generated_tokens_per_s": soak.generated / load_s,
        "latency_s": {"p50": lat[len(lat) // 2] if lat else None,
                      "p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else None},
        "schemathesis": None if not args.fuzz else ("not installed" if fuzz is None else _fuzz_verdict(
            fuzz_rc, fuzz_cut, out / "schemathesis.log")),
        "memory_mb": {"idle": idle, "peak": max((m for _, m in memory), default=idle),
                      "after_first_minute": [min(after_first, default=idle), max(after_first, default=idle)],
                      "series": memory},
        "problems": soak.problems,
    }
    (out / "results.json").write_text(json.dumps(report, indent=1))
    _plot(memory, idle, out / "memory.png")
    return report


def _plot(memory: list[tuple[float, float]], idle: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot([t / 60 for t, _ in memory], [m for _, m in memory], label="server RSS")
    ax.axhline(idle, color="grey", ls="--", label="idle")
    ax.set_xlabel("minutes")
    ax.set_ylabel("MB")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summary(report: dict[str, Any]) -> str:
    req, mem = report["requests"], report["memory_mb"]
    kinds = ("greedy", "seeded", "abort", "malformed")
    lines = [f"| {k} | {req.get(k, 0)} | {req.get(f'{k}_failed', 0)} | {req.get(f'{k}_mismatch', 0)} |" for k in kinds]
    return "\n".join([
        "| kind | requests | failed | mismatches against solo |", "|---|---|---|---|", *lines, "",
        f"5xx: {req.get('5xx', 0)}; hung clients: {report['hung_clients']}; server alive: {report['server_alive']}; "
        f"latency p50 {report['latency_s']['p50']:.2f} s, p99 {report['latency_s']['p99']:.2f} s; "
        f"{report['generated_tokens']} tokens generated under load, {report['generated_tokens_per_s']:.1f} tok/s",
        f"memory: idle {mem['idle']:.0f} MB, peak {mem['peak']:.0f} MB "
        f"(+{mem['peak'] - mem['idle']:.0f} MB), after the first minute {mem['after_first_minute'][0]:.0f}–"
        f"{mem['after_first_minute'][1]:.0f} MB",
        f"schemathesis: {report['schemathesis']}"])


def add_soak_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("soak", help="concurrent clients and fuzzed bodies against a real server",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--server", choices=["specair", "llama.cpp"], default="specair",
                   help="the server to soak: `specair serve`, or llama.cpp's OpenAI server on --gguf")
    p.add_argument("--gguf", metavar="FILE", help="llama.cpp's model (default: the default model's Q4_1 GGUF)")
    p.add_argument("--model")
    # Unset serving options are left to `specair serve`'s defaults, so a bare `specair soak` soaks a bare serve.
    p.add_argument("--speculative-config", metavar="JSON")
    p.add_argument("--backend")
    p.add_argument("--artifacts", metavar="DIR", help="serve from a `specair compile` directory (its plan and backend)")
    p.add_argument("--max-context", type=int)
    p.add_argument("--batch-buckets")
    p.add_argument("--threads", type=int)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS), metavar="FILE.jsonl")
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--hang-s", type=float, default=300, help="a request open longer than this is a hung client")
    p.add_argument("--no-fuzz", dest="fuzz", action="store_false", help="skip schemathesis")
    p.add_argument("--out", default="bench-out/soak", metavar="DIR")
    p.set_defaults(func=cmd_soak)


def cmd_soak(args: argparse.Namespace) -> None:
    report = run_soak(args)
    text = summary(report)
    (Path(args.out) / "results.md").write_text(f"# specair soak ({args.server})\n\n`{report['command']}`\n\n{text}\n")
    print(text)
