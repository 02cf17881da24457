"""KVCache: the paged key/value tensors of a model (or of a pipeline stage's layers).

`tensor` is `[layer, K|V, block, position in block, kv head, head dim]`, in the model's activation
dtype (`model.act_dtype`: bf16 halves it for a bf16 or int8 model); which block holds which
position of which sequence is the BlockManager's business (engine/block_manager.py). The one
operation on the data itself is the copy-on-write of shared blocks, queued by the block manager
and done here before a forward pass writes anything."""

from __future__ import annotations

import torch

from ..config import ModelConfig

__all__ = ["KVCache"]


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, device, num_layers: int | None = None,
                 dtype: torch.dtype = torch.float32):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.tensor = torch.zeros(cfg.num_layers if num_layers is None else num_layers, 2, num_blocks, block_size,
                                  cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=device)

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
