"""The model's linear layers in each weight precision, with the epilogues the decoder fuses.

Every layer is a `Linear`: `layer(x)` is x W^T + b, `layer.add_into(x, residual)` is
residual + x W^T (the residual stream; it may be updated in place and is returned), and
`layer.swiglu(x)` is silu(gate) * up for a layer whose rows are the gate rows then the up rows.
`prepare_linears(model, precision)` swaps a model's `nn.Linear`s for the fastest kind on its
device:

- `PackedLinear` (fp32 on the CPU): the weight reordered once into oneDNN's blocked
  layout. MKL's sgemm, which `F.linear` reaches, repacks the weight on every call and runs
  without AVX-512 on AMD processors; packed oneDNN was faster on every decoder GEMM of SmolLM2
  and on the LM head (benchmarks/RESULTS.md). Residual adds and SiLU run as oneDNN post-ops, in the
  same call. (In bf16 it is only the fallback without the native library: its bf16 kernels
  change with the number of rows, and so do a row's results.)
- `Bf16Linear` (native/linear.c): bf16 weights, bf16 output, or fp32 for the LM head's logits
  (oneDNN's bf16 products come out in bf16). A row's result never depends on the other rows.
- `Int8Linear` (native/linear.c): int8 weights with a scale per output row; each input row is
  quantised to int8 with its own scale, products summed in int32 (AVX-512 VNNI).
- `TorchLinear`: plain `F.linear` (other devices, or no oneDNN / native library).

A model with a tied LM head gets a head of its own over the embeddings (only where logits are
computed: a pipeline stage has its final norm only if it is the last).

The native layers' packed weights then move into one mapping advised for transparent huge pages
(`place_in_huge_pages`): a step streams every weight from memory, and with 4 KiB pages the
hardware prefetcher stops at every page and each page costs a TLB miss.
"""

from __future__ import annotations

import mmap

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .precision import activation_dtype

__all__ = ["Linear", "TorchLinear", "PackedLinear", "Bf16Linear", "Int8Linear", "packing_available",
           "make_linear", "prepare_linears", "pack_linears", "unpack_linears", "quantize_int8", "place_in_huge_pages"]


