"""All-reduce and all-gather between tensor-parallel CPU ranks on one host, through shared memory.

gloo takes about a millisecond per all-reduce of one activation row between two processes on one machine, and a
decode step of a sharded model runs two per layer. Here every rank writes its part into its own slot of one
shared mapping, publishes a generation counter, waits for every other rank's counter, then combines the slots in
rank order, so every rank computes the same sum from the same bytes in the same order (bitwise equal results
on all ranks, as the engine needs to sample the same tokens everywhere). Slots are double-buffered by the
parity of the generation: a rank may start writing call g only once every rank has published call g-1, that
is, has finished reading call g-2, the last user of the same buffers.

The mapping is a file in /dev/shm (or the temporary directory where /dev/shm is too small), unlinked once every
rank has mapped it. The collectives are torch custom ops (`torch.ops.specair.shm_all_reduce`, `shm_all_gather`), so Dynamo and
Inductor keep them inside a compiled graph as opaque calls, as they keep functional collectives. Publication
relies on stores becoming visible in program order (x86-64's TSO); elsewhere, and for a collective larger than
a slot, ranks use the process group's own collectives. A rank that does not arrive within the timeout fails
the call with a RuntimeError naming it.
"""

from __future__ import annotations

import itertools
import mmap
import os
import platform
import time

import torch
import torch.distributed as dist
from torch import Tensor

SLOT_BYTES = 64 << 20  # per rank and parity; pages are committed only where written
_LINE = 64
_groups: dict[int, ShmGroup] = {}
_ids = itertools.count()


def group(group_id: int) -> ShmGroup:
    """The shared-memory group of this id in this process."""
    return _groups[group_id]


def release(group_id: int) -> None:
    """Forget a group whose ranks have stopped (its mapping goes once nothing views it)."""
    _groups.pop(group_id, None)


def mapping_dir(world: int, slot_bytes: int = SLOT_BYTES) -> str | None:
    """Where the mapping's file goes: /dev/shm when it has room for every slot (a container's is often 64 MB,
    and a write past a full tmpfs is a SIGBUS), else the temporary directory (the page cache shares it as well)."""
    need = _LINE * world + 2 * world * slot_bytes
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return "/dev/shm" if st.f_bavail * st.f_frsize >= need else None


def supported() -> bool:
    """Whether this host's memory model lets ranks publish through plain stores (x86-64 only)."""
    return platform.machine().lower() in ("x86_64", "amd64")


class ShmGroup:
    """One rank's end of a shared mapping of `world` × 2 slots and `world` generation counters."""

    def __init__(self, path: str, rank: int, world: int, group: object, timeout: float,
                 slot_bytes: int = SLOT_BYTES) -> None:
        self.rank, self.world, self.group, self.timeout, self.slot_bytes = rank, world, group, timeout, slot_bytes
        self.header = _LINE * world
        size = self.header + 2 * world * slot_bytes
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        flags = torch.frombuffer(self.map, dtype=torch.int64, count=self.header // 8)
        self.flags = flags[::_LINE // 8]  # one counter per cache line
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8, count=size - self.header, offset=self.header)
        self.generation = 0
        self.aborted: str | None = None
        self._views: dict[tuple, list[Tensor]] = {}
        self.id = next(_ids)
        _groups[self.id] = self

    def abort(self, reason: str) -> None:
        """Fail the collective this rank waits in, and every later one (the group is over)."""
        self.aborted = reason

    def _slots(self, parity: int, like: Tensor) -> list[Tensor]:
        """Every rank's slot of this parity as a tensor shaped like `like` (views cached per shape)."""
        key = (parity, like.dtype, tuple(like.shape))
        views = self._views.get(key)
        if views is None:
            n = like.numel() * like.element_size()
            with torch.inference_mode(False):  # plain views, written in and out of inference mode alike
                views = self._views[key] = [
                    self.bytes[(parity * self.world + r) * self.slot_bytes:][:n].view(like.dtype).view(like.shape)
                    for r in range(self.world)]
        return views

    def _wait(self, generation: int) -> None:
        deadline = None
        spins = 0
        while int(self.flags.min()) < generation:
            spins += 1
            if spins % 1024 == 0:
                if self.aborted is not None:
                    raise RuntimeError(f"shared-memory collective {generation} aborted: {self.aborted}")
                now = time.monotonic()
                deadline = deadline or now + self.timeout
                if now > deadline:
                    late = [r for r in range(self.world) if int(self.flags[r]) < generation]
                    raise RuntimeError(f"tensor-parallel rank(s) {late} did not reach shared-memory collective "
                                       f"{generation} within {self.timeout:.0f} s")
                if spins > 1 << 16:
                    time.sleep(0)  # a rank that is far behind (a long prefill elsewhere): let it run

    def _exchange(self, x: Tensor) -> list[Tensor]:
        """Publish x in this rank's slot; return every rank's part, in rank order."""
        g = self.generation = self.generation + 1
        self._wait(g - 1)
        slots = self._slots(g % 2, x)
        slots[self.rank].copy_(x)
        self.flags[self.rank] = g
        self._wait(g)
        return slots

    def fits(self, x: Tensor) -> bool:
        return x.numel() * x.element_size() <= self.slot_bytes

    def all_reduce(self, x: Tensor) -> Tensor:
        x = x.contiguous()
        if not self.fits(x):
            out = x.clone()
            dist.all_reduce(out, group=self.group)
            return out
        slots = self._exchange(x)
        out = slots[0].clone()
        for part in slots[1:]:
            out += part
        return out

    def all_gather(self, x: Tensor) -> Tensor:
        x = x.contiguous()
        if not self.fits(x):
            parts = [torch.empty_like(x) for _ in range(self.world)]
            dist.all_gather(parts, x, group=self.group)
            return torch.cat(parts)
        return torch.cat(self._exchange(x))


@torch.library.custom_op("specair::shm_all_reduce", mutates_args=())
def shm_all_reduce(x: Tensor, group: int) -> Tensor:
    """The sum of every rank's x, through shared-memory group `group` (a ShmGroup's id in this process)."""
    return _groups[group].all_reduce(x)


@shm_all_reduce.register_fake
def _(x: Tensor, group: int) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("specair::shm_all_gather", mutates_args=())
def shm_all_gather(x: Tensor, group: int, world: int) -> Tensor:
    """Every rank's x concatenated along dim 0 in rank order (`world` ranks), through shared-memory group `group`."""
    return _groups[group].all_gather(x)


@shm_all_gather.register_fake
def _(x: Tensor, group: int, world: int) -> Tensor:
    return x.new_empty((world * x.shape[0], *x.shape[1:]))
