"""Pipeline-parallel stages (docs/pipeline.md): the same tokens as the single-process engine,
Branch records included, and a dying stage ends the run quickly without leaving processes.

The tiny model with 4 layers ("tiny:4") runs as 2 and 3 stage processes over gloo on loopback."""

import os
import signal
import time

import numpy as np
import psutil
import pytest
from typer.testing import CliRunner

from rudder import LLM, SamplingParams
from rudder.branch import Branch
from rudder.cli import app
from rudder.engine import RunnerFailure
from rudder.pipeline import partition
from test_branches import Scripted, everything_but, mask_of

MODEL = "tiny:4"
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
PROMPT = [10, 20, 30, 40, 50, 60, 70]
OPTIONS = dict(kv_cache_tokens=2048, block_size=4)


@pytest.fixture(scope="module")
def single():
    return LLM(MODEL, **OPTIONS)


@pytest.fixture(scope="module", params=[(2, 2), (3, 1)], ids=["2-stages-2-micro-batches", "3-stages-1-micro-batch"])
def piped(request):
    stages, micro_batches = request.param
    llm = LLM(MODEL, pipeline_stages=stages, micro_batches=micro_batches, **OPTIONS)
    yield llm
    children = list(llm.engine.runner.children)
    llm.close()
    assert all(c.poll() is not None for c in children)


def tokens(completions):
    return [[b.token_ids for b in c.branches] for c in completions]


def test_partition_even_explicit_and_invalid():
    assert [(s.first_layer, s.num_layers) for s in partition(30, 4)] == [(0, 7), (7, 7), (14, 7), (21, 9)]
    stages = partition(4, [1, 3])
    assert stages[0].is_first and not stages[0].is_last and stages[1].is_last and list(stages[1].layers) == [1, 2, 3]
    for bad in (0, 5, [2, 1], [4, 0]):
        with pytest.raises(ValueError):
            partition(4, bad)


@pytest.mark.parametrize("batch", [1, 40])
def test_plan_round_trip_in_one_message_or_two(batch):
    from rudder.engine.step import StepArrays
    from rudder.pipeline.protocol import INLINE, PLAN_WORDS, PlanHeader, decode_plan, encode_plan

    rng = np.random.default_rng(batch)
    counts = rng.integers(1, 4, batch)
    arrays = StepArrays(counts, rng.integers(0, 50, batch), rng.integers(0, 999, int(counts.sum())),
                        rng.integers(0, 60, (batch, 5)), np.cumsum(counts) - 1)
    spec = rng.random((batch, 7))
    message, payload = encode_plan(arrays, [(3, 4)], step=9, done=7, threads=2, spec=spec)
    header = PlanHeader.of(message.numpy())
    assert message.numel() == PLAN_WORDS and (header.step, header.done, header.threads) == (9, 7, 2)
    assert (header.batch, header.tokens, header.copies, header.spec_rows) == (batch, counts.sum(), 1, batch)
    size = header.payload_size()
    # A decode step of one sequence travels as one message; 40 sequences need a second.
    assert (payload is None) == (batch == 1) and (size <= INLINE) == (batch == 1)
    body = message.numpy()[PlanHeader.WORDS:PlanHeader.WORDS + size] if payload is None else payload.numpy()
    got, copies, got_spec = decode_plan(header, body)
    for name in ("counts", "starts", "slot_mapping", "tables", "sample_rows"):
        assert np.array_equal(getattr(got, name), getattr(arrays, name)), name
    assert copies == [(3, 4)] and np.array_equal(got_spec, spec)


def test_greedy_batch_matches_single_process(single, piped):
    assert tokens(piped.generate(PROMPTS, GREEDY)) == tokens(single.generate(PROMPTS, GREEDY))


def test_seeded_sampling_and_logprobs_match(single, piped):
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=k, seed=s, ignore_eos=True, logprobs=2)
              for s, k in ((1, 0), (2, 40), (3, 5), (4, 0))]
    a, b = single.generate(PROMPTS, params), piped.generate(PROMPTS, params)
    assert tokens(a) == tokens(b)
    # Micro-batches change the batch shapes, hence float rounding: logprobs agree to ~1e-6.
    for ca, cb in zip(a, b):
        for x, y in zip(ca.logprobs, cb.logprobs, strict=True):
            assert x["token"] == y["token"] and [t for t, _ in x["top"]] == [t for t, _ in y["top"]]
            assert np.allclose([x["logprob"], *(v for _, v in x["top"])], [y["logprob"], *(v for _, v in y["top"])],
                               atol=1e-4)


