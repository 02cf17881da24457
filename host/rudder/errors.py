"""Exceptions for getting and loading model files.

They live in their own module so that the fetcher, the GGUF converter and the loader can
all raise them without importing each other. Messages are one line, meant for the CLI.
"""

from __future__ import annotations


class ModelFetchError(RuntimeError):
    """Downloading or verifying the bundled model failed (pip error, checksum mismatch)."""


class ModelLoadError(ValueError):
    """A checkpoint could not be read: missing files, unsupported architecture, bad tensors."""
