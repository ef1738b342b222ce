"""Tensor parallelism: one process per rank on torch.distributed (gloo on CPU, NCCL on CUDA, HCCL on Ascend).

Rank 0, the driver, is the process the user started: it schedules, and before any graph of a step runs it
sends that step's decisions (`StepMeta`) to every worker in one broadcast. Ranks 1..N-1, the workers, are
processes specair starts (or, under torchrun, the other processes of the same command: `join`); each holds
its shard of the models, never schedules and runs what each message says (`Engine.follow`); the
all-reduces and gathers inside the graphs (in shared memory between CPU ranks on one host:
models/shm_collectives) keep the ranks' activations equal.
An empty message is the idle heartbeat, so a worker's receive never waits longer than the timeout for a
live driver.

Faults end the whole group within `timeout()` seconds with an error naming the rank: a worker that exits
(its exit code and the tail of its log), one that reports an error, one that stops responding (its
liveness key in the store goes stale while a collective times out). Workers die with the driver
(PR_SET_PDEATHSIG, and a watchdog on the parent pid), so no process outlives a run.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from specair.models import shm_collectives
from specair.models.errors import InputError, SpecairError
from specair.models.llama import TensorParallel

MESSAGE_BYTES = 4096  # one broadcast per step carries a message up to this size; longer ones take a second
STOP = -1


def timeout() -> float:
    """Seconds a collective may wait before the group is declared failed ($SPECAIR_TP_TIMEOUT, default 20)."""
    return float(os.environ.get("SPECAIR_TP_TIMEOUT", 20))


class TensorParallelError(SpecairError):
    """A rank failed, hung or diverged: the group is over (the server answers 503 and exits)."""

    fatal = True


def dist_backend(device: str) -> str:
    """torch.distributed's backend for a device type."""
    kind = torch.device(device).type
    try:
        return {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}[kind]
    except KeyError:
        raise InputError(f"tensor parallelism has no collective backend for device {device!r}") from None


class Group:
    """The driver's view of the group: the step broadcast, heartbeats and the workers' health."""

    def __init__(self, tp: TensorParallel, store: dist.TCPStore, procs: dict[int, subprocess.Popen],
                 logs: dict[int, Path]) -> None:
        self.tp, self.store, self.procs, self.logs = tp, store, procs, logs
        self.trace: list | None = None  # the driver engine's trace, written on close under SPECAIR_TP_TRACE
        self.lock = threading.RLock()  # held for a whole step, so a heartbeat never lands inside one
        self.error: TensorParallelError | None = None
        self.on_failure: list[Callable[[TensorParallelError], None]] = []
        self._last_send = time.monotonic()
        self._closed = threading.Event()
        self._fail_lock = threading.Lock()
        self._buf = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
        threading.Thread(target=self._watch, name="specair-tp-watch", daemon=True).start()
        atexit.register(self.close)

    @property
    def workers(self) -> range:
        return range(1, self.tp.world)

    @property
    def world(self) -> int:
        return self.tp.world

    def send(self, message: Any) -> None:
        """Broadcast one step's message (None: the idle heartbeat) to every worker."""
        self.check()
        try:
            broadcast(self._buf, self.tp, message)
        except Exception as e:
            raise self.fail(e) from e
        self._last_send = time.monotonic()

    def check(self) -> None:
        """Raise the group's failure, if it failed."""
        if self.error is not None:
            raise self.error

    def fail(self, cause: BaseException | str) -> TensorParallelError:
        """Declare the group failed (naming the rank when one can be blamed), end every worker, return the error."""
        with self._fail_lock:
            if self.error is None:
                self.error = TensorParallelError(self._blame(cause))
                if self.tp.shm is not None:  # a step waiting in a shared-memory collective fails now
                    shm_collectives.group(self.tp.shm).abort(str(self.error))
                self._terminate()
                for cb in list(self.on_failure):
                    with contextlib.suppress(Exception):
                        cb(self.error)
        return self.error

    def _blame(self, cause: BaseException | str) -> str:
        deadline = time.monotonic() + 2  # a killed worker's sockets close before its exit status is ready
        while True:
            for r in self.workers:
                msg = _get(self.store, f"error/{r}")
                if msg:
                    return f"tensor-parallel rank {r} failed: {msg}"
                p = self.procs.get(r)
                if p is not None and p.poll() is not None:
                    return (f"tensor-parallel rank {r} (pid {p.pid}) exited with {_exit_status(p.returncode)}"
                            f"{_tail(self.logs, r)}")
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        now = time.time()
        for r in self.workers:
            seen = _get(self.store, f"alive/{r}")
            if seen and now - float(seen) > 3:
                pid = f" (pid {self.procs[r].pid})" if r in self.procs else ""
                return f"tensor-parallel rank {r}{pid} stopped responding ({now - float(seen):.0f} s " \
                       f"without a heartbeat); the step failed with: {str(cause)[:300]}"
        return f"tensor-parallel step failed: {str(cause)[:300]}"

    def _watch(self) -> None:
        """Heartbeats while idle; a worker's exit or error is noticed within a second, even between steps."""
        period = timeout() / 4
        while not self._closed.wait(0.5):
            if self.error is not None:
                return
            dead = [r for r, p in self.procs.items() if p.poll() is not None]
            errors = [r for r in self.workers if _get(self.store, f"error/{r}")]
            if dead or errors:
                self.fail("a worker ended")
                return
            if time.monotonic() - self._last_send > period and self.lock.acquire(blocking=False):
                try:
                    if self.error is None and not self._closed.is_set():
                        self.send(None)
                except TensorParallelError:
                    return
                finally:
                    self.lock.release()

    def close(self) -> None:
        """Stop the workers (a STOP message, then a kill for any that lingers) and leave the process group."""
        if self._closed.is_set():
            return
        with self.lock:
            if self.error is None:
                with contextlib.suppress(Exception):
                    broadcast(self._buf, self.tp, STOP)
            self._closed.set()
            deadline = time.monotonic() + 10
            for p in self.procs.values():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(max(0.1, deadline - time.monotonic()))
            self._terminate()
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
            if self.tp.shm is not None:
                shm_collectives.release(self.tp.shm)
        if self.trace is not None and os.environ.get("SPECAIR_TP_TRACE"):
            write_trace(self.trace, os.environ["SPECAIR_TP_TRACE"], 0)

    def _terminate(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)


