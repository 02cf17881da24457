"""Point-to-point messages between pipeline ranks over torch.distributed process groups.

The control messages (plans, sampling specs, token ids: a few hundred bytes of host memory) go
over gloo. The activations go over the data group: the same gloo group on CPU, NCCL between GPUs
(device memory to device memory, no copy through the host).

Every gloo wait has a deadline: a peer that died closes its connections (gloo reports it at
once), and one that hangs is caught by the timeout. Either way the caller gets a `LinkError`.
NCCL waits order the GPU stream rather than block the host; a hung NCCL transfer is caught by
NCCL's own watchdog after the same timeout, which ends that process (and the coordinator's
watchdog then fails the pipeline)."""

from __future__ import annotations

import datetime
import os
import socket
from collections import deque

import torch
import torch.distributed as dist

# Message kinds (gloo tags): each (peer, tag) pair is its own ordered stream.
PLAN, ACT, SPEC, TOKENS = 1, 2, 3, 4
FOREVER = datetime.timedelta(days=365)


class LinkError(RuntimeError):
    pass


def process_group(store: dist.Store, rank: int, world: int, timeout: float, host: str | None = None):
    """A gloo group of its own (not torch's global default group), so one process can host
    several pipelines one after the other."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=timeout)
    opts._devices = [_gloo_device(host)]
    return dist.ProcessGroupGloo(dist.PrefixStore("rudder-pipeline", store), rank, world, opts)


def _gloo_device(host: str | None):
    """Where this rank's gloo connections live: `host`; else the interface GLOO_SOCKET_IFNAME
    names (as torch's own groups take it); else, under torchrun, the local address that routes to
    MASTER_ADDR, the one the other hosts can reach (the default device resolves the hostname,
    which is loopback on many hosts)."""
    if host:
        return dist.ProcessGroupGloo.create_device(hostname=host)
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    if interface:
        return dist.ProcessGroupGloo.create_device(interface=interface.split(",")[0])
    if torchrun_env() is not None:
        return dist.ProcessGroupGloo.create_device(hostname=_address_towards(os.environ["MASTER_ADDR"]))
    return dist.ProcessGroupGloo.create_default_device()


def _address_towards(peer: str) -> str:
    """This host's address on the route to `peer` (a UDP connect sends nothing)."""
    family, kind, _, _, address = socket.getaddrinfo(peer, 1, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind) as s:
        s.connect(address)
        return s.getsockname()[0]


def rank_device(device: str, local_rank: int) -> torch.device:
    """The device of the rank that is `local_rank` on its host: "cpu" for every rank; "cuda"
    (or "cuda:N") gives each rank a GPU of its own (N + local_rank), as NCCL needs."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"pipeline stages run on cpu or cuda, not {device!r}")
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        raise ValueError(f"--device {device}: CUDA with NCCL is not available in this torch build")
    index = (dev.index or 0) + local_rank
    if index >= torch.cuda.device_count():
        raise ValueError(f"pipeline rank {local_rank} needs GPU {index}, but this host has "
                         f"{torch.cuda.device_count()} (each stage takes a GPU of its own)")
    return torch.device("cuda", index)


# Tests set this to give the activations a gloo group of their own on CPU, as NCCL has on GPUs:
# the two-group protocol then runs end to end on a host without a GPU.
SPLIT_GROUPS_ENV = "RUDDER_PIPELINE_SPLIT_GROUPS"


def data_group(store: dist.Store, rank: int, world: int, timeout: float, device: torch.device,
               host: str | None = None):
    """The NCCL group for activations between GPUs; None on CPU (they share the gloo group)."""
    if device.type != "cuda":
        if os.environ.get(SPLIT_GROUPS_ENV) == "1":
            return process_group(dist.PrefixStore("data", store), rank, world, timeout, host)
        return None
    torch.cuda.set_device(device)  # NCCL's communicators use the current device
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = datetime.timedelta(seconds=timeout)
    return dist.ProcessGroupNCCL(dist.PrefixStore("rudder-pipeline-nccl", store), rank, world, opts)


def connect(store: dist.Store, rank: int, world: int, timeout: float, device: torch.device,
            host: str | None = None) -> "Link":
    """This rank's link: the gloo group, plus the NCCL group on GPUs."""
    return Link(process_group(store, rank, world, timeout, host), timeout,
                data_group(store, rank, world, timeout, device, host), device)


class Link:
    """Sends and receives of one rank. Sends never block; each keeps its tensor alive until it is
    released. gloo only marks a send complete when it is waited on, so sends are released by
    step: once the coordinator has a step's tokens, every message of that step and of the steps
    before it was received (a stage takes a step's messages before the next stage can finish
    it), and waiting on those sends returns at once."""

    def __init__(self, group, timeout: float, data=None, device: torch.device | str = "cpu"):
        self.group = group
        self.data = data  # the activations' group when it is not `group` (NCCL)
        self.device = torch.device(device)  # where received activations are put
        self.timeout = datetime.timedelta(seconds=timeout)
        self.step = 0  # the step the next sends belong to
        self.sends: deque[tuple[int, object, torch.Tensor]] = deque()  # (step, work, tensor), in step order

    def _group(self, tag: int):
        return self.data if tag == ACT and self.data is not None else self.group

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        group = self._group(tag)
        # gloo reads host memory: what goes over it (everything but NCCL's activations; a last
        # stage's logits rows for a speculative verification, say) leaves the GPU first, as
        # `recv` receives it into host memory.
        tensor = tensor.contiguous()
        if group is not self.data and tensor.device.type != "cpu":
            tensor = tensor.cpu()
        try:
            self.sends.append((self.step, group.send([tensor], dst, tag), tensor))
        except RuntimeError as e:
            raise LinkError(f"send to rank {dst} failed: {_short(e)}") from e

    def recv(self, shape, dtype: torch.dtype, src: int, tag: int, forever: bool = False) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=self.device if tag == ACT else "cpu")
        try:
            self._group(tag).recv([out], src, tag).wait(FOREVER if forever else self.timeout)
        except RuntimeError as e:
            if "Timed out" in str(e):
                raise LinkError(f"timed out after {self.timeout.total_seconds():g} s waiting for rank {src}") from e
            raise LinkError(f"lost rank {src}: {_short(e)}") from e
        return out

    def finish_sends(self, through_step: float) -> None:
        """Forget the sends of steps up to `through_step`, whose tokens the coordinator has."""
        while self.sends and self.sends[0][0] <= through_step:
            try:
                self.sends.popleft()[1].wait(self.timeout)
            except RuntimeError as e:
                raise LinkError(f"send failed: {_short(e)}") from e

    def flush(self) -> None:
        """Wait for every send so far to be received."""
        self.finish_sends(float("inf"))


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if text.startswith("[") and "] " in text:  # drop gloo's source location
        text = text.split("] ", 1)[1]
    return text.split(". This is typically", 1)[0]


def torchrun_env() -> tuple[int, int] | None:
    """(rank, world size) when launched by torchrun (or any env:// launcher), else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None
