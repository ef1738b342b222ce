"""The onnx backend's shared weights file: every weight of every graph stored once, referenced as ONNX
external data.

Artifact directory (one per backend run, i.e. one model pair):

    <key>.onnx          one graph per bucket, without weights (~1 MB for a 30-layer model)
    onnx_weights.bin    every weight of every graph once (raw, 64-byte aligned), referenced by all graph
                        files as ONNX external data; one torch tensor under two names (tied weights, a
                        layer-skip draft) is stored once; big constants (RoPE tables) too, by content
    onnx_weights.json   its index: name -> offset, length, dtype, shape, sha256
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specair.compile.backends.onnx_export import OnnxExportError
from specair.models.errors import SpecairError

WEIGHTS_FILE = "onnx_weights.bin"
WEIGHTS_INDEX = "onnx_weights.json"
_ALIGN = 64
_LIFT_BYTES = 1 << 16  # constants at least this big move to the shared weights file


class OnnxArtifactError(SpecairError):
    """An ONNX artifact is missing or does not match the graph it is loaded for."""


_HUGE = 2 << 20  # a transparent huge page on x86-64 and arm64 (4 KiB base pages)


class HugePageArena:
    """Host memory for the weights a process reads from the weights file, in chunks backed by transparent huge
    pages where the kernel allows them (`madvise(MADV_HUGEPAGE)`; it does under the "madvise" and "always"
    settings). A decode step streams every weight once, and on 4 KiB pages the CPU's prefetchers stop at every
    page boundary and every page costs a TLB walk: the block kernels read at what a plain streaming read on 4 KiB
    pages gets, and faster on 2 MiB pages (docs/performance.md). Tensors are packed one after another (64-byte
    aligned) into chunks of at least `chunk` bytes, so only the last huge page of each chunk is partly used; a
    chunk's memory goes when the last array in it does (each array keeps its chunk's mapping alive).
    `SPECAIR_HUGEPAGES=0` (or huge=False) leaves the chunks on the kernel's ordinary pages."""

    def __init__(self, chunk: int = 256 << 20, huge: bool | None = None) -> None:
        self.chunk = chunk
        self.huge = os.environ.get("SPECAIR_HUGEPAGES", "1") != "0" if huge is None else huge
        self._buf: mmap.mmap | None = None
        self._at = self._end = 0

    def empty(self, nbytes: int) -> "np.ndarray":
        """A fresh uint8 array of nbytes in the arena."""
        import numpy as np

        if self._buf is None or self._at + nbytes > self._end:
            size = max(self.chunk, nbytes) + _HUGE
            self._buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            base = np.frombuffer(self._buf, dtype=np.uint8, count=1).ctypes.data
            self._at = (-base) % _HUGE  # huge pages back 2 MiB-aligned ranges only
            self._end = size
            if self.huge and hasattr(mmap, "MADV_HUGEPAGE"):
                try:
                    self._buf.madvise(mmap.MADV_HUGEPAGE, self._at, size - self._at)
                except OSError:  # a kernel without transparent huge pages: 4 KiB pages, the same bytes
                    pass
        arr = np.frombuffer(self._buf, dtype=np.uint8, count=nbytes, offset=self._at)
        self._at += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        return arr

    def read(self, path: Path, offset: int, dtype, dims: tuple[int, ...]) -> "np.ndarray":
        """The tensor of `dtype` and `dims` stored at `offset` in the file at `path`, read into the arena."""
        import numpy as np

        dtype = np.dtype(dtype)
        nbytes = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
        arr = self.empty(nbytes)
        with open(path, "rb") as f:
            f.seek(offset)
            if f.readinto(memoryview(arr)) != nbytes:
                raise OnnxArtifactError(f"{path} ends before the {nbytes} bytes at offset {offset}: recompile")
        return arr.view(dtype).reshape(dims)


def numpy_dtype(dtype: torch.dtype):
    import numpy as np

    return np.dtype(str(dtype).removeprefix("torch.")) if dtype != torch.bfloat16 else None


def to_numpy(t: Tensor):
    t = t.detach()
    if t.dtype == torch.bfloat16:
        raise OnnxExportError("the onnx backend takes float32/float16 models; bfloat16 has no numpy type")
    if t.device.type != "cpu":
        raise OnnxExportError(f"the onnx backend runs on CPU; got a tensor on {t.device}")
    return t.contiguous().numpy()


def _version(t: Tensor) -> int:
    """The in-place version counter (inference tensors have none: they cannot change in place outside
    inference mode, so -1)."""
    try:
        return t._version
    except RuntimeError:
        return -1


