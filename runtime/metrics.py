"""Prometheus metrics of `specair serve`, named like vLLM's (`vllm:` becomes `specair:`).

Every metric carries a `model_name` label, as vLLM's do, so dashboards written for vLLM need only the prefix
changed. The metrics live in a registry of their own (never prometheus_client's global one), so several servers
or tests in one process do not collide.

Speculation counters follow vLLM's SpecDecodingProm: one draft per speculative step of a request; its proposed
tokens add to `num_draft_tokens`, its accepted ones to `num_accepted_tokens`, and accepted tokens occupy draft
positions 0..accepted-1 of `num_accepted_tokens_per_pos`. Useful PromQL:

    acceptance rate      rate(specair:spec_decode_num_accepted_tokens_total[1m])
                           / rate(specair:spec_decode_num_draft_tokens_total[1m])
    mean accepted length 1 + rate(specair:spec_decode_num_accepted_tokens_total[1m])
                               / rate(specair:spec_decode_num_drafts_total[1m])
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "specair:"

# Bucket edges from vLLM's PrometheusStatLogger, with finer low edges for the sub-millisecond steps of small
# models on CPU.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")


def one_two_five_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count histogram edges)."""
    edges, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return edges
            edges.append(m * scale)
        scale *= 10


@dataclass
class RequestClock:
    """Timestamps (time.perf_counter) of one request, for the latency histograms."""

    arrival: float
    num_prompt_tokens: int = 0
    first_token: float | None = None
    last_token: float | None = None


