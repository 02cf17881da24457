"""Wasm controllers driving the real engine: built-in controllers end to end on SmolLM2 through
`rudder run`, and hostile controllers (both shapes: tests/shapes.py) failing alone while a good
request is undisturbed."""

import json

import pytest
from typer.testing import CliRunner

from controller_wat import busy_wat, controller_wat, wasm_of
from rudder import LLM, SamplingParams
from rudder.cli import app
from rudder.controller import ControllerError
from shapes import CORE, SHAPES

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


# -- hostile controllers next to a good request (tiny model: fast) -----------------------------
# name -> (module, argument, kind); a component's memory is hidden from the host, so there a
# memory bomb's trap is a trap (test_hostile.py, test_memory_bomb).

HOSTILE = {
    "infinite loop": (busy_wat(), (2**31).to_bytes(4, "little"), "timeout"),
    "trap": (controller_wat(mid="unreachable"), b"", "trap"),
    "garbage pointer": (controller_wat(mid="(i32.const -16)"), b"", "invalid_result"),
    "null result": (controller_wat(mid="(i32.const 0)"), b"", "invalid_result"),
    # grows a page at a time until memory.grow says no (-1), then reads out of bounds
    "memory bomb": (controller_wat(mid="""
        (block $oom (loop $l (br_if $oom (i32.eq (memory.grow (i32.const 1)) (i32.const -1))) (br $l)))
        (i32.load (i32.const 0x7fffffff))"""), b"", "oom"),
    # the same in steps of 16 pages: the last grow that fails leaves memory 14 pages short of the limit
    "memory bomb in big steps": (
        controller_wat(mid="""
        (block $oom (loop $l (br_if $oom (i32.eq (memory.grow (i32.const 16)) (i32.const -1))) (br $l)))
        (i32.load (i32.const 0x7fffffff))"""), b"", "oom"),
}


@pytest.fixture(scope="module")
def tiny():
    return LLM("tiny", kv_cache_tokens=2048, block_size=8)


def _hostile_cases():
    for shape in SHAPES:
        for name in sorted(HOSTILE):
            wat, arg, kind = HOSTILE[name]
            if shape is not CORE and name.startswith("memory bomb"):
                kind = "trap"
            yield pytest.param(shape.wasm(wat), arg, kind, id=f"{name}-{shape}")


@pytest.mark.parametrize("wasm,arg,kind", list(_hostile_cases()))
def test_hostile_controller_fails_alone(tiny, wasm, arg, kind):
    prompt = "The good request"
    [solo] = tiny.generate([prompt], GREEDY)
    hostile = tiny.start_controller(wasm, arg)
    good, bad = tiny.generate([prompt, "a hostile one"], GREEDY, controllers=[None, hostile])
    assert good.token_ids == solo.token_ids and good.finish_reason == "length"
    assert bad.finish_reason == "error" and bad.error.startswith(f"controller {kind}: "), bad.error
    assert tiny.engine.block_manager.num_free == tiny.engine.block_manager.num_blocks
    assert not tiny.engine.has_unfinished()


def test_a_module_that_fails_to_load_is_a_clear_error(tiny):
    with pytest.raises(ControllerError, match="not a core WebAssembly module"):
        tiny.start_controller(b"\0asm garbage", "")
    with pytest.raises(ValueError, match="no such controller file"):
        tiny.start_controller("missing.wasm", "")


# -- built-in controllers on SmolLM2, through the CLI ------------------------------------------


def rudder_run(*args: str) -> tuple[str, str]:
    result = CliRunner().invoke(app, ["run", *args])
    assert result.exit_code == 0, result.output + (result.stderr if result.stderr_bytes else "")
    return result.stdout, result.stderr


@pytest.mark.model
def test_run_force_appends_exactly_the_text():
    text = "Sure! Here is a haiku about the sea:"
    out, _ = rudder_run("--controller", "force", "--arg", text, "--chat", "Write a haiku.")
    assert out == text + "\n"


@pytest.mark.model
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_run_choices_gives_one_of_the_choices(tmp_path, seed):
    choices = ["yes", "no", "it depends on the weather"]
    arg = tmp_path / "choices.json"
    arg.write_text(json.dumps(choices))
    out, _ = rudder_run("--controller", "choices", "--arg", f"@{arg}", "--chat", "--seed", str(seed),
                        "--temperature", "1.5", "Will it rain tomorrow?")
    assert out.rstrip("\n") in choices


