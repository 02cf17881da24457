"""Python and JavaScript controllers for the tests, built with the project's own tool chain (rudder
build's code path: componentize-py, componentize-js) and kept under $RUDDER_HOME/controllers/.

A real component costs a build and a compile of tens of seconds of CPU (CPython or a JavaScript
engine is inside), so the offline suite uses two: tests/components/sdk.py and sdk.js, whose
argument picks the case. `prebuild()` builds and compiles them once per session before any test
runs (conftest.py), both at once, under a lock that parallel test processes share. The shipped
examples (controllers/py, controllers/js) run on SmolLM2 in the `model` tests (`example`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import functools
from pathlib import Path

from rudder.controller.component_build import component_cached

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "controllers"
SDK_CASES = {"py": REPO / "tests" / "components" / "sdk.py", "js": REPO / "tests" / "components" / "sdk.js"}


@contextlib.contextmanager
def build_lock(name: str):
    """One builder of `name` at a time across processes (pytest workers): the others then find
    it built."""
    from rudder.paths import controllers_dir

    folder = controllers_dir()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f".tests-{name.replace('/', '-')}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@functools.cache
def sdk(lang: str) -> bytes:
    """The test component of the Python ("py") or JavaScript ("js") SDK (tests/components/sdk.*)."""
    with build_lock(f"sdk-{lang}"):
        return component_cached(SDK_CASES[lang]).read_bytes()


@functools.cache
def example(name: str) -> bytes:
    """The component of controllers/py/<name>.py or controllers/js/<name>.js ('js/digits')."""
    lang, _, stem = name.rpartition("/")
    folder = EXAMPLES / (lang or "py")
    path = folder / f"{stem}.{'js' if lang == 'js' else 'py'}"
    with build_lock(name):
        return component_cached(path).read_bytes()


def prebuild() -> None:
    """Build both test components at once, and compile them into $RUDDER_HOME's compiled-code
    cache, where every runtime of the tests with the default cache finds them."""
    from rudder.controller import ControllerRuntime
    from rudder.tokenizer import Tokenizer

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        wasms = list(pool.map(sdk, SDK_CASES))
    with ControllerRuntime(Tokenizer.byte_level(512)) as rt, build_lock("compile"):
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(rt.load, wasms))
