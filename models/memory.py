"""KV cache memory that the OS commits on first write.

A CPU cache is an anonymous private mapping: it reads as zeros, and a page costs memory only once
something is written to it (the idea of vAttention, Prabhu et al. 2025, with the OS's demand paging in
place of CUDA's virtual memory API). Graphs compiled for a fixed cache shape therefore take caches of the
plan's full context while a row holds memory only for the slots written to it; `release` gives a row's
pages past its context back, and `resident_bytes` measures what the caches hold. Transparent huge pages are
refused for these mappings: one 2 MB page would cover a whole layer's slots of a row. Other devices get
plain zeroed tensors.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import sys
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

PAGE = mmap.PAGESIZE
_LINUX = sys.platform.startswith("linux")
_libc = ctypes.CDLL(None, use_errno=True) if _LINUX else None


def zeros(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str = "cpu") -> Tensor:
    """A zeroed tensor; on the CPU under Linux, one whose pages are committed on first write."""
    numel, size = math.prod(shape), torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or numel * size < PAGE or _libc is None:
        return torch.zeros(tuple(shape), dtype=dtype, device=device)
    span = -(-numel * size // PAGE) * PAGE
    # Inaccessible pages on both sides keep the kernel from merging the mapping with a neighbour, so its
    # resident size in /proc/self/smaps is the cache's own.
    m = mmap.mmap(-1, span + 2 * PAGE, flags=mmap.MAP_PRIVATE)  # fileno -1: anonymous
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    for at in (base, base + PAGE + span):
        if _libc.mprotect(ctypes.c_void_p(at), ctypes.c_size_t(PAGE), 0):
            raise OSError(ctypes.get_errno(), "mprotect failed on a KV cache's guard page")
    m.madvise(mmap.MADV_NOHUGEPAGE, PAGE, span)
    # The tensor keeps the mapping alive; the mapping goes when its last view does.
    return torch.frombuffer(m, dtype=dtype, count=numel, offset=PAGE).view(tuple(shape))


def release(cache: Tensor, row: int, start: int = 0) -> None:
    """Give back the memory of `row`'s slots from `start` on, in a cache [L, B, Hkv, S, D] made by `zeros`:
    the whole pages among them read as zeros again and hold no memory. No-op off Linux and off the CPU."""
    if _libc is None or cache.device.type != "cpu" or cache.untyped_storage().nbytes() < PAGE:
        return
    L, B, H, S, D = cache.shape
    if start >= S:
        return
    size = cache.element_size()
    run, skip = S * D * size, start * D * size  # one (layer, head) of a row: S slots, contiguous
    spans: list[list[int]] = []
    for layer in range(L):
        for h in range(H):
            lo = cache.data_ptr() + ((layer * B + row) * H + h) * run
            if spans and spans[-1][1] == lo + skip:  # contiguous with the last run: one span
                spans[-1][1] = lo + run
            else:
                spans.append([lo + skip, lo + run])
    for lo, hi in spans:
        first, end = -(-lo // PAGE) * PAGE, hi // PAGE * PAGE
        if end > first and _libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(end - first), mmap.MADV_DONTNEED):
            raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed on a KV cache")


def resident_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of memory the tensors' storage holds: on Linux the resident pages of their mappings (from
    /proc/self/smaps; pages only read map the shared zero page and hold none), elsewhere their size."""
    spans, total = [], 0
    for t in tensors:
        n = t.untyped_storage().nbytes()
        if t.device.type == "cpu" and n >= PAGE and _LINUX:
            spans.append((t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + n))
        else:
            total += n
    if not spans:
        return total
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = any(lo < e and s < hi for s, e in spans)
            elif inside and head == "Rss:":
                total += int(line.split()[1]) * 1024
    return total
