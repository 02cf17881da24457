"""The model's native CPU kernels (native/attention.c, linear.c, norm.c, decoder.c) on tensors.

Each function takes contiguous CPU tensors and passes their data pointers; the kernels split
their work over `torch.get_num_threads()` threads of their own (native/parallel.c). `available()` says whether they can be used
(built for this machine, a CPU device); model.py and packed_linear.py fall back to torch ops
otherwise. Set RUDDER_NO_NATIVE=1 to turn them (and the other native code) off.
"""

from __future__ import annotations

import threading

import torch

from . import native

__all__ = ["available", "AttentionStep", "DecoderStack", "attention", "linear", "rms_norm", "OP_NONE", "OP_ADD",
           "OP_SWIGLU"]

OP_NONE, OP_ADD, OP_SWIGLU = 0, 1, 2  # epilogues of the linear kernels (native/linear.c)

# Rows below which a kernel runs on one thread. Up to a tile of 16 rows a bf16 layer costs what
# one row costs (AMX pads them: the weights' bytes set the time), and one core already takes the
# memory bandwidth in full here (a 270 MB read: 6.7 GB/s on one thread, 6.4 on two); a second
# thread then only adds a hand-over per call (~150 per step). Measured on this shared host, a
# 5-row bf16 forward (a speculative verification) took 29 ms on 1 thread and 42 on 2.
SINGLE_THREAD_ROWS = 16

_lib = None
_hooks = threading.local()


def before_decoder(fn) -> None:
    """Run `fn` (once, in this thread) right before the next DecoderStack call, when this thread
    releases the GIL for the whole of the decoder layers; `take_before_decoder()` takes it back
    if no such call came. The engine starts its controllers' calls so: their threads then find
    the GIL free instead of waking while the engine thread still runs Python (measured: a
    controller call started before the forward pass made a bf16 SmolLM2 step ~0.25 ms slower)."""
    _hooks.fn = fn


def take_before_decoder():
    """The hook `before_decoder` set and no DecoderStack call ran, or None."""
    fn, _hooks.fn = getattr(_hooks, "fn", None), None
    return fn


def _kernels():
    global _lib
    if _lib is None:
        _lib = native.model_kernels() or False
    return _lib or None


def _threads(rows: int) -> int:
    return 1 if rows < SINGLE_THREAD_ROWS else torch.get_num_threads()


def available(device: torch.device | str = "cpu") -> bool:
    return torch.device(device).type == "cpu" and _kernels() is not None


class AttentionStep:
    """What every layer's attention call of one forward pass shares: the tokens' positions,
    KV slots, sequences and block tables, the RoPE tables and the shapes (one C struct, filled
    once per step; the tensors are kept alive here)."""

    def __init__(self, positions: torch.Tensor, slots: torch.Tensor, seq_of: torch.Tensor, tables: torch.Tensor,
                 block_size: int, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                 x_dtype: torch.dtype, cache_dtype: torch.dtype, scale: float):
        self.keep = [t.contiguous() for t in (positions, slots, seq_of, tables)]
        positions, slots, seq_of, tables = self.keep
        s = self.struct = native.ffi.new("rudder_attn_step *")
        s.tokens = positions.shape[0]
        s.positions = native.ffi.cast("int64_t *", positions.data_ptr())
        s.slots = native.ffi.cast("int64_t *", slots.data_ptr())
        s.seq_of = native.ffi.cast("int64_t *", seq_of.data_ptr())
        s.tables = native.ffi.cast("int64_t *", tables.data_ptr())
        s.width, s.block_size = tables.shape[1], block_size
        s.cos = native.ffi.cast("float *", cos.data_ptr())
        s.sin = native.ffi.cast("float *", sin.data_ptr())
        s.heads, s.kv_heads, s.head_dim = heads, kv_heads, head_dim
        s.x_bf16 = x_dtype == torch.bfloat16
        s.cache_bf16 = cache_dtype == torch.bfloat16
        # fp32 layers run their GEMMs on oneDNN's OpenMP threads: an attention call on our own
        # pool between them wakes one pool while the other goes to sleep, every layer (B=16
        # decode: 95 ms per step on two pools against 55 ms with attention on this thread).
        s.threads = _threads(positions.shape[0]) if x_dtype == torch.bfloat16 else 1
        s.scale = scale


