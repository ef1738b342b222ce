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