class ServerMetrics:
    """The server's metrics and the code that feeds them from engine events.

    `observe_event` and `observe_step` are called from the engine thread; prometheus_client's metrics are
    thread-safe, and scraping (`render`) may happen at any time from the HTTP side.
    """

    def __init__(self, model_name: str, batch_buckets: Sequence[int] = (), num_speculative_tokens: int = 0,
                 max_context: int = 8192, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        reg = self.registry

        def counter(name: str, doc: str, extra: Sequence[str] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels + list(extra), registry=reg)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=reg)

        # Scheduler state (read live from the engine at scrape time).
        self.num_requests_running = Gauge(PREFIX + "num_requests_running",
                                          "Number of requests holding a sequence slot.", labels, registry=reg)
        self.num_requests_waiting = Gauge(PREFIX + "num_requests_waiting",
                                          "Number of requests queued for a sequence slot.", labels, registry=reg)
        self.kv_cache_usage_perc = Gauge(PREFIX + "kv_cache_usage_perc",
                                         "Fraction of the KV cache memory held that running sequences' tokens use "
                                         "(1 = full).", labels, registry=reg)
        self.kv_cache_bytes = Gauge(PREFIX + "kv_cache_bytes", "Bytes the KV caches hold (every role, the prefill "
                                    "scratch included).", labels, registry=reg)

        # Token and request counters.
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.").labels(model_name)
        self.generation_tokens = counter("generation_tokens",
                                         "Number of generation tokens processed.").labels(model_name)
        request_success = counter("request_success", "Count of finished requests by finish reason.",
                                  ["finished_reason"])
        self.request_success = {r: request_success.labels(model_name, r) for r in FINISH_REASONS}
        self._request_success_family = request_success
        self.request_failure = counter("request_failure",
                                       "Requests failed by an engine error (answered with HTTP 500).").labels(
                                           model_name)

        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens of requests that got past their "
                                            "prefill.").labels(model_name)
        self.prefix_cache_hits = counter("prefix_cache_hits", "Of those, the tokens whose KV came from the prefix "
                                         "cache.").labels(model_name)

        # Speculative decoding (vLLM's SpecDecodingProm).
        self.spec_num_drafts = counter("spec_decode_num_drafts", "Number of spec decoding drafts.").labels(
            model_name)
        self.spec_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Number of draft tokens.").labels(
            model_name)
        self.spec_num_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                                "Number of accepted tokens.").labels(model_name)
        self._per_pos_family = counter("spec_decode_num_accepted_tokens_per_pos",
                                       "Accepted tokens per draft position.", ["position"])
        self._per_pos: list[Any] = []
        self._grow_positions(num_speculative_tokens)

        # Batch bucket dispatch: engine steps run per compiled batch bucket.
        self._bucket_family = counter("batch_bucket_steps", "Engine steps run per batch bucket.", ["bucket"])
        self._bucket_children: dict[int, Any] = {}
        self._bucket_seen: dict[int, int] = {}
        for b in batch_buckets:
            self._bucket_child(b)

        # Request-level histograms.
        self.time_to_first_token = histogram("time_to_first_token_seconds",
                                             "Histogram of time to first token in seconds.",
                                             TTFT_BUCKETS).labels(model_name)
        self.inter_token_latency = histogram("inter_token_latency_seconds",
                                             "Histogram of time between successive outputs of a request "
                                             "(one output may hold several tokens of a speculative step).",
                                             ITL_BUCKETS).labels(model_name)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds",
                                             "Histogram of e2e request latency in seconds.",
                                             E2E_BUCKETS).labels(model_name)
        token_buckets = one_two_five_buckets(max_context)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Number of prefill tokens per request.",
                                               token_buckets).labels(model_name)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Number of generation tokens per request.",
                                                   token_buckets).labels(model_name)
        self._lock = threading.Lock()  # guards the lazily grown label children and bucket snapshots

    # -- wiring ---------------------------------------------------------------------------------------------

    def watch_queue(self, num_running: Callable[[], int], num_waiting: Callable[[], int]) -> None:
        """Read the running/waiting gauges from these callables whenever /metrics is scraped."""
        self.num_requests_running.labels(self.model_name).set_function(num_running)
        self.num_requests_waiting.labels(self.model_name).set_function(num_waiting)

    def watch_kv(self, usage: Callable[[], tuple[int, int]]) -> None:
        """Read the KV gauges from `usage()` = (bytes used, bytes held) whenever /metrics is scraped."""
        self.kv_cache_bytes.labels(self.model_name).set_function(lambda: usage()[1])
        self.kv_cache_usage_perc.labels(self.model_name).set_function(lambda: (lambda u, h: u / h if h else 0.0)(*usage()))

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    # -- feeding --------------------------------------------------------------------------------------------

    def observe_event(self, event: Any, clock: RequestClock | None, now: float) -> None:
        """Account one StreamEvent of a request (clock None: a request the server no longer tracks)."""
        n = len(event.token_ids)
        if n:
            self.generation_tokens.inc(n)
            if clock is not None:
                if clock.first_token is None:  # its prefill is done: count the prompt now, as vLLM does
                    clock.first_token = now
                    self.time_to_first_token.observe(now - clock.arrival)
                    self.prompt_tokens.inc(clock.num_prompt_tokens)
                else:
                    self.inter_token_latency.observe(now - clock.last_token)
                clock.last_token = now
        if event.draft is not None:
            proposed, accepted = event.draft
            self.spec_num_drafts.inc()
            self.spec_num_draft_tokens.inc(proposed)
            self.spec_num_accepted_tokens.inc(accepted)
            if accepted > len(self._per_pos):
                self._grow_positions(accepted)
            for pos in range(accepted):
                self._per_pos[pos].inc()
        res = event.result
        if res is not None:
            reason = res.finish_reason
            child = self.request_success.get(reason)
            if child is None:  # a finish reason this file does not know yet: still count it
                child = self.request_success[reason] = self._request_success_family.labels(self.model_name, reason)
            child.inc()
            if clock is None and res.num_generated_tokens:  # an untracked request that got past its prefill
                self.prompt_tokens.inc(res.num_prompt_tokens)
            if res.num_generated_tokens:
                self.prefix_cache_queries.inc(res.num_prompt_tokens)
                self.prefix_cache_hits.inc(res.num_cached_tokens)
            self.request_prompt_tokens.observe(res.num_prompt_tokens)
            self.request_generation_tokens.observe(res.num_generated_tokens)
            if clock is not None:
                self.e2e_request_latency.observe(now - clock.arrival)

    def observe_step(self, bucket_steps: dict[int, int]) -> None:
        """Bring `batch_bucket_steps` up to the engine's cumulative per-bucket step counts."""
        with self._lock:
            for bucket, total in list(bucket_steps.items()):
                delta = total - self._bucket_seen.get(bucket, 0)
                if delta > 0:
                    self._bucket_child(bucket).inc(delta)
                    self._bucket_seen[bucket] = total

    def observe_failure(self) -> None:
        self.request_failure.inc()

    def _grow_positions(self, n: int) -> None:
        while len(self._per_pos) < n:
            self._per_pos.append(self._per_pos_family.labels(self.model_name, str(len(self._per_pos))))

    def _bucket_child(self, bucket: int) -> Any:
        child = self._bucket_children.get(bucket)
        if child is None:
            child = self._bucket_children[bucket] = self._bucket_family.labels(self.model_name, str(bucket))
        return child
