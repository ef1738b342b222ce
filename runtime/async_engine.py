"""The engine behind an asyncio server: one background thread steps the engine, requests await their events.

`Engine.step()` is synchronous and must be called from one thread; `add_request` and `abort` are thread-safe.
`AsyncEngine` owns that one stepping thread. The thread sleeps on a condition variable while the engine has no
unfinished request (no busy loop) and is woken by `add_request`/`abort`. Each StreamEvent is handed to the
asyncio queue of the request it belongs to with `loop.call_soon_threadsafe`, so the event loop never blocks on
the engine and the engine never touches asyncio objects directly.

An exception raised by `step()` fails the request it names (an exception with a `request_id` attribute), or else
every request in flight, with `RequestFailedError`; those requests are aborted in the engine so their slots free,
and the thread keeps serving. After `MAX_CONSECUTIVE_FAILURES` failing steps in a row, or at once for a fatal
error (a tensor-parallel rank lost, even between steps), the engine is declared dead: every request fails, new
ones are refused with `EngineDeadError`, and `on_fatal` callbacks run (the server exits non-zero).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from collections.abc import AsyncIterator, Sequence
from typing import Any, Callable

from specair.models.errors import SpecairError
from specair.runtime.metrics import RequestClock, ServerMetrics
from specair.runtime.params import SamplingParams

logger = logging.getLogger("specair.serve")

MAX_CONSECUTIVE_FAILURES = 3


class EngineDeadError(SpecairError):
    """The engine thread stopped (shut down, or its steps kept failing); no request can be served."""


class RequestFailedError(SpecairError):
    """The engine raised while serving this request."""


@dataclass
class _Sink:
    """Where one request's events go: the asyncio queue (on its loop) its handler awaits."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    clock: RequestClock
    finished: bool = False
    error: BaseException | None = field(default=None, repr=False)


class RequestStream:
    """The events of one request, as an async iterator; the last event carries the GenerationResult.

    Leaving the iteration early (the client went away, the handler was cancelled) aborts the request in the
    engine so its slot frees; so does `abort()`.
    """

    def __init__(self, owner: AsyncEngine, request_id: str, sink: _Sink) -> None:
        self.owner, self.request_id, self._sink = owner, request_id, sink

    @property
    def finished(self) -> bool:
        return self._sink.finished

    async def __aiter__(self) -> AsyncIterator[Any]:
        try:
            while True:
                item = await self._sink.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.result is not None:
                    return
        finally:
            self.abort()

    def abort(self) -> None:
        """Abort the request unless it already finished (safe to call more than once)."""
        if not self._sink.finished:
            self.owner.abort(self.request_id)


