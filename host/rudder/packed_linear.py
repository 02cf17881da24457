"""Linear layers with their weights pre-packed for oneDNN, for fp32 on the CPU.

`F.linear` on the CPU goes to MKL's sgemm, which packs the weight matrix again on every call and,
on AMD processors, runs without AVX-512. oneDNN with the weight reordered once into its blocked
layout was 2.3-2.5x faster on every decoder GEMM of SmolLM2 (M = 16..128 rows, one or two threads)
and 1.8-2.8x on the 49152-row LM head (`benchmarks/decode.py` has the end-to-end effect). Its
rows are also independent of the batch they come in (a row's result is bit-identical whatever
the other rows are), which MKL's are not.

`pack_linears(model)` swaps every `nn.Linear` of a model for a `PackedLinear` (in place; the
plain weight is dropped) and gives a model with a tied LM head its own packed copy of the
embeddings. Models on other devices or dtypes, or a torch without oneDNN, are left as they are.
`unpack_linears` turns them back (e.g. before `torch.ao.quantization.quantize_dynamic`).
"""

from __future__ import annotations

import torch
from torch import nn


def packing_available(device: torch.device | str = "cpu") -> bool:
    return (torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W held in oneDNN's blocked layout (no autograd: inference only)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # The batch size only hints the layout; any number of rows works with it.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().float().contiguous(), 64)
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def __deepcopy__(self, memo) -> "PackedLinear":  # oneDNN's opaque tensors have no storage to copy
        return PackedLinear(self.weight, self.bias)

    @property
    def weight(self) -> torch.Tensor:
        """The weight as a plain [out, in] tensor (a new copy)."""
        return self.packed.to_dense()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module) -> nn.Module:
    """Pack `model`'s linear layers in place (see the module docstring); returns the model."""
    try:
        first = next(model.parameters())
    except StopIteration:
        return model
    if first.dtype != torch.float32 or not packing_available(first.device):
        return model
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PackedLinear(child.weight, child.bias))
    # A tied head reads the embedding matrix: give it a packed copy of its own (only where the
    # logits are computed: a pipeline stage has its final norm only if it is the last).
    if (getattr(model, "lm_head", False) is None and getattr(model, "embed_tokens", None) is not None
            and getattr(model, "norm", None) is not None):
        model.lm_head = PackedLinear(model.embed_tokens.weight)
    return model


def unpack_linears(model: nn.Module) -> nn.Module:
    """Turn `PackedLinear`s back into `nn.Linear`s, in place; returns the model."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                plain = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                plain.weight = nn.Parameter(child.weight, requires_grad=False)
                if child.bias is not None:
                    plain.bias = nn.Parameter(child.bias.clone(), requires_grad=False)
                setattr(parent, name, plain)
    return model
