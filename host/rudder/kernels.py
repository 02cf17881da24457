"""The model's native CPU kernels (native/attention.c, linear.c, norm.c, decoder.c) on tensors.

Each function takes contiguous CPU tensors and passes their data pointers; the kernels split
their work over `torch.get_num_threads()` threads of their own (native/parallel.c). `available()` says whether they can be used
(built for this machine, a CPU device); model.py and packed_linear.py fall back to torch ops
otherwise. Set RUDDER_NO_NATIVE=1 to turn them (and the other native code) off.
"""

from __future__ import annotations

import threading
import time

import torch

from . import native

__all__ = ["available", "AttentionStep", "DecoderStack", "attention", "linear", "rms_norm", "OP_NONE", "OP_ADD",
           "OP_SWIGLU"]

OP_NONE, OP_ADD, OP_SWIGLU = 0, 1, 2  # epilogues of the linear kernels (native/linear.c)

# With AMX, rows below which a kernel runs on one thread: up to a tile of 16 rows a bf16 layer
# costs what one row costs (AMX pads them: the weights' bytes set the time), and there one core
# took the memory bandwidth in full. On the vector path (AVX-512 BF16 / VNNI, no AMX) the kernels
# compute more than they read: two threads decoded faster than one on a quiet host and slower
# while other processes kept both cores busy (benchmarks/RESULTS.md). So there the decoder's
# calls time both counts (ThreadChoice) and keep the faster.
SINGLE_THREAD_ROWS = 16

_lib = None
_hooks = threading.local()


def before_decoder(fn) -> None:
    """Run `fn` (once, in this thread) right before the next DecoderStack call, when this thread
    releases the GIL for the whole of the decoder layers; `take_before_decoder()` takes it back
    if no such call came. The engine starts its controllers' calls so: their threads then find
    the GIL free instead of waking while the engine thread still runs Python (a call started
    before the forward pass made the step slower)."""
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


def size_class(rows: int) -> int:
    """The class of a decoder call by its rows, for timing like calls together: each count up to
    16 (a verified draft of 14 rows costs clearly more than one of 9), then powers of two."""
    return rows if rows <= 16 else 16 + rows.bit_length()


class ThreadChoice:
    """The thread count of the native decoder's calls, by measurement: per size class of the call,
    the current choice runs every call and is timed; now and then one call runs with the other
    count, and if it was faster than the class's recent calls by MARGIN, it becomes the class's
    choice. When to probe is shared by the classes, which measure the same host: every `interval`
    calls (counted over all classes) the next call of a timed class is a probe; a probe that loses
    doubles the interval (PROBE_MIN to PROBE_MAX calls); one that wins (the host changed) resets
    it, and each other class still on the count that lost probes at its next call. A one-thread
    probe on a quiet host costs most of a call again, so the probes on schedule take calls of up to PROBE_ROWS
    rows, and a class of more rows is probed only after another class's probe won. (With a count
    per class, classes of rare calls - a draft's row counts - kept probing every few requests.)
    Results never depend on it (parallel.c)."""

    PROBE_MIN, PROBE_MAX, MARGIN, EMA = 8, 512, 0.05, 0.7
    PROBE_ROWS = 16  # the probes on schedule take calls of up to this many rows

    def __init__(self):
        self.state: dict[int, list] = {}  # size class -> [threads, seconds (EMA)]
        self.interval = self.countdown = self.PROBE_MIN  # calls between probes, calls to the next
        self.due: set[int] = set()  # classes to probe at their next call

    def pick(self, rows: int) -> int:
        many = torch.get_num_threads()
        if _one_thread(rows, many):
            return 1
        c = size_class(rows)
        st = self.state.setdefault(c, [many, None])
        _latest[c] = st[0]
        if st[1] is not None and (c in self.due or (self.countdown <= 0 and rows <= self.PROBE_ROWS)):
            return 1 if st[0] != 1 else many  # the probe: the other count, once
        return st[0]

    def threads(self, rows: int) -> int | None:
        """The class's current choice (None before its first call)."""
        st = self.state.get(size_class(rows))
        return None if st is None else st[0]

    def record(self, rows: int, threads: int, seconds: float) -> None:
        c = size_class(rows)
        st = self.state.get(c)
        if st is None:
            return
        if threads == st[0]:
            st[1] = seconds if st[1] is None else self.EMA * st[1] + (1 - self.EMA) * seconds
            self.countdown -= 1
            return
        if st[1] is None:  # another count before the class's own was timed (a thread with other
            return          # torch threads shares this choice: a pipeline's stages): no probe to judge
        self.due.discard(c)
        if seconds < st[1] * (1 - self.MARGIN):  # the probe won: switch, and check the others
            self.due |= {other for other, s in self.state.items() if s[0] == st[0] and s[1] is not None} - {c}
            st[:] = [threads, seconds]
            self.interval = self.countdown = self.PROBE_MIN
        else:
            self.interval = min(2 * self.interval, self.PROBE_MAX)
            self.countdown = self.interval


