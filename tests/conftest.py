"""Shared fixtures. The default model is fetched into the specair cache once (~93 MB) and reused."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """The default model's GGUF file (SmolLM2-135M-Instruct Q4_1)."""
    from specair.models.default_model import default_gguf_path

    return default_gguf_path()


@pytest.fixture(scope="session")
def default_hf_dir() -> Path:
    """The default model converted to an fp32 HF dir."""
    from specair.models.default_model import default_model_dir

    return default_model_dir(progress=False)


@pytest.fixture(scope="session")
def hf_gguf(default_gguf):
    """transformers' model of the default GGUF (its own dequantization), loaded once: it takes ~20 s."""
    import torch
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it for gguf_file=
    return transformers.AutoModelForCausalLM.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name,
                                                             dtype=torch.float32).eval()
