"""KVCache: the paged key/value tensors of a model (or of a pipeline stage's layers), and how many
token positions fit the memory the machine has.

`tensor` is `[layer, K|V, block, position in block, kv head, head dim]`, in the model's activation
dtype (`model.act_dtype`: bf16 halves it for a bf16 or int8 model); which block holds which
position of which sequence is the BlockManager's business (engine/block_manager.py).

A bf16 cache that native/attention.c reads keeps each block's K and V *in pairs*, shape `[layer,
K|V, block, kv head, block_size * head_dim]`: keys as `[head_dim / 2][position][2]` (the two
dimensions of a pair side by side, one pair of every position in a row) and values as
`[position / 2][head_dim][2]` (two positions side by side). A tile of 16 keys then meets a query's
pair of dimensions in one load, and a pair of weights two keys' values, with no shuffling (the
kernel's products are bf16 pairs). The tensor's rank says which layout it is; `write_slots` and
`read_blocks` read and write either. The one
operation on the data itself is the copy-on-write of shared blocks, queued by the block manager
and done here before a forward pass writes anything.

On the CPU the tensor is an anonymous private mapping: its pages are zero until first written,
so a cache sized for the machine costs memory only as blocks are used."""

from __future__ import annotations

import logging
import math
import mmap

import torch

from .. import kernels
from ..config import ModelConfig

__all__ = ["KVCache", "available_memory", "block_size_of", "bytes_per_token", "is_paired", "paired_layout",
           "read_blocks", "tokens_for_memory", "write_slots"]

log = logging.getLogger("rudder.engine")


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, device, num_layers: int | None = None,
                 dtype: torch.dtype = torch.float32):
        self.block_size = block_size
        self.num_blocks = num_blocks
        layers = cfg.num_layers if num_layers is None else num_layers
        if paired_layout(cfg, block_size, dtype, device):
            shape = (layers, 2, num_blocks, cfg.num_kv_heads, block_size * cfg.head_dim)
        else:
            shape = (layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.tensor = _zeros(shape, dtype, torch.device(device))

    @property
    def paired(self) -> bool:
        return is_paired(self.tensor[0, 0])

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


def paired_layout(cfg: ModelConfig, block_size: int, dtype: torch.dtype, device) -> bool:
    """Whether a cache keeps its blocks in pairs: where native/attention.c reads it with bf16
    arithmetic (head_dim a multiple of 32) and a block holds whole tiles of 16 keys."""
    return (torch.device(device).type == "cpu" and dtype == torch.bfloat16 and cfg.head_dim % 32 == 0
            and block_size % 16 == 0 and kernels.available(device))


def is_paired(layer_cache: torch.Tensor) -> bool:
    """Whether one layer's K (or V) cache, `tensor[layer, 0]`, is in pairs (rank 3, not 4)."""
    return layer_cache.dim() == 3


def block_size_of(tensor: torch.Tensor, head_dim: int) -> int:
    """The positions a block holds, from a cache tensor of either layout (all layers, K and V)."""
    return tensor.shape[4] // head_dim if tensor.dim() == 5 else tensor.shape[3]


def _pair_views(k_cache: torch.Tensor, v_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A paired layer's K as [block, position, kv head, head_dim / 2, 2] and V as [block,
    position / 2, position % 2, kv head, head_dim]: views, to index and to assign through."""
    blocks, kv_heads, n = k_cache.shape
    bs = n // head_dim
    keys = k_cache.view(blocks, kv_heads, head_dim // 2, bs, 2).permute(0, 3, 1, 2, 4)
    values = v_cache.view(blocks, kv_heads, bs // 2, head_dim, 2).permute(0, 2, 4, 1, 3)
    return keys, values


def write_slots(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> None:
    """k and v ([T, kv heads, head dim], the cache's dtype) into their flat slots (block *
    block_size + position) of one layer's caches."""
    if not is_paired(k_cache):
        blocks, bs = k_cache.shape[:2]
        k_cache.view(blocks * bs, *k_cache.shape[2:]).index_copy_(0, slots, k)
        v_cache.view(blocks * bs, *v_cache.shape[2:]).index_copy_(0, slots, v)
        return
    T, kv_heads, head_dim = k.shape
    bs = k_cache.shape[2] // head_dim
    keys, values = _pair_views(k_cache, v_cache, head_dim)
    block, at = slots // bs, slots % bs
    keys[block, at] = k.view(T, kv_heads, head_dim // 2, 2)
    values[block, at // 2, at % 2] = v


def read_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
                head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of `blocks`, in order: each [len(blocks) * block_size, kv heads, head dim]."""
    if not is_paired(k_cache):
        kv_heads = k_cache.shape[2]
        return (k_cache.index_select(0, blocks).view(-1, kv_heads, head_dim),
                v_cache.index_select(0, blocks).view(-1, kv_heads, head_dim))
    kv_heads = k_cache.shape[1]
    keys, values = _pair_views(k_cache, v_cache, head_dim)
    return keys[blocks].reshape(-1, kv_heads, head_dim), values[blocks].reshape(-1, kv_heads, head_dim)


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
