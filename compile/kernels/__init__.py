"""specair's own row-independent kernels: the onnxruntime custom-op library with `specair.ort::MatMulBlocks`
(linear layers over GGUF's block formats read exactly, blocks.h, laid out by formats.py), `specair.ort::CacheAttention` (attention over the KV cache, attention.h) and
`specair.ort::FilteredProbs` (top-k/top-p without a sort of the vocabulary, sampling.h), built from these
sources on first use and cached by a hash of them.

The library needs onnxruntime's C API headers at build time only (onnxruntime hands its API over at load, so
the library links nothing of it and loads into the pip wheel's runtime). The wheel ships no headers; they are
taken, in order, from `$ONNXRUNTIME_INCLUDE_DIR`, `/usr/include/onnxruntime` (Debian 13's
libonnxruntime-dev), a copy in the cache, or else Debian 13's libonnxruntime-dev package fetched with
`apt-get download` into the cache (its C API is versioned: headers of 1.21 serve any later runtime).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np

from specair.models.default_model import cache_dir
from specair.compile.kernels.formats import FORMATS, PackedWeight  # noqa: F401 (re-exported)
from specair.models.errors import SpecairError

OP, ATTENTION, FILTER, DOMAIN = "MatMulBlocks", "CacheAttention", "FilteredProbs", "specair.ort"
RMSNORM, SWIGLU, GATHER = "RMSNorm", "SwiGLU", "GatherBlocks"
_SOURCES = ("blocks.h", "blocks.cpp", "rowwise.h", "rowwise.cpp", "exp.h", "lanes.h", "lanes_exp.inc", "attention.h", "attention_simd.inc", "attention.cpp", "sampling.h",
            "sampling.cpp", "ort_ops.cpp")
_HERE = Path(__file__).parent
_DEBIAN_PACKAGE = "libonnxruntime-dev"
_DEBIAN_SOURCE = "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main"


class KernelUnavailable(SpecairError):
    """specair's int4 kernel library could not be built here (no C++ compiler, no onnxruntime headers)."""


def source_hash() -> str:
    """Hash of the kernel sources: names the built library and enters the artifact manifest."""
    h = hashlib.sha256()
    for name in _SOURCES:
        h.update((_HERE / name).read_bytes())
    return h.hexdigest()[:16]


def _headers() -> Path:
    for d in (os.environ.get("ONNXRUNTIME_INCLUDE_DIR"), "/usr/include/onnxruntime",
              cache_dir() / "onnxruntime-headers" / "usr/include/onnxruntime"):
        if d and (Path(d) / "onnxruntime_cxx_api.h").exists():
            return Path(d)
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise KernelUnavailable("specair's int4 kernel needs onnxruntime's C API headers to build: set "
                                "ONNXRUNTIME_INCLUDE_DIR to a folder holding onnxruntime_cxx_api.h")
    root = cache_dir() / "onnxruntime-headers"
    with tempfile.TemporaryDirectory(prefix="specair-apt-") as tmp:
        t = Path(tmp)
        (t / "lists/partial").mkdir(parents=True)
        (t / "cache/archives/partial").mkdir(parents=True)
        (t / "sources.list").write_text(_DEBIAN_SOURCE + "\n")
        opts = [f"-o=Dir::Etc::sourcelist={t / 'sources.list'}", "-o=Dir::Etc::sourceparts=-",
                f"-o=Dir::State::Lists={t / 'lists'}", f"-o=Dir::Cache={t / 'cache'}", "-o=APT::Sandbox::User=root"]
        try:
            subprocess.run(["apt-get", *opts, "update"], check=True, capture_output=True, timeout=600)
            subprocess.run(["apt-get", *opts, "download", _DEBIAN_PACKAGE], check=True, capture_output=True,
                           cwd=t, timeout=600)
            deb = next(t.glob(f"{_DEBIAN_PACKAGE}_*.deb"))
            staging = Path(tempfile.mkdtemp(prefix="headers-", dir=root.parent if root.parent.exists() else None))
            subprocess.run(["dpkg-deb", "-x", str(deb), str(staging)], check=True, capture_output=True)
        except (subprocess.SubprocessError, StopIteration, OSError) as e:
            detail = getattr(e, "stderr", b"") or b""
            raise KernelUnavailable(f"could not fetch onnxruntime's C API headers ({_DEBIAN_PACKAGE} from Debian "
                                    f"13): {e} {detail.decode(errors='replace')[-300:]}; set ONNXRUNTIME_INCLUDE_DIR"
                                    ) from e
    root.parent.mkdir(parents=True, exist_ok=True)
    if not root.exists():
        staging.rename(root)
    return root / "usr/include/onnxruntime"


@lru_cache(maxsize=None)
def library() -> Path:
    """The built custom-op library (built now if the cache lacks it); KernelUnavailable if it cannot be."""
    out = cache_dir() / "kernels" / f"libspecair_ort-{source_hash()}.so"
    if out.exists():
        return out
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        raise KernelUnavailable("specair's int4 kernel is built from C++ on first use and no compiler was found "
                                "(install g++, e.g. apt-get install g++, or set CXX)")
    include = _headers()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    cmd = [cxx, "-O3", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", f"-I{include}",
           *(str(_HERE / s) for s in _SOURCES if s.endswith(".cpp")), "-o", str(tmp)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        tmp.unlink(missing_ok=True)
        raise KernelUnavailable(f"building specair's int4 kernel failed ({' '.join(cmd)}):\n{r.stderr[-2000:]}")
    tmp.rename(out)
    return out


@lru_cache(maxsize=None)
def enabled() -> bool:
    """Whether graphs use these kernels: the library builds here and `SPECAIR_KERNELS` is not "onnxruntime"
    (onnxruntime's own MatMulNBits and GroupQueryAttention, whose verify rows round differently from decode
    rows). A library that cannot be built falls back the same way, with a warning that says why."""
    if os.environ.get("SPECAIR_KERNELS", "specair") == "onnxruntime":
        return False
    try:
        library()
    except KernelUnavailable as e:
        logging.getLogger(__name__).warning("specair's kernels are unavailable, so onnxruntime's own run instead "
                                            "and speculation on this path may change greedy output: %s", e)
        return False
    return True


def isa(kernel: str = "blocks") -> str:
    """The instruction set a kernel runs on this CPU: the block kernels' avx512vnni, avxvnni, avx2 or portable,
    attention's avx512, avx2 or portable (`SPECAIR_ISA` caps both)."""
    fn = getattr(ctypes.CDLL(str(library())), f"specair_{kernel}_isa")
    fn.restype = ctypes.c_char_p
    return fn().decode()


def dequantize(w: PackedWeight) -> np.ndarray:
    """The float32 weights [N, K] a packed weight holds, as the kernel reads them (for tests and checks)."""
    fn = ctypes.CDLL(str(library())).specair_blocks_dequantize
    fn.restype = ctypes.c_int
    out = np.empty((w.N, w.K), dtype=np.float32)
    rec = np.ascontiguousarray(w.records)
    sup = None if w.super is None else np.ascontiguousarray(w.super)
    ptr = lambda a: ctypes.c_void_p(0 if a is None else a.ctypes.data)  # noqa: E731
    if fn(w.format.encode(), ctypes.c_int64(w.K), ctypes.c_int64(w.N), ptr(rec), ptr(sup), ptr(out)):
        raise ValueError(f"the kernel library has no format {w.format!r}")
    return out