class AsyncEngine:
    """Runs `engine.step()` in one background thread and routes its events to asyncio consumers."""

    def __init__(self, engine: Any, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self._sinks: dict[str, _Sink] = {}
        self._lock = threading.Lock()  # guards _sinks
        self._wake = threading.Condition()
        self._stopping = False
        self._dead: str | None = None  # why the engine stopped serving
        self.on_fatal: list[Callable[[str], None]] = []  # told why, once, when the engine dies of a fault
        self._thread = threading.Thread(target=self._run, name="specair-engine", daemon=True)
        group = getattr(engine, "group", None)
        if group is not None:
            group.on_failure.append(lambda e: self._kill(str(e), fatal=True))
        if metrics is not None:
            metrics.watch_queue(lambda: int(engine.num_running), lambda: int(engine.num_waiting))
            if hasattr(engine, "kv_usage"):
                metrics.watch_kv(engine.kv_usage)

    # -- lifecycle ------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the stepping thread."""
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the stepping thread after its current step; fail every request still in flight."""
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._kill("the server is shutting down")

    @property
    def alive(self) -> bool:
        """True while the stepping thread serves requests."""
        return self._dead is None and self._thread.is_alive()

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    # -- requests -------------------------------------------------------------------------------------------

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams,
                    request_id: str | None = None) -> RequestStream:
        """Queue a request and return its event stream. Call from the event loop's thread.

        Raises what `Engine.add_request` raises (InputError, QueueFullError) before anything is queued, and
        EngineDeadError when the engine no longer serves.
        """
        if not self.alive:
            raise EngineDeadError(self._dead or "the engine is not running")
        loop = asyncio.get_running_loop()
        rid = request_id or uuid.uuid4().hex
        sink = _Sink(loop, asyncio.Queue(), RequestClock(time.perf_counter(), len(prompt_ids)))
        with self._lock:
            if rid in self._sinks:
                raise SpecairError(f"request id {rid!r} is already in flight")
            self._sinks[rid] = sink  # before the engine sees it, so no event can miss its sink
        try:
            rid = self.engine.add_request(prompt_ids, params, rid)
        except BaseException:
            with self._lock:
                self._sinks.pop(rid, None)
            raise
        with self._wake:
            self._wake.notify()
        return RequestStream(self, rid, sink)

    def abort(self, request_id: str) -> None:
        """Abort a request in the engine (its final event, finish_reason "abort", is still accounted)."""
        with self._lock:
            sink = self._sinks.get(request_id)
        if sink is None or sink.finished:
            return
        try:
            self.engine.abort(request_id)
        except Exception:  # it finished between our check and the engine's: nothing left to free
            logger.debug("abort of %s after it finished", request_id, exc_info=True)
        with self._wake:
            self._wake.notify()

    # -- the stepping thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        failures = 0
        while True:
            with self._wake:
                while not self._stopping and not self.engine.has_unfinished():
                    self._wake.wait()
                if self._stopping:
                    return
            try:
                events = self.engine.step()
            except Exception as e:
                failures += 1
                logger.exception("engine step failed (%d in a row)", failures)
                if getattr(e, "fatal", False):
                    self._kill(str(e), fatal=True)
                    return
                if failures >= MAX_CONSECUTIVE_FAILURES:
                    self._kill(f"the engine failed {failures} steps in a row: {e!r}", fatal=True)
                    return
                self._fail_step(e)
                continue
            failures = 0
            now = time.perf_counter()
            for event in events:
                self._route(event, now)
            if self.metrics is not None:
                self.metrics.observe_step(self.engine.bucket_steps)

    def _route(self, event: Any, now: float) -> None:
        rid = event.request_id
        with self._lock:
            sink = self._sinks.get(rid)
            if sink is not None and event.result is not None:
                sink.finished = True
                del self._sinks[rid]
        failed = event.result is not None and event.result.finish_reason == "error"
        if self.metrics is not None:
            if failed:
                self.metrics.observe_failure()
            else:
                self.metrics.observe_event(event, sink.clock if sink is not None else None, now)
        if sink is not None:
            self._deliver(sink, RequestFailedError(f"the engine failed while serving this request: "
                                                   f"{event.result.extra['error']}") if failed else event)

    def _fail_step(self, error: Exception) -> None:
        """Fail the request the exception names, else every request in flight, and abort them in the engine."""
        named = getattr(error, "request_id", None)
        with self._lock:
            victims = [named] if named in self._sinks else list(self._sinks)
            sinks = [(rid, self._sinks.pop(rid)) for rid in victims]
        for rid, sink in sinks:
            sink.finished = True
            if self.metrics is not None:
                self.metrics.observe_failure()
            self._deliver(sink, RequestFailedError(f"the engine failed while serving this request: {error!r}"))
            try:
                self.engine.abort(rid)
            except Exception:
                logger.debug("abort of failed request %s", rid, exc_info=True)

    def _kill(self, reason: str, fatal: bool = False) -> None:
        """Stop serving: fail every request in flight with EngineDeadError."""
        if self._dead is None:
            self._dead = reason
            if fatal:
                for cb in self.on_fatal:
                    cb(reason)
        with self._wake:
            self._wake.notify_all()
        with self._lock:
            sinks, self._sinks = list(self._sinks.values()), {}
        for sink in sinks:
            sink.finished = True
            self._deliver(sink, EngineDeadError(reason))

    @staticmethod
    def _deliver(sink: _Sink, item: Any) -> None:
        try:
            sink.loop.call_soon_threadsafe(sink.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is gone, nobody is waiting
            pass
