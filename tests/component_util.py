"""Python and JavaScript controllers for the tests, built once per content hash with the
project's own tool chain (rudder build's code path: componentize-py, componentize-js) and
kept under $RUDDER_HOME/controllers/."""

from __future__ import annotations

import functools
from pathlib import Path

from rudder.controller.component_build import component_cached

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "controllers"


@functools.cache
def example(name: str) -> bytes:
    """The component of controllers/py/<name>.py or controllers/js/<name>.js ('js/digits')."""
    lang, _, stem = name.rpartition("/")
    folder = EXAMPLES / (lang or "py")
    path = folder / f"{stem}.{'js' if lang == 'js' else 'py'}"
    return component_cached(path).read_bytes()


def source(tmp: Path, name: str, text: str) -> Path:
    path = tmp / name
    path.write_text(text)
    return path


@functools.cache
def built(text: str, suffix: str = ".py", name: str = "ctl") -> bytes:
    """A controller from source text (tests' hostile ones), built once per content."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{name}{suffix}"
        path.write_text(text)
        return component_cached(path).read_bytes()
