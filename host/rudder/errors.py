"""Exceptions for getting and loading model files, and for a failed model runner.

They live in their own module (no torch) so that the fetcher, the GGUF converter, the loader,
the runners and the CLI can all raise or catch them without importing each other. Messages are
one line, meant for the CLI.
"""

from __future__ import annotations


class ModelFetchError(RuntimeError):
    """Downloading or verifying the bundled model failed (pip error, checksum mismatch)."""


class ModelLoadError(ValueError):
    """A checkpoint could not be read: missing files, unsupported architecture, bad tensors."""


class RunnerFailure(RuntimeError):
    """The model runner itself failed (a pipeline stage died or timed out): every request in
    flight ends with this error, and the engine takes no more requests."""