def broadcast(buf: torch.Tensor, tp: TensorParallel, message: Any) -> None:
    """Rank 0: send `message` (pickled; None: empty; STOP) in one broadcast of `buf`, two if it is longer."""
    data = b"" if message is None else pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    n = STOP if message is STOP else len(data)
    head = n.to_bytes(8, "little", signed=True)
    first = head + data[:MESSAGE_BYTES - 8]
    buf[:len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
    dist.broadcast(buf, 0, group=tp.group)
    if n > MESSAGE_BYTES - 8:
        rest = torch.frombuffer(bytearray(data[MESSAGE_BYTES - 8:]), dtype=torch.uint8)
        dist.broadcast(rest, 0, group=tp.group)


def receive(buf: torch.Tensor, tp: TensorParallel) -> Any:
    """A worker: the next message from rank 0 (None for a heartbeat, STOP to end)."""
    dist.broadcast(buf, 0, group=tp.group)
    raw = bytes(buf.numpy())
    n = int.from_bytes(raw[:8], "little", signed=True)
    if n == STOP:
        return STOP
    if n == 0:
        return None
    data = raw[8:8 + min(n, MESSAGE_BYTES - 8)]
    if n > MESSAGE_BYTES - 8:
        rest = torch.empty(n - (MESSAGE_BYTES - 8), dtype=torch.uint8)
        dist.broadcast(rest, 0, group=tp.group)
        data += bytes(rest.numpy())
    return pickle.loads(data)


def _exit_status(code: int) -> str:
    if code < 0:
        import signal

        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"


def _tail(logs: dict[int, Path], rank: int) -> str:
    with contextlib.suppress(OSError):
        lines = [ln for ln in logs[rank].read_text(errors="replace").splitlines() if ln.strip()]
        if lines:
            return "; its last output: " + " | ".join(lines[-3:])[-600:]
    return ""


def _get(store: dist.TCPStore, key: str) -> str | None:
    try:
        return store.get(key).decode() if store.check([key]) else None
    except Exception:  # the store went away with the driver
        return None


_current: Group | None = None  # the group this process drives (torch.distributed has one default group)


# ---- starting the group ---------------------------------------------------------------------------------

def launch(world: int, device: str, engine_kwargs: dict[str, Any], build: Callable[[TensorParallel], Any]) -> Any:
    """Start ranks 1..world-1 as processes running `worker_main`, join them in a process group, build rank 0's
    engine with `build(tp)` while they build theirs, and return it once every rank is ready (its `group`
    set). A worker that fails to start ends the launch with its error."""
    global _current
    if _current is not None:
        if _current.error is None and not _current._closed.is_set():
            raise InputError("this process already drives a tensor-parallel group; close() its engine first")
        _current.close()
    store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=600), wait_for_workers=False)
    logdir = Path(tempfile.mkdtemp(prefix="specair-tp-"))
    procs, logs = {}, {}
    config = {"world": world, "port": store.port, "device": device, "engine": engine_kwargs,
              "timeout": timeout(), "trace": os.environ.get("SPECAIR_TP_TRACE")}
    for r in range(1, world):
        logs[r] = logdir / f"rank{r}.log"
        with open(logs[r], "wb") as log:
            procs[r] = subprocess.Popen([sys.executable, "-m", "specair.runtime.tensor_parallel", str(r)],
                                        stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})
        procs[r].stdin.write(json.dumps(config).encode())
        procs[r].stdin.close()

    def kill_all() -> None:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()

    try:
        _wait(store, procs, logs, "joined", "joining the process group")
        tp = _init(0, world, store, device)
        engine = build(tp)
        _wait(store, procs, logs, "ready", "loading its shard")
    except BaseException:
        kill_all()
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    engine.group = _current = Group(tp, store, procs, logs)
    if os.environ.get("SPECAIR_TP_TRACE"):
        engine.trace = engine.group.trace = []
    return engine