@pytest.mark.model
def test_run_uppercase_capitalises_every_fourth_byte():
    out, _ = rudder_run("--controller", "uppercase", "--arg", "20", "--chat", "--seed", "4", "Tell me a story.")
    text = out.rstrip("\n").encode()
    assert len(text) >= 8
    assert all(65 <= text[i] <= 90 for i in range(0, len(text), 4)), text


@pytest.mark.model
def test_run_fork_shows_every_branch():
    out, err = rudder_run("--controller", "fork", "--arg", "3", "--chat", "--seed", "5", "--max-tokens", "12",
                          "--log", "Write a greeting.")
    bodies = [part.split("---\n", 1)[1].strip() for part in out.split("--- branch ")[1:]]
    assert len(bodies) == 3 and all(bodies)
    assert len(set(bodies)) > 1, "forks sample independently"
    assert "this is fork 2 of 3" in err


@pytest.mark.model
def test_run_backtrack_takes_the_banned_word_back():
    prompt = "Repeat exactly, five times: the sea, the sea, the sea, the sea, the sea"
    out, err = rudder_run("--controller", "backtrack", "--arg", " sea", "--chat", "--temperature", "0",
                          "--max-tokens", "40", "--log", prompt)
    assert " sea" not in out
    assert "backtrack" in err.lower()  # the controller logged that it took the word back


@pytest.mark.model
def test_run_reports_a_bad_argument_without_a_traceback():
    result = CliRunner().invoke(app, ["run", "--controller", "choices", "--arg", "not json", "hi"])
    assert result.exit_code == 1
    assert "error: " in result.stderr and "Traceback" not in result.output + result.stderr
    result = CliRunner().invoke(app, ["run", "--controller", "no-such-controller", "hi"])
    assert result.exit_code == 1 and "no-such-controller" in result.stderr


def test_the_readme_controller_builds_and_does_what_it_says(tiny, tmp_path):
    """The README's "Writing one" example, compiled with the SDK and run on the tiny model."""
    from pathlib import Path

    from rudder.controller.build import build_controller

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    source = readme.split("### Writing one", 1)[1].split("```c\n", 1)[1].split("```", 1)[0]
    (tmp_path / "digits.c").write_text(source)
    wasm = build_controller([tmp_path / "digits.c"], tmp_path / "digits.wasm")
    for seed in range(3):
        [out] = tiny.generate(["How many?"], SamplingParams(max_tokens=20, temperature=1.0, seed=seed),
                              controller=wasm)
        assert out.text and out.text.isdigit() and len(out.token_ids) <= 6, out


def test_a_request_can_lower_its_controller_limits_but_not_raise_them(tiny):
    slow = wasm_of(busy_wat())
    spins = (300_000).to_bytes(4, "little")  # well under the default 25 ms per step
    [ok] = tiny.generate(["x"], GREEDY, controller=slow, controller_arg=spins)
    assert ok.finish_reason == "length"
    # Seconds of work per step: past a lowered limit on any machine (3M spins took under the
    # lowered deadline's 2-4 ms on a fast one).
    [cut] = tiny.generate(["x"], GREEDY, controller=slow, controller_arg=(2_000_000_000).to_bytes(4, "little"),
                          controller_limits={"mid_process_ms": 0.5})
    assert cut.finish_reason == "error" and "timeout" in cut.error
    ctl = tiny.start_controller(slow, spins, {"mid_process_ms": 10_000})
    assert ctl.request.limits.mid_process_ms == 25  # capped by the server's limit
    ctl.close()
    with pytest.raises(ValueError, match="unknown controller limit"):
        tiny.start_controller(slow, spins, {"mid_process_msec": 1})


def test_cli_limit_flag_is_validated():
    result = CliRunner().invoke(app, ["run", "--model", "tiny", "--controller", "fork", "--limit", "max_forks",
                                      "x"])
    assert result.exit_code == 1 and "expected KEY=NUMBER" in result.stderr
    result = CliRunner().invoke(app, ["run", "--model", "tiny", "--controller", "fork", "--arg", "4",
                                      "--limit", "max_forks=2", "-n", "3", "x"])
    assert result.exit_code == 1 and "fork" in result.stderr
