"""The pipeline's transport (rudder.pipeline.transport): which group each message takes, and the
device each rank gets. On CPU everything is gloo; on GPUs the activations take an NCCL group of
their own, modelled here by a second gloo group (the routing is the same code)."""

import threading

import pytest
import torch
import torch.distributed as dist
from typer.testing import CliRunner

from rudder.cli import app
from rudder.pipeline.transport import ACT, PLAN, TOKENS, Link, LinkError, process_group, rank_device


def _groups(prefix: str, store, world: int = 2):
    """One gloo group per rank, all built at once (each waits for the others)."""
    groups = [None] * world

    def build(rank):
        groups[rank] = process_group(dist.PrefixStore(prefix, store), rank, world, timeout=10)

    threads = [threading.Thread(target=build, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return groups


def test_activations_take_the_data_group_and_the_rest_the_control_group():
    store = dist.HashStore()
    control, data = _groups("control", store), _groups("data", store)
    sender = Link(control[0], timeout=10, data=data[0])
    act, plan = torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.tensor([7, 8], dtype=torch.int64)
    sender.send(act, 1, ACT)
    sender.send(plan, 1, PLAN)
    # Received on the raw groups: a message sent on the other group would never arrive here.
    got_act, got_plan = torch.empty(2, 3), torch.empty(2, dtype=torch.int64)
    data[1].recv([got_act], 0, ACT).wait()
    control[1].recv([got_plan], 0, PLAN).wait()
    assert torch.equal(got_act, act) and torch.equal(got_plan, plan)
    # And a Link receives activations from the data group, into its device.
    receiver = Link(control[1], timeout=10, data=data[1], device="cpu")
    doubled = act * 2
    work = data[0].send([doubled], 1, ACT)  # a gloo send completes when it is received
    assert torch.equal(receiver.recv((2, 3), torch.float32, 0, ACT), doubled)
    work.wait()
    sender.flush()
    assert not sender.sends


def test_a_recv_nobody_answers_times_out_with_a_clear_error():
    store = dist.HashStore()
    groups = _groups("lonely", store)
    link = Link(groups[1], timeout=0.5)
    with pytest.raises(LinkError, match="timed out after 0.5 s waiting for rank 0"):
        link.recv(3, torch.int32, 0, TOKENS)


def test_rank_devices():
    assert rank_device("cpu", 3) == torch.device("cpu")
    with pytest.raises(ValueError, match="cpu or cuda"):
        rank_device("meta", 0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA with NCCL is not available"):
            rank_device("cuda", 1)
    else:
        assert rank_device("cuda", 0) == torch.device("cuda", 0)
        with pytest.raises(ValueError, match="each stage takes a GPU of its own"):
            rank_device("cuda", torch.cuda.device_count())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a host without CUDA")
def test_cli_pipeline_on_cuda_without_cuda_is_one_line():
    result = CliRunner().invoke(app, ["generate", "-m", "tiny:4", "-n", "4", "--pipeline-stages", "2", "--device",
                                      "cuda", "hello"])
    # --device is checked before any model loads or stage starts: one line, no traceback.
    assert result.exit_code != 0, result.output
    assert result.output.startswith("error: ") and result.output.count("\n") == 1, result.output
    assert "--device cuda: no CUDA device is available to this torch" in result.output
    assert "Traceback" not in result.output


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_gpu_tensor_on_the_control_group_leaves_the_gpu_first():
    # A last stage on a GPU sends logits rows back over gloo (speculative verification); raw gloo
    # would read the device pointer as host memory (writev: Bad address, and the process aborts).
    groups = _groups("gpu-control", dist.HashStore())
    sender, receiver = Link(groups[0], timeout=10, device="cuda"), Link(groups[1], timeout=10, device="cuda")
    rows = torch.arange(12, dtype=torch.float32, device="cuda").reshape(3, 4)
    sender.send(rows.t(), 1, TOKENS)  # a non-contiguous view as well
    got = receiver.recv((4, 3), torch.float32, 0, TOKENS)
    sender.flush()
    assert got.device.type == "cpu" and torch.equal(got, rows.t().cpu())