def scripts(llm_for_logits):
    first = llm_for_logits.generate([PROMPT], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    base = first.token_ids
    other = (base[0] + 1) % 512
    return {
        "fast-forward": [[Branch(ff=[[100, 101, 102, 103]])]],
        "masked ff": [[Branch(mask=mask_of([base[0], other]), ff=[[other, 7], [base[0], 8, 9]])]],
        "backtrack and sample": [[Branch()]] * 5 + [[Branch(backtrack=3, mask=everything_but([base[2]]))]],
        "backtrack then ff": [[Branch(backtrack=3, ff=[[200, 201]])]],
        "pop only": [[Branch()]] * 4 + [[Branch(backtrack=2, ff=[[]])]],
        "fork": [[Branch(mask=mask_of([t])) for t in (5, 6, 7)]],
        "fork then backtrack": [[Branch()] * 3, [Branch()], [Branch(backtrack=1, mask=everything_but([base[1]]))]],
        "bad mask": [[Branch(mask=np.zeros(16, np.uint32))]],
        "stop": [[Branch()], [Branch()], []],
    }


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_python_controllers_branch_identically(single, piped, sampling):
    params = GREEDY if sampling == "greedy" else SamplingParams(max_tokens=16, temperature=1.0, seed=9,
                                                                ignore_eos=True)
    for name, script in scripts(single).items():
        ref_calls, pipe_calls = [], []
        a = single.generate([PROMPT, PROMPTS[0]], params, controllers=[Scripted(script, ref_calls), None])
        b = piped.generate([PROMPT, PROMPTS[0]], params, controllers=[Scripted(script, pipe_calls), None])
        assert tokens(a) == tokens(b), name
        assert [(c.finish_reason, c.error) for c in a[0].branches] == [(c.finish_reason, c.error) for c in b[0].branches]
        assert sorted(ref_calls) == sorted(pipe_calls), name  # forks in other micro-batches interleave
    assert piped.engine.block_manager.num_free == piped.engine.block_manager.num_blocks


@pytest.mark.parametrize("controller, arg", [("fork", "3"), ("uppercase", "12")])
def test_wasm_controller_matches(single, piped, controller, arg):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=5)
    a = single.generate(["Hi"], params, controller=controller, controller_arg=arg)
    b = piped.generate(["Hi"], params, controller=controller, controller_arg=arg)
    assert tokens(a) == tokens(b) and len(a[0].branches) == (3 if controller == "fork" else 1)


def test_cli_generate_with_pipeline_stages():
    args = ["generate", "-m", MODEL, "-t", "0", "-n", "8", "hello"]
    single = CliRunner().invoke(app, args)
    piped = CliRunner().invoke(app, args + ["--pipeline-stages", "2"])
    assert single.exit_code == piped.exit_code == 0
    assert single.stdout == piped.stdout


def test_cli_layout_and_bad_layout():
    args = ["generate", "-m", MODEL, "-t", "0", "-n", "8", "hello"]
    single = CliRunner().invoke(app, args)
    laid_out = CliRunner().invoke(app, args + ["--pipeline-stages", "3,1"])
    assert laid_out.exit_code == 0 and laid_out.stdout == single.stdout
    for bad in ("2,x", "0", "3,2"):  # not numbers, no stage, more layers than the model has
        result = CliRunner().invoke(app, args + ["--pipeline-stages", bad])
        assert result.exit_code != 0 and "error:" in result.output and "Traceback" not in result.output, bad


def test_the_same_command_runs_under_torchrun():
    """Every rank runs the same command; rank 0 prints the answer, the others serve their stage."""
    import subprocess
    import sys

    args = ["generate", "-m", MODEL, "-t", "0", "-n", "8", "hello"]
    single = CliRunner().invoke(app, args)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "rudder.cli", *args, "--pipeline-stages", "2"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert single.exit_code == 0 and run.stdout == single.stdout


def _plan_headers(runner):
    """Record the plan headers rank 0 sends (to stage 1)."""
    from rudder.pipeline.protocol import PLAN_WORDS
    from rudder.pipeline.transport import PLAN

    headers, send = [], runner.link.send

    def spy(tensor, dst, tag):
        if tag == PLAN and dst == 1 and tensor.numel() == PLAN_WORDS:
            headers.append(tensor.tolist())
        send(tensor, dst, tag)

    runner.link.send = spy
    return headers


def test_a_step_alone_gets_every_stages_threads_and_sends_are_released():
    from rudder import SHORT_OMP_SPIN

    llm = LLM(MODEL, pipeline_stages=2, micro_batches=2, pipeline_threads=1, **OPTIONS)
    try:
        runner = llm.engine.runner
        assert (runner.threads, runner.shared_threads) == (1, 2)
        headers = _plan_headers(runner)
        llm.generate(PROMPTS[:1], GREEDY)  # one sequence: every step runs alone
        assert headers and {h[8] for h in headers} == {2}
        if SHORT_OMP_SPIN:  # rank 0 computes its part with both threads too
            assert __import__("torch").get_num_threads() == 2
        headers.clear()
        llm.generate(PROMPTS, GREEDY)  # two micro-batches in flight: one thread per stage
        assert {h[8] for h in headers[:8]} == {1}
        # gloo marks a send done only when waited on: sends are released once their step's tokens
        # are back, so none of the ~100 sends of these requests is still held.
        assert len(headers) > 20 and len(runner.link.sends) <= 4
    finally:
        llm.close()