class WeightStore:
    """onnx_weights.bin + onnx_weights.json in an artifact directory: append-only, one entry per tensor name;
    names of one torch tensor (or of equal bytes, dtype and shape) share one stored copy."""

    def __init__(self, art_dir: Path) -> None:
        self.bin, self.idx = art_dir / WEIGHTS_FILE, art_dir / WEIGHTS_INDEX
        self.entries: dict[str, dict[str, Any]] = {}
        if self.idx.exists():
            self.entries = json.loads(self.idx.read_text())["tensors"]
        self._by_content = {self._content_key(e): n for n, e in self.entries.items()}
        # name -> (tensor, version) stored or verified by this process; holding the tensor keeps its
        # data_ptr from being reused by another tensor, so (data_ptr, shape, dtype) identifies it.
        self._verified: dict[str, tuple[Tensor, int]] = {}
        self._by_ptr: dict[tuple, str] = {}
        self._arrays: dict[str, Any] = {}  # name -> the numpy array stored or verified under it by this process
        self._dirty = False

    @staticmethod
    def _content_key(entry: dict[str, Any]) -> tuple:
        return entry["sha256"], entry["dtype"], tuple(entry["shape"])

    def add(self, name: str, tensor: Tensor | None = None, array=None) -> dict[str, Any]:
        """Store the tensor (or numpy array) under name unless it is stored already; its index entry.
        A name stored before with other contents is an error (one directory holds one model pair)."""
        import numpy as np

        ptr_key = None
        if tensor is not None:
            seen = self._verified.get(name)
            if seen is not None and seen[0] is tensor and seen[1] == _version(tensor):
                return self.entries[name]
            ptr_key = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype, _version(tensor))
            alias = self._by_ptr.get(ptr_key)
            if alias is not None and name not in self.entries:  # the same torch tensor under another name
                self.entries[name] = self.entries[alias]
                self._verified[name] = (tensor, _version(tensor))
                self._dirty = True
                return self.entries[name]
            array = to_numpy(tensor)
        elif name in self.entries and self._arrays.get(name) is array:  # this very array, stored for a graph before
            return self.entries[name]
        source = array
        array = np.ascontiguousarray(array)
        entry = {"dtype": str(array.dtype), "shape": list(array.shape),
                 "sha256": hashlib.sha256(memoryview(array).cast("B")).hexdigest()}
        old = self.entries.get(name)
        if old is not None and self._content_key(old) != self._content_key(entry):
            raise OnnxArtifactError(f"{self.bin.parent}: tensor {name!r} differs from the one already stored there; "
                                    "one artifact directory holds one model pair: compile into a fresh directory")
        if old is None:
            same = self._by_content.get(self._content_key(entry))
            if same is not None:
                entry = self.entries[same]
            else:
                with open(self.bin, "ab") as f:
                    off = f.seek(0, os.SEEK_END)
                    pad = -off % _ALIGN
                    f.write(b"\0" * pad)
                    f.write(memoryview(array).cast("B"))
                entry.update(offset=off + pad, length=array.nbytes)
                self._by_content[self._content_key(entry)] = name
            self.entries[name] = entry
            self._dirty = True
        if tensor is not None:
            self._verified[name] = (tensor, _version(tensor))
            self._by_ptr[ptr_key] = name
        else:  # arrays (quantized weights) are made once per process and never change: hashed once
            self._arrays[name] = source
        return self.entries[name]

    def flush(self) -> None:
        if self._dirty:
            tmp = self.idx.with_suffix(".tmp")
            tmp.write_text(json.dumps({"file": WEIGHTS_FILE, "tensors": self.entries}, indent=0))
            tmp.replace(self.idx)
            self._dirty = False


def external_tensor(name: str, entry: dict[str, Any]):
    import numpy as np
    import onnx

    t = onnx.TensorProto()
    t.name = name
    t.data_type = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(entry["dtype"]))
    t.dims.extend(entry["shape"])
    t.data_location = onnx.TensorProto.EXTERNAL
    for k, v in (("location", WEIGHTS_FILE), ("offset", str(entry["offset"])), ("length", str(entry["length"]))):
        e = t.external_data.add()
        e.key, e.value = k, v
    return t


def externalize(model, tensors: dict[str, Tensor], store: WeightStore) -> None:
    """Weights (graph inputs named after module tensors, or embedded initializers) and big constants ->
    external-data initializers in the shared weights file."""
    import onnx
    from onnx import numpy_helper

    g = model.graph
    for vi in [vi for vi in g.input if vi.name in tensors]:
        g.input.remove(vi)
        g.initializer.append(external_tensor(vi.name, store.add(vi.name, tensor=tensors[vi.name])))
    for i, init in enumerate(list(g.initializer)):
        if init.data_location == onnx.TensorProto.EXTERNAL:
            continue
        if init.name in tensors:
            g.initializer[i].CopyFrom(external_tensor(init.name, store.add(init.name, tensor=tensors[init.name])))
        elif len(init.raw_data) >= _LIFT_BYTES:
            arr = numpy_helper.to_array(init)
            g.initializer[i].CopyFrom(external_tensor(init.name, store.add(init.name, array=arr)))
    keep = []
    for node in g.node:
        value = next((a.t for a in node.attribute if a.name == "value"), None) if node.op_type == "Constant" else None
        if value is not None and not node.domain and len(value.raw_data) >= _LIFT_BYTES:
            arr = numpy_helper.to_array(value)
            # Named by content, shape and dtype: equal bytes in another shape (zeros, say) are another constant.
            h = hashlib.sha256(f"{arr.dtype}{arr.shape}".encode())
            h.update(memoryview(arr).cast("B"))
            name = "const." + h.hexdigest()[:20]
            entry = store.add(name, array=arr)
            g.initializer.append(external_tensor(node.output[0], entry))
        else:
            keep.append(node)
    del g.node[:]
    g.node.extend(keep)