def packing_available(device: torch.device | str = "cpu") -> bool:
    return (torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class Linear(nn.Module):
    """y = x W^T + b (inference only), with fused epilogues; subclasses hold W their own way."""

    in_features: int
    out_features: int

    def add_into(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return residual + self(x)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self(x).chunk(2, dim=-1)
        return F.silu(gate) * up

    @property
    def weight(self) -> torch.Tensor:
        """The weight as a plain fp32 [out, in] tensor (a new copy, dequantised)."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"

    def __deepcopy__(self, memo) -> "Linear":  # oneDNN's opaque tensors have no storage to copy
        return type(self).like(self)

    @classmethod
    def like(cls, other: "Linear") -> "Linear":
        raise NotImplementedError


class TorchLinear(Linear):
    """F.linear on a plain weight of any dtype and device; `out_dtype` converts the result."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.w = weight.detach().contiguous()
        self.bias = None if bias is None else bias.detach().to(weight.dtype)
        self.out_dtype = out_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x.to(self.w.dtype), self.w, self.bias)
        return y if self.out_dtype is None else y.to(self.out_dtype)

    @property
    def weight(self) -> torch.Tensor:
        return self.w.float().clone()

    @classmethod
    def like(cls, other):
        return cls(other.w, other.bias, other.out_dtype)


class PackedLinear(Linear):
    """oneDNN with the weight packed once (fp32 or bf16; activations in the weight's dtype).
    `swiglu=True` packs the gate and up halves apart, for SiLU and the product as post-ops."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, swiglu: bool = False,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype, self.is_swiglu = dtype, swiglu
        w = weight.detach().to(dtype).contiguous()
        # The batch size only hints the layout; any number of rows works with it.
        halves = w.chunk(2) if swiglu else (w,)
        self.packed = [torch.ops.mkldnn._reorder_linear_weight(h.contiguous(), 64) for h in halves]
        self.bias = None if bias is None else bias.detach().to(dtype).contiguous()
        if swiglu and self.bias is not None:
            raise ValueError("a SwiGLU layer has no bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_swiglu:
            return torch.cat([torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in self.packed], -1)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed[0], self.bias, "none", [], "")

    def add_into(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed[0], self.bias, "add")

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        if not self.is_swiglu:
            return super().swiglu(x)
        gate = torch.ops.mkldnn._linear_pointwise(x, self.packed[0], None, "swish", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, gate, self.packed[1], None, "mul")

    @property
    def weight(self) -> torch.Tensor:
        return torch.cat([p.to_dense() for p in self.packed]).float()

    @classmethod
    def like(cls, other):
        return cls(other.weight, other.bias, other.is_swiglu, other.dtype)


def pack_blocks(weight: torch.Tensor, per_lane: int, swiglu: bool = False) -> torch.Tensor:
    """The native kernels' layout (native/linear.c) of a [n, k] weight: blocks of 16 output columns,
    each a contiguous run over k with `per_lane` consecutive k per column ([n/16][k/per_lane][16]
    [per_lane]); columns padded with zeros to a whole block. `swiglu`: the gate and up halves
    packed one after the other (each padded)."""
    if swiglu:
        return torch.cat([pack_blocks(half, per_lane) for half in weight.chunk(2)])
    n, k = weight.shape
    blocks = (n + 15) // 16
    if blocks * 16 != n:
        weight = torch.cat([weight, weight.new_zeros(blocks * 16 - n, k)])
    return weight.reshape(blocks, 16, k // per_lane, per_lane).permute(0, 2, 1, 3).contiguous()


def unpack_blocks(packed: torch.Tensor, n: int, swiglu: bool = False) -> torch.Tensor:
    """`pack_blocks` undone: the [n, k] weight (gate then up rows for `swiglu`, n counting both)."""
    if swiglu:
        return torch.cat([unpack_blocks(half, n // 2) for half in packed.chunk(2)])
    blocks, groups, _, per_lane = packed.shape
    return packed.permute(0, 2, 1, 3).reshape(blocks * 16, groups * per_lane)[:n]


def _pad_columns(v: torch.Tensor, swiglu: bool) -> torch.Tensor:
    """Per-column values in the packed column order (halves padded apart for `swiglu`)."""
    if swiglu:
        return torch.cat([_pad_columns(half, False) for half in v.chunk(2)])
    blocks = (v.shape[0] + 15) // 16
    return torch.cat([v, v.new_zeros(blocks * 16 - v.shape[0])]).contiguous()


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes, fp32 scale per row): symmetric, scale = max |row| / 127."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    codes = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes.contiguous(), scales.contiguous()


class _NativeLinear(Linear):
    """Weights packed for native/linear.c (bf16, or int8 with a scale per output row); output
    `out_dtype`; the epilogues run inside the kernel. `swiglu`: the weight is gate rows then up
    rows, for `swiglu()`."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor | None, sums: torch.Tensor | None,
                 shape: tuple[int, int], bias: torch.Tensor | None, out_dtype: torch.dtype, swiglu: bool):
        super().__init__()
        self.out_features, self.in_features = shape
        self.packed, self.scales, self.sums, self.swiglu_layout = packed, scales, sums, swiglu
        self.bias = None if bias is None else bias.detach().float()
        self.out_dtype = out_dtype
        self.in_huge_pages = False  # (place_in_huge_pages)

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        return x.contiguous()

    def _run(self, x: torch.Tensor, out: torch.Tensor, op: int, half: int | None = None) -> torch.Tensor:
        packed, scales, sums = self.packed, self.scales, self.sums
        if half is not None:  # one half of a SwiGLU layer, as a plain product
            packed = packed.chunk(2)[half]
            scales, sums = (None, None) if scales is None else (scales.chunk(2)[half], sums.chunk(2)[half])
        bias = self.bias if half is None and op != kernels.OP_SWIGLU else None
        kernels.linear(self._input(x), packed, out, op, scales, sums, bias)
        return out

    def _new(self, x: torch.Tensor, columns: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], columns, dtype=self.out_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu_layout:  # both halves, gate then up
            half = self.out_features // 2
            return torch.cat([self._run(x, self._new(x, half), kernels.OP_NONE, h) for h in (0, 1)], -1)
        return self._run(x, self._new(x, self.out_features), kernels.OP_NONE)

    def add_into(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.swiglu_layout or residual.dtype != self.out_dtype or not residual.is_contiguous():
            return super().add_into(x, residual)
        return self._run(x, residual, kernels.OP_ADD)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        if not self.swiglu_layout or self.bias is not None:
            return super().swiglu(x)
        return self._run(x, self._new(x, self.out_features // 2), kernels.OP_SWIGLU)

    @property
    def weight(self) -> torch.Tensor:
        w = unpack_blocks(self.packed, self.out_features, self.swiglu_layout).float()
        if self.scales is None:
            return w
        halves = self.scales.chunk(2) if self.swiglu_layout else (self.scales,)
        rows = self.out_features // len(halves)
        return w * torch.cat([h[:rows] for h in halves])[:, None]

    @classmethod
    def like(cls, other):
        return cls(other.weight, other.bias, other.out_dtype, other.swiglu_layout)


class Bf16Linear(_NativeLinear):
    """bf16 weights through native/linear.c; input bf16, output `out_dtype` (bf16, or fp32 for
    logits)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
                 swiglu: bool = False):
        super().__init__(pack_blocks(weight.detach().to(torch.bfloat16), 2, swiglu), None, None, tuple(weight.shape),
                         bias, out_dtype, swiglu)

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.bfloat16).contiguous()


class Int8Linear(_NativeLinear):
    """int8 weights with a scale per output row (symmetric, max |row| / 127) through
    native/linear.c: half the bytes of `Bf16Linear`; each input row is taken at 16 bits against
    its largest value (the kernel's docstring)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
                 swiglu: bool = False):
        codes, scales = quantize_int8(weight)
        sums = codes.sum(dim=1, dtype=torch.int32)
        super().__init__(pack_blocks(codes, 4, swiglu), _pad_columns(scales, swiglu), _pad_columns(sums, swiglu),
                         tuple(weight.shape), bias, out_dtype, swiglu)


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, precision: str, device: torch.device,
                head: bool = False, swiglu: bool = False) -> Linear:
    """The layer for one weight [out, in] under `precision` on `device`; `head`: the LM head
    (fp32 logits); `swiglu`: gate rows then up rows."""
    act = activation_dtype(precision, device)
    k = weight.shape[1]
    native = kernels.available(device)
    if device.type != "cpu":  # GPUs: plain matmuls; the head in fp32 (bandwidth is no concern there)
        if precision == "int8":  # int8's weights, dequantised: its numbers (not its bytes), as elsewhere
            codes, scales = quantize_int8(weight)
            weight = codes.float() * scales[:, None]
        return TorchLinear(weight.float() if head else weight.to(act), bias, torch.float32 if head else None)
    if precision == "int8":
        if native and k % 4 == 0:
            return Int8Linear(weight, bias, torch.float32 if head else act, swiglu=swiglu)
        codes, scales = quantize_int8(weight)  # no native kernels: the same int8 weights, dequantised
        return TorchLinear((codes.float() * scales[:, None]).to(act), bias, torch.float32 if head else None)
    if precision == "bf16":
        # Native for every layer: oneDNN's bf16 kernels change with the number of rows (a row
        # of a 32-row call differs from the same row alone by up to 2^-8 relative), which would
        # make a token's logits depend on what else the step computes.
        if native and k % 2 == 0:
            return Bf16Linear(weight, bias, torch.float32 if head else act, swiglu=swiglu)
        if head:
            return TorchLinear(weight.float(), bias, torch.float32)
    if packing_available(device):
        return PackedLinear(weight, bias, swiglu=swiglu, dtype=act)
    return TorchLinear(weight.to(act), bias, torch.float32 if head else None)


def prepare_linears(model: nn.Module, precision: str = "fp32", convert: bool = False) -> nn.Module:
    """Swap `model`'s `nn.Linear`s (in place) for the layers of `precision` on its device, and
    give a tied LM head a layer of its own; returns the model. `convert`: our own `Linear`s too
    (from their fp32 weights: a draft model's copy of the target's layers in another precision)."""
    try:
        first = next(model.parameters())
    except StopIteration:
        return model
    device = first.device
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear or (convert and isinstance(child, Linear)):
                layer = make_linear(child.weight, child.bias, precision, device, head=name == "lm_head",
                                    swiglu=name == "gate_up_proj")
                setattr(parent, name, layer)
    if (getattr(model, "lm_head", False) is None and getattr(model, "embed_tokens", None) is not None
            and getattr(model, "norm", None) is not None):
        model.lm_head = make_linear(model.embed_tokens.weight, None, precision, device, head=True)
    place_in_huge_pages(model)
    return model


HUGE_PAGE = 2 << 20


def place_in_huge_pages(model: nn.Module) -> int:
    """Moves the packed weights of `model`'s native layers into one anonymous mapping advised
    for transparent huge pages (Linux; the kernel's `madvise` mode is enough, and where it gives
    none the pages stay small). The same bytes, so the same results. Returns the bytes moved."""
    layers = [m for m in model.modules() if isinstance(m, _NativeLinear) and m.packed.device.type == "cpu"
              and not m.in_huge_pages]
    total = sum(-(-m.packed.nbytes // 64) * 64 for m in layers)
    if total < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return 0
    mapping = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages
        mapping.close()
        return 0
    arena = torch.frombuffer(mapping, dtype=torch.uint8)  # (the tensor keeps the mapping alive)
    at = -arena.data_ptr() % HUGE_PAGE
    for m in layers:
        n = m.packed.nbytes
        placed = arena[at:at + n].view(m.packed.dtype).view(m.packed.shape)
        placed.copy_(m.packed)
        m.packed, m.in_huge_pages = placed, True
        at += -(-n // 64) * 64
    return total


def pack_linears(model: nn.Module) -> nn.Module:
    """`prepare_linears` at the model's precision (`model.precision`, else fp32; an fp64 model
    is left alone)."""
    try:
        first = next(model.parameters())
    except StopIteration:
        return model
    if first.dtype not in (torch.float32, torch.bfloat16):
        return model
    return prepare_linears(model, getattr(model, "precision", "fp32"))


def unpack_linears(model: nn.Module) -> nn.Module:
    """Turn our `Linear`s back into fp32 `nn.Linear`s, in place; returns the model."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Linear):
                plain = nn.Linear(child.in_features, child.out_features, bias=getattr(child, "bias", None) is not None)
                plain.weight = nn.Parameter(child.weight, requires_grad=False)
                if plain.bias is not None:
                    plain.bias = nn.Parameter(child.bias.float().clone(), requires_grad=False)
                setattr(parent, name, plain)
    return model