def _wait(store: Any, procs: dict[int, subprocess.Popen], logs: dict[int, Path], what: str, doing: str,
          ranks: Any = None) -> None:
    pending = set(procs if ranks is None else ranks)
    while pending:
        for r in sorted(pending):
            err = _get(store, f"error/{r}")
            if err:
                raise TensorParallelError(f"tensor-parallel rank {r} failed while {doing}: {err}")
            if r in procs and procs[r].poll() is not None:
                raise TensorParallelError(f"tensor-parallel rank {r} exited with {_exit_status(procs[r].returncode)} "
                                          f"while {doing}{_tail(logs, r)}")
            if store.check([f"{what}/{r}"]):
                pending.discard(r)
        time.sleep(0.05)


def collectives(device: str) -> str:
    """What the graphs' collectives run on: "shm" (shared memory, CPU ranks on this x86-64 host, unless
    $SPECAIR_TP_COLLECTIVES=gloo) or the process group's backend."""
    backend = dist_backend(device)
    if backend == "gloo" and shm_collectives.supported() and os.environ.get("SPECAIR_TP_COLLECTIVES") != "gloo":
        return "shm"
    return backend


def _init(rank: int, world: int, store: dist.TCPStore, device: str) -> TensorParallel:
    kind = torch.device(device).type
    if kind != "cpu":
        getattr(torch, kind).set_device(rank)
    dist.init_process_group(dist_backend(device), store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout()))
    return _rank(rank, world, store, device, same_host=True)


def _rank(rank: int, world: int, store: Any, device: str, same_host: bool) -> TensorParallel:
    """This rank's TensorParallel once the process group is up: with the shared-memory collectives where
    every rank is a CPU process on this host (`collectives`)."""
    if not same_host or collectives(device) != "shm":
        return TensorParallel(dist.group.WORLD, rank, world)
    if rank == 0:
        fd, path = tempfile.mkstemp(prefix="specair-tp-", dir=shm_collectives.mapping_dir(world))
        os.close(fd)
        shm = shm_collectives.ShmGroup(path, rank, world, dist.group.WORLD, timeout())
        store.set("shm", path)
    else:
        shm = shm_collectives.ShmGroup(store.get("shm").decode(), rank, world, dist.group.WORLD, timeout())
    dist.barrier()
    if rank == 0:
        os.unlink(path)  # every rank has it mapped; nothing is left behind however the group ends
    return TensorParallel(dist.group.WORLD, rank, world, shm.id)


# ---- torchrun ---------------------------------------------------------------------------------------------