_latest: dict[int, int] = {}  # size class -> the count a decoder stack chose last
_cap = threading.local()


def _one_thread(rows: int, many: int) -> bool:
    return many == 1 or (native.amx_usable() and rows < SINGLE_THREAD_ROWS)


def _capped(threads: int) -> int:
    """`threads`, less the cores this thread's engine leaves to controllers (at least one)."""
    return max(1, min(threads, torch.get_num_threads() - getattr(_cap, "leave", 0)))


def leave_cores(n: int) -> None:
    """This thread's next decoder calls use at most torch's threads minus `n` (at least one):
    the engine leaves a core to controllers that keep it busy (engine/llm_engine.py)."""
    _cap.leave = n


def _threads(rows: int) -> int:
    """Threads for a kernel called outside a decoder stack (the LM head, the torch path's
    attention): what the decoder chose last for calls of this size."""
    many = torch.get_num_threads()
    return 1 if _one_thread(rows, many) else _capped(_latest.get(size_class(rows), many))


def parallel_stats() -> dict:
    """The native helper pool's counts: jobs that could use helpers, jobs run inline because
    a helper came late just before, late helpers seen (native/parallel.c)."""
    out = native.ffi.new("int64_t[3]")
    _kernels().rudder_parallel_stats(out)
    return {"jobs": out[0], "inline": out[1], "late": out[2]}


def attention_cascade_rows() -> int:
    """Rows the attention kernel has attended in cascades (over a prefix their sequences share)."""
    return _kernels().rudder_attention_cascade_rows()


def available(device: torch.device | str = "cpu") -> bool:
    return torch.device(device).type == "cpu" and _kernels() is not None


class AttentionStep:
    """What every layer's attention call of one forward pass shares: the tokens' positions,
    KV slots, sequences and block tables, the RoPE tables and the shapes (one C struct, filled
    once per step; the tensors are kept alive here)."""

    def __init__(self, positions: torch.Tensor, slots: torch.Tensor, seq_of: torch.Tensor, tables: torch.Tensor,
                 block_size: int, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                 x_dtype: torch.dtype, cache_dtype: torch.dtype, scale: float, paired: bool = False):
        _kernels()  # loaded first: the struct must come from the ffi of the library that takes it
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
        s.kv_paired = paired  # the cache's blocks in pairs (engine/kv_cache.py)
        # fp32 layers run their GEMMs on oneDNN's OpenMP threads: an attention call on our own
        # pool between them wakes one pool while the other goes to sleep, every layer (a
        # batched decode step took far longer on two pools than with attention on this thread).
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
        self.threads = ThreadChoice()
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
        t = t.detach().contiguous()  # (its own tensor on the storage: kept if a Parameter's .data is replaced)
        self.keep.append(t)
        return t.data_ptr()

    def run(self, step: AttentionStep, x: torch.Tensor, kv_cache: torch.Tensor) -> None:
        """The layers over x ([T, hidden] bf16, contiguous; updated in place); kv_cache [layers,
        2, blocks, ...] in either layout of engine/kv_cache.py, contiguous."""
        stride = kv_cache[0, 0].numel()
        hook = take_before_decoder()
        if hook is not None:
            hook()
        rows = x.shape[0]
        picked = self.threads.pick(rows)
        threads = step.struct.threads = _capped(picked)
        t0 = time.perf_counter()
        if _kernels().rudder_decoder(self.array, self.count, step.struct, x.data_ptr(), self.hidden, self.eps,
                                     kv_cache.data_ptr(), stride, threads):
            raise MemoryError("native decoder: no memory for a step's buffers")
        if threads == picked:  # (a capped call says nothing about the choice)
            self.threads.record(rows, threads, time.perf_counter() - t0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension of a contiguous [m, k] x (fp32 or
    bf16; the result in x's dtype)."""
    out = torch.empty_like(x)
    _kernels().rudder_rms_norm(x.data_ptr(), x.dtype == torch.bfloat16, weight.data_ptr(),
                               weight.dtype == torch.bfloat16, out.data_ptr(), out.dtype == torch.bfloat16,
                               x.shape[0], x.shape[1], eps)
    return out
