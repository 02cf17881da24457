"""KVCache: the paged key/value tensors of a model (or of a pipeline stage's layers), and how many
token positions fit the memory the machine has.

`tensor` is `[layer, K|V, block, position in block, kv head, head dim]`, in the model's activation
dtype (`model.act_dtype`: bf16 halves it for a bf16 or int8 model); which block holds which
position of which sequence is the BlockManager's business (engine/block_manager.py). The one
operation on the data itself is the copy-on-write of shared blocks, queued by the block manager
and done here before a forward pass writes anything.

On the CPU the tensor is an anonymous private mapping: its pages are zero until first written,
so a cache sized for the machine costs memory only as blocks are used."""

from __future__ import annotations

import logging
import math
import mmap

import torch

from ..config import ModelConfig

__all__ = ["KVCache", "available_memory", "bytes_per_token", "tokens_for_memory"]

log = logging.getLogger("rudder.engine")


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, device, num_layers: int | None = None,
                 dtype: torch.dtype = torch.float32):
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (cfg.num_layers if num_layers is None else num_layers, 2, num_blocks, block_size,
                 cfg.num_kv_heads, cfg.head_dim)
        self.tensor = _zeros(shape, dtype, torch.device(device))

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: block `src` into block `dst`, for every layer, K and V."""
        kv = self.tensor
        for src, dst in copies:
            kv[:, :, dst].copy_(kv[:, :, src])


def _zeros(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=dtype).view(shape)  # the tensor keeps the mapping alive


def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """KV cache bytes one token position takes, all layers."""
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


def available_memory(device) -> int:
    """Bytes free for the KV cache on `device`: the kernel's MemAvailable for the CPU, the free
    device memory for a GPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return (2 ** 30) * 4  # no /proc/meminfo: assume a small machine's 4 GiB


def tokens_for_memory(cfg: ModelConfig, dtype: torch.dtype, device, share: float, most: int,
                      available: int | None = None) -> int:
    """KV cache token positions that `share` of the available memory holds, at most `most` (more
    than every sequence at full context could use), and logged."""
    available = available_memory(device) if available is None else available
    per_token = bytes_per_token(cfg, dtype)
    tokens = max(1, min(most, int(available * share) // per_token))
    log.info("KV cache: %d tokens (%.2f GiB, %.0f%% of the %.1f GiB available; %d KiB per token)%s", tokens,
             tokens * per_token / 2 ** 30, 100 * share, available / 2 ** 30, per_token // 1024,
             " - as many as max_seqs sequences at full context can use" if tokens == most else "")
    return tokens