def torchrun_env() -> dict[str, Any] | None:
    """torchrun's (torch.distributed.run's) environment when this process is one of its ranks, else None."""
    if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    world = int(os.environ["WORLD_SIZE"])
    return {"rank": int(os.environ["RANK"]), "world": world,
            "local_world": int(os.environ.get("LOCAL_WORLD_SIZE", world))}


def join(world: int, device: str, build: Callable[[TensorParallel], Any], trace: str | None = None) -> Any:
    """This process's place in a group torchrun started, one process per rank, each running the same command:
    rank 0 builds and returns the driver's engine once every rank is ready; the others build theirs, follow
    the driver until it stops, then exit the process. Collectives run in shared memory when every rank is on
    this host (LOCAL_WORLD_SIZE = WORLD_SIZE), else on the process group's backend."""
    global _current
    env = torchrun_env()
    if env is None or env["world"] != world:
        raise InputError(f"--tensor-parallel-size {world} under torchrun needs WORLD_SIZE={world} (got "
                         f"{None if env is None else env['world']})")
    rank = env["rank"]
    kind = torch.device(device).type
    if kind != "cpu":
        getattr(torch, kind).set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(dist_backend(device), init_method="env://", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout()))
    store = dist.distributed_c10d._get_default_store()
    tp = _rank(rank, world, store, device, same_host=env["local_world"] == world)
    if rank != 0:
        sys.exit(_follow(rank, store, tp, build, trace))
    engine = build(tp)
    _wait(store, {}, {}, "ready", "loading its shard", ranks=range(1, world))
    engine.group = _current = Group(tp, store, {}, {})
    if trace:
        engine.trace = engine.group.trace = []
    return engine


# ---- a worker -------------------------------------------------------------------------------------------

def _die_with_parent() -> None:
    """End this worker when the driver ends, however it ends."""
    parent = os.getppid()
    with contextlib.suppress(Exception):
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True).start()


def worker_main(rank: int) -> int:
    """A worker's life: join, build this rank's engine as the driver described it, follow the driver's
    steps until STOP. Errors go to the store (the driver names them) and end the process."""
    _die_with_parent()
    config = json.loads(sys.stdin.read())
    world, t = config["world"], config["timeout"]
    os.environ["SPECAIR_TP_TIMEOUT"] = str(t)
    store = dist.TCPStore("127.0.0.1", config["port"], world, False, timeout=timedelta(seconds=600))
    store.set(f"joined/{rank}", "1")
    try:
        tp = _init(rank, world, store, config["device"])
    except BaseException as e:
        with contextlib.suppress(Exception):
            store.set(f"error/{rank}", f"{type(e).__name__}: {e}"[:1000])
        raise
    from specair.runtime.build import open_engine

    return _follow(rank, store, tp, lambda tp: open_engine(**config["engine"], tp=tp), config["trace"])


def _follow(rank: int, store: Any, tp: TensorParallel, build: Callable[[TensorParallel], Any],
            trace: str | None) -> int:
    """A worker rank: build its engine, say so, then run every step the driver broadcasts until STOP. Errors go
    to the store (the driver names them) and end the process."""
    def alive() -> None:
        while True:
            with contextlib.suppress(Exception):
                store.set(f"alive/{rank}", str(time.time()))
            time.sleep(1)

    engine = None
    try:
        threading.Thread(target=alive, daemon=True).start()
        engine = build(tp)
        if trace:
            engine.trace = []
        store.set(f"ready/{rank}", "1")
        buf = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
        with torch.inference_mode():
            while (msg := receive(buf, tp)) is not STOP:
                if msg is not None:
                    engine.follow(msg)
    except BaseException as e:
        with contextlib.suppress(Exception):
            store.set(f"error/{rank}", f"{type(e).__name__}: {e}"[:1000])
        raise
    finally:
        if trace and engine is not None and engine.trace is not None:
            write_trace(engine.trace, trace, rank)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    return 0


def write_trace(trace: list, directory: str, rank: int) -> None:
    """Write a rank's recorded step trace as JSON lines (`SPECAIR_TP_TRACE=DIR`)."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    with open(Path(directory) / f"rank{rank}.jsonl", "w") as f:
        for item in trace:
            f.write(json.dumps(item) + "\n")


if __name__ == "__main__":
    sys.exit(worker_main(int(sys.argv[1])))