def attention(step: AttentionStep, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """RoPE, the new tokens' K/V into the cache, attention over each sequence's cache:
    qkv [T, (heads + 2 kv_heads) * head_dim] -> [T, heads * head_dim] (native/attention.c)."""
    s = step.struct
    out = torch.empty(qkv.shape[0], s.heads * s.head_dim, dtype=qkv.dtype)
    if _kernels().rudder_attention(s, qkv.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr()):
        raise ValueError(f"native attention does not take head_dim {s.head_dim} with {s.heads}/{s.kv_heads} heads")
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, op: int = OP_NONE,
           scales: torch.Tensor | None = None, sums: torch.Tensor | None = None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """out (bf16 or fp32) = x @ W.T (+ bias, fp32) with epilogue `op` (native/linear.c); x [m, k]
    contiguous; `weight` packed by packed_linear.pack_blocks: bf16 (x bf16), or int8 with a scale
    and the sum of the codes per column (`scales`, `sums`; x fp32 or bf16)."""
    lib, rows, threads = _kernels(), x.shape[0], _threads(x.shape[0])
    b = 0 if bias is None else bias.data_ptr()
    if weight.dtype == torch.int8:
        lib.rudder_linear_i8(x.data_ptr(), x.dtype == torch.bfloat16, rows, x.shape[1], weight.data_ptr(),
                             scales.data_ptr(), sums.data_ptr(), b, out.shape[1], out.data_ptr(),
                             out.dtype == torch.bfloat16, op, threads)
    else:
        lib.rudder_linear_bf16(x.data_ptr(), rows, x.shape[1], weight.data_ptr(), b, out.shape[1], out.data_ptr(),
                               out.dtype == torch.bfloat16, op, threads)
    return out


class DecoderStack:
    """A model's decoder layers as native/decoder.c's descriptors, to run them all in one call.

    `layers`: per layer, (norm1 weight, norm2 weight, qkv, o, gate_up, down), each linear given
    as (packed weight, scales or None, sums or None, fp32 bias or None, output columns; for
    gate_up, the columns of each half). Everything bf16 but the int8 weights and the biases."""

    def __init__(self, layers: list[tuple], hidden: int, eps: float):
        self.keep = []
        self.hidden, self.eps, self.count = hidden, eps, len(layers)
        self.array = native.ffi.new("rudder_layer[]", len(layers))
        for entry, (norm1, norm2, *dense) in zip(self.array, layers):
            entry.norm1, entry.norm2 = self._ptr(norm1), self._ptr(norm2)
            for field, (weight, scales, sums, bias, n) in zip(("qkv", "o", "gate_up", "down"), dense):
                d = getattr(entry, field)
                d.w, d.scale, d.sum, d.bias = (self._ptr(t) for t in (weight, scales, sums, bias))
                d.n, d.int8 = n, weight.dtype == torch.int8

    def _ptr(self, t: torch.Tensor | None) -> int:
        if t is None:
            return 0
        t = t.contiguous()
        self.keep.append(t)
        return t.data_ptr()

    def run(self, step: AttentionStep, x: torch.Tensor, kv_cache: torch.Tensor) -> None:
        """The layers over x ([T, hidden] bf16, contiguous; updated in place); kv_cache [layers,
        2, blocks, block_size, kv heads, head dim], contiguous."""
        stride = kv_cache[0, 0].numel()
        hook = take_before_decoder()
        if hook is not None:
            hook()
        if _kernels().rudder_decoder(self.array, self.count, step.struct, x.data_ptr(), self.hidden, self.eps,
                                     kv_cache.data_ptr(), stride, _threads(x.shape[0])):
            raise MemoryError("native decoder: no memory for a step's buffers")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension of a contiguous [m, k] x (fp32 or
    bf16; the result in x's dtype)."""
    out = torch.empty_like(x)
    _kernels().rudder_rms_norm(x.data_ptr(), x.dtype == torch.bfloat16, weight.data_ptr(),
                               weight.dtype == torch.bfloat16, out.data_ptr(), out.dtype == torch.bfloat16,
                               x.shape[0], x.shape[1], eps)
    return out