@pytest.mark.spawned_stages
def test_killing_a_stage_fails_the_run_fast_and_leaves_no_process():
    llm = LLM(MODEL, pipeline_stages=3, **OPTIONS)
    children = [c.pid for c in llm.engine.runner.children]
    req = llm.engine.add_request("hello", SamplingParams(max_tokens=100000, ignore_eos=True, temperature=0))
    other = llm.engine.add_request("world", SamplingParams(max_tokens=100000, ignore_eos=True, temperature=0))
    for _ in range(3):
        llm.engine.step()
    os.kill(children[0], signal.SIGKILL)
    start = time.monotonic()
    deltas = []
    while not (req.finished and other.finished):
        deltas += llm.engine.step()
        # Behaviour, not speed: the watchdog notices the death at once; without it the run would
        # wait out the 60 s pipeline timeout. 20 s leaves room for a loaded machine.
        assert time.monotonic() - start < 20
    failed = [d for d in deltas if d.finished]
    assert len(failed) == 2 and all(d.finish_reason == "error" for d in failed)
    assert f"stage 1 (pid {children[0]}) was killed by signal 9" in failed[0].error
    _, alive = psutil.wait_procs([psutil.Process(p) for p in children if psutil.pid_exists(p)], timeout=10)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert not [p for p in psutil.Process().children() if p.pid in children]
    with pytest.raises(RunnerFailure, match="killed by signal 9"):
        llm.engine.add_request("again")
    llm.close()


@pytest.mark.spawned_stages
def test_a_hung_stage_times_out():
    llm = LLM(MODEL, pipeline_stages=2, pipeline_timeout=1.5, **OPTIONS)
    child = llm.engine.runner.children[0]
    llm.generate(["warm up"], SamplingParams(max_tokens=2))
    os.kill(child.pid, signal.SIGSTOP)
    start = time.monotonic()
    [out] = llm.generate(["hello"], SamplingParams(max_tokens=50))
    assert out.finish_reason == "error" and "timed out after 1.5 s" in out.error
    assert time.monotonic() - start < 15  # the 1.5 s timeout fired, not the default 60 s one
    assert child.wait(timeout=5) is not None


@pytest.mark.model
def test_smollm2_two_stages_match_with_a_controller():
    params = SamplingParams(max_tokens=12, temperature=0.0)
    single = LLM("smollm2")
    a = single.generate(PROMPTS[:2], params, chat=True)
    choices = '["yes", "no", "it depends on the weather"]'
    ca = single.generate(["Will it rain tomorrow?"], SamplingParams(max_tokens=16, temperature=1.5, seed=2),
                         chat=True, controller="choices", controller_arg=choices)
    with LLM("smollm2", pipeline_stages=2) as piped:
        assert tokens(piped.generate(PROMPTS[:2], params, chat=True)) == tokens(a)
        cb = piped.generate(["Will it rain tomorrow?"], SamplingParams(max_tokens=16, temperature=1.5, seed=2),
                            chat=True, controller="choices", controller_arg=choices)
    assert tokens(ca) == tokens(cb)


def test_the_server_runs_under_torchrun(tmp_path):
    """`rudder serve --pipeline-stages 2` under torchrun: rank 0 serves HTTP, rank 1 its stage."""
    import socket
    import subprocess
    import sys

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    want = CliRunner().invoke(app, ["generate", "-m", MODEL, "-t", "0", "-n", "8", "hello"]).stdout.rstrip("\n")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = open(tmp_path / "server.log", "w+")  # a file: a pipe nobody reads would block the server when full
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                              "-m", "rudder.cli", "serve", "-m", MODEL, "--port", str(port), "--pipeline-stages", "2"],
                             env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert agent.poll() is None, open(log.name).read()[-2000:]
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(url + "/healthz").json()["status"] == "ok":
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        workers = psutil.Process(agent.pid).children(recursive=True)
        assert len(workers) >= 2  # rank 0 (the server) and rank 1 (the stage)
        r = httpx.post(url + "/v1/run", json={"prompt": "hello", "max_tokens": 8, "temperature": 0, "stream": False},
                       timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
    finally:
        agent.terminate()
        agent.wait(timeout=30)
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive


def test_activations_on_a_group_of_their_own_give_the_same_tokens(single, monkeypatch):
    """On GPUs the activations take an NCCL group while plans, specs and tokens stay on gloo.
    A second gloo group stands in for NCCL here, so that protocol runs end to end: 3 stages,
    2 micro-batches, greedy and seeded, with Branch records of every kind."""
    from rudder.pipeline.transport import SPLIT_GROUPS_ENV

    monkeypatch.setenv(SPLIT_GROUPS_ENV, "1")  # read by every rank as it joins (the stages inherit it)
    with LLM(MODEL, pipeline_stages=3, micro_batches=2, **OPTIONS) as split:
        assert split.engine.runner.link.data is not None
        assert tokens(split.generate(PROMPTS, GREEDY)) == tokens(single.generate(PROMPTS, GREEDY))
        params = SamplingParams(max_tokens=16, temperature=1.0, seed=9, ignore_eos=True)
        for name, script in scripts(single).items():
            a = single.generate([PROMPT, PROMPTS[0]], params, controllers=[Scripted(script, []), None])
            b = split.generate([PROMPT, PROMPTS[0]], params, controllers=[Scripted(script, []), None])
            assert tokens(a) == tokens(b), name
