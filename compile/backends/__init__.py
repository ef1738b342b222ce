"""Compile backends, imported lazily so a missing package or device only matters when it is asked for."""

from __future__ import annotations

import importlib

from specair.compile.backends.base import Backend, BackendUnavailable
from specair.models.errors import InputError

BACKENDS = {
    "eager": ("eager", "EagerBackend"),
    "inductor": ("inductor", "InductorBackend"),
    "aoti": ("aoti", "AotiBackend"),
    "onnx": ("onnx", "OnnxBackend"),
    "cuda": ("cuda", "CudaGraphBackend"),
    "npu": ("npu", "NpuBackend"),
}


def get_backend(name: str, threads: int | None = None, *, quantize: str | None = None, **options: object) -> Backend:
    """An instance of the named backend (backend-specific `options`, e.g. onnx's self_contained);
    BackendUnavailable when its package or hardware is missing. `quantize` ("int4", "int8"; None or "none":
    float weights) is weight-only quantization, an option of the onnx backend only."""
    if name not in BACKENDS:
        raise BackendUnavailable(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if quantize not in (None, "none"):
        if name != "onnx":
            raise InputError(f"--quantize {quantize} is an option of the onnx backend (onnxruntime's quantized "
                             f"operators), not of {name!r}")
        options["quantize"] = quantize
    module, cls_name = BACKENDS[name]
    try:
        cls = getattr(importlib.import_module(f"specair.compile.backends.{module}"), cls_name)
    except ImportError as e:
        raise BackendUnavailable(f"backend {name!r} cannot be imported here: {e}") from None
    cls.check_available()
    return cls(threads=threads, **options)
