"""Batched sampling over `[rows, vocab]` logits, under optional per-row allowed-token bitmasks.

A mask is uint32 words: token i is allowed when bit (i & 31) of word (i >> 5) is set. On the
CPU a small native kernel (`rudder/native/mask.c`) applies it to each row in one pass. Without
it, the mask is expanded byte by byte through a 256-entry table into a penalty row (0 or -inf
per token) kept across steps, then added to the logits in place. Either way: no Python loop over
the vocabulary and no vocab-sized allocation per step.

Logit processing (OpenAI / vLLM semantics), for the rows that ask: repetition, frequency and
presence penalties over the sequence's tokens (`history`), then `logit_bias`, all as one
scatter into the logits: the work follows the history's length, never the vocabulary's.
`min_p` is applied with temperature, on the probabilities the row samples from.

Randomness: every sequence owns a `numpy.random.Generator`; a sampled token consumes exactly
one uniform draw from it (inverse-CDF sampling), so a seeded request gives the same tokens
whatever else shares its batch. On the CPU the sampled rows' weights and their draws are
native passes over each row (`rudder/native/sample.c`) into a buffer kept across steps; on a
GPU, torch's softmax and cumulative sum.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import torch

from .. import native
from ..branch import mask_words
from .sequence import SamplingParams

assert sys.byteorder == "little", "mask words are read as little-endian bytes"

# _PENALTY[b, j] is 0.0 when bit j of byte b is set (token allowed), else -inf. Adding the
# expanded penalty is branch-free: masked_fill_ with a random-looking mask runs several times
# slower (branch mispredictions), whatever the mask's density.
_PENALTY = np.where((np.arange(256)[:, None] >> np.arange(8)[None, :]) & 1, 0.0, -np.inf).astype(np.float32)


def argmax(rows: torch.Tensor) -> torch.Tensor:
    """The argmax along the last dimension (numpy's on the CPU, torch's on a GPU)."""
    # (torch's CPU argmax over one long row is an order of magnitude slower than numpy's)
    if rows.device.type == "cpu":
        return torch.from_numpy(np.asarray(rows.numpy().argmax(axis=-1)))
    return rows.argmax(dim=-1)


def take_rows(t: torch.Tensor, rows: list[int], copy: bool = False) -> torch.Tensor:
    """Rows `rows` of a 2-D tensor: a view when they are consecutive (unless `copy`), else a copy
    (numpy's on the CPU, index_select on a GPU). Why not index_select on the CPU: over logits rows it
    runs on torch's OpenMP threads, which then spin on the core the model's helper thread needs
    next (libgomp spins for milliseconds unless GOMP_SPINCOUNT was set before torch loaded): one
    such select per verification step made speculative steps markedly slower."""
    if rows and rows == list(range(rows[0], rows[0] + len(rows))):
        view = t[rows[0]:rows[0] + len(rows)]
        if not copy:
            return view
        return torch.from_numpy(view.numpy().copy()) if t.device.type == "cpu" else view.clone()
    if t.device.type == "cpu":
        return torch.from_numpy(np.take(t.numpy(), rows, axis=0))
    return t.index_select(0, torch.tensor(rows, device=t.device))


def keep_nucleus(row: torch.Tensor, top_p: float) -> None:
    """Set to -inf every token outside the smallest most-likely set whose mass reaches top_p.

    A full sort of the vocabulary is dear; LM distributions are peaked, so the nucleus almost
    always lies in the top 64 tokens: look there first and widen only when it does not."""
    probs = row.softmax(-1)
    size = row.shape[0]
    for k in (64, 1024, size):
        values, _ = probs.topk(min(k, size))
        mass = values.cumsum(0)
        if mass[-1] >= top_p or k >= size:
            break
    # Keep a token while the mass before it is below top_p (the first always stays).
    kept = int(((mass - values) < top_p).sum())
    row.masked_fill_(probs < values[kept - 1], float("-inf"))


def draw_uniform(params: SamplingParams, rng) -> float:
    """The one uniform draw a sampled token consumes from its sequence's generator (inverse-CDF
    sampling); a greedy row draws none. Whoever samples - this Sampler, or a pipeline's last stage
    with uniforms drawn by the coordinator - draws by this rule, so a seed gives the same tokens."""
    return rng.random() if params.temperature > 0 else 0.0


@dataclass
class SampleOutput:
    tokens: list[int]  # -1 where the mask allowed no token
    logprobs: list[dict | None]  # {"token": id, "logprob": float, "top": [(id, logprob), ...]}


class Sampler:
    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.num_words = mask_words(vocab_size)
        self._penalty = np.zeros((0, self.num_words * 32), dtype=np.float32)
        self._weights = torch.empty(0, vocab_size)  # sampled rows' weights, reused across steps

    def _penalty_rows(self, n: int) -> np.ndarray:
        if self._penalty.shape[0] < n:  # grows rarely: reused across steps
            self._penalty = np.zeros((max(n, 2 * self._penalty.shape[0]), self.num_words * 32), dtype=np.float32)
        return self._penalty

    def apply_masks(self, logits: torch.Tensor, masks: list[np.ndarray | None]) -> None:
        """Set logits of disallowed tokens to -inf, in place."""
        rows = [i for i, m in enumerate(masks) if m is not None]
        if not rows:
            return
        for i in rows:
            words = masks[i]
            if words.dtype != np.uint32 or words.shape != (self.num_words,):
                raise ValueError(f"sample mask must be {self.num_words} uint32 words, got {words.dtype} {words.shape}")
        kernel = native.mask_kernel() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
        if kernel is not None and logits.stride(1) == 1:
            base, row_stride, width = logits.data_ptr(), logits.stride(0) * 4, logits.shape[1]
            for i in rows:
                kernel(native.ffi.cast("float *", base + i * row_stride), native.ffi.from_buffer("uint32_t[]", masks[i]),
                       width)
            return
        buf = self._penalty_rows(len(rows))
        for j, i in enumerate(rows):
            np.take(_PENALTY, masks[i].view(np.uint8), axis=0, out=buf[j].reshape(-1, 8), mode="clip")
        penalty = buf[: len(rows), : logits.shape[1]]
        if len(rows) == logits.shape[0] and logits.device.type == "cpu" and logits.is_contiguous():
            np.add(logits.numpy(), penalty, out=logits.numpy())
        elif len(rows) == logits.shape[0]:
            logits.add_(torch.from_numpy(penalty).to(logits.device))
        else:
            logits.index_add_(0, torch.tensor(rows, device=logits.device), torch.from_numpy(penalty).to(logits.device))

    def apply_processing(self, logits: torch.Tensor, params: list[SamplingParams],
                         history: list[tuple[list[int], int]] | None) -> None:
        """Penalties and logit_bias, in place. `history[i]`: (token ids, prompt length) of row i's
        sequence, needed by the rows whose params are `penalized`."""
        rows, cols, vals = [], [], []

        def add(row: int, ids: np.ndarray, values: np.ndarray) -> None:
            rows.append(np.full(len(ids), row, dtype=np.int64))
            cols.append(ids)
            vals.append(values)

        vocab = logits.shape[1]
        for i, p in enumerate(params):
            if p.penalized and history is not None and history[i] is not None:
                ids, n_prompt = history[i]
                seen = np.fromiter(ids, dtype=np.int64, count=len(ids))
                if p.repetition_penalty != 1.0 and len(seen):
                    self._repetition(logits, i, np.unique(seen), p.repetition_penalty)
                out = seen[n_prompt:]
                if len(out) and p.frequency_penalty:  # accumulated: a token's count times the penalty
                    add(i, out, np.full(len(out), -p.frequency_penalty, dtype=np.float32))
                if len(out) and p.presence_penalty:
                    present = np.unique(out)
                    add(i, present, np.full(len(present), -p.presence_penalty, dtype=np.float32))
            if p.logit_bias:
                ids = np.fromiter(p.logit_bias.keys(), dtype=np.int64, count=len(p.logit_bias))
                bias = np.fromiter(p.logit_bias.values(), dtype=np.float32, count=len(p.logit_bias))
                keep = ids < vocab  # callers check ids against the vocabulary; never index past it
                add(i, ids[keep], bias[keep])
        if rows:
            index = (torch.from_numpy(np.concatenate(rows)).to(logits.device),
                     torch.from_numpy(np.concatenate(cols)).to(logits.device))
            values = torch.from_numpy(np.concatenate(vals)).to(logits.device, logits.dtype)
            logits.index_put_(index, values, accumulate=True)

    @staticmethod
    def _repetition(logits: torch.Tensor, row: int, ids: np.ndarray, penalty: float) -> None:
        index = torch.from_numpy(ids).to(logits.device)
        values = logits[row].index_select(0, index)
        logits[row].index_copy_(0, index, torch.where(values > 0, values / penalty, values * penalty))

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, params: list[SamplingParams], rngs: list[np.random.Generator],
               masks: list[np.ndarray | None] | None = None,
               history: list[tuple[list[int], int] | None] | None = None) -> SampleOutput:
        """logits: [rows, V] float (modified in place). One token per row. `history`: each row's
        (token ids, prompt length), given when some row is penalized."""
        n = logits.shape[0]
        logits = logits[:, : self.vocab_size] if logits.shape[1] > self.vocab_size else logits
        unmasked = masks is None or all(m is None for m in masks)
        if all(p.temperature == 0 and p.logprobs is None and not p.processed for p in params):
            return self._greedy(logits, None if unmasked else masks)  # the argmax is all there is
        if masks is not None:
            self.apply_masks(logits, masks)
        if any(p.penalized or p.logit_bias for p in params):
            self.apply_processing(logits, params, history)
        want_logprobs = [p.logprobs is not None for p in params]
        logprob_table = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

        tokens = torch.empty(n, dtype=torch.long, device=logits.device)
        greedy = [i for i, p in enumerate(params) if p.temperature == 0]
        sampled = [i for i, p in enumerate(params) if p.temperature > 0]
        if greedy:
            idx = torch.tensor(greedy, device=logits.device) if len(greedy) < n else None
            best = argmax(logits if idx is None else take_rows(logits, greedy))
            if idx is None:
                tokens.copy_(best)
            else:
                tokens.index_copy_(0, idx, best)
        if sampled:
            tokens_s = self._sample_rows(logits, sampled, params, rngs)
            tokens.index_copy_(0, torch.tensor(sampled, device=logits.device), tokens_s)

        # A row whose mask allowed nothing has only -inf logits (only a masked row can be so: no
        # extra pass over the vocabulary for unconstrained batches).
        if masks is not None and any(m is not None for m in masks):
            tokens.masked_fill_(torch.isneginf(logits.amax(dim=-1)), -1)
        token_list = tokens.tolist()
        lps: list[dict | None] = [None] * n
        if logprob_table is not None:
            for i, p in enumerate(params):
                if p.logprobs is None or token_list[i] < 0:
                    continue
                row = logprob_table[i]
                top = []
                if p.logprobs:
                    values, ids = row.topk(p.logprobs)  # a token the mask refused is no alternative
                    top = [(t, v) for t, v in zip(ids.tolist(), values.tolist()) if v != float("-inf")]
                lps[i] = {"token": token_list[i], "logprob": row[token_list[i]].item(), "top": top}
        return SampleOutput(token_list, lps)

    def _greedy(self, logits: torch.Tensor, masks: list[np.ndarray | None] | None) -> SampleOutput:
        """Greedy rows, masks only: each row's argmax after its mask, -1 for a row whose mask
        allowed nothing. Few operations: right after a forward pass every one of them runs with
        cold caches over a vocabulary row, and a controller's step pays them."""
        if masks is not None:
            self.apply_masks(logits, masks)
        best = argmax(logits)
        tokens = best.tolist()
        if masks is not None:
            rows = [i for i, m in enumerate(masks) if m is not None]
            if logits.device.type == "cpu":
                top = logits.numpy()[rows, best.numpy()[rows]]
            else:
                top = logits[rows].gather(1, best[rows].view(-1, 1).to(logits.device)).view(-1).tolist()
            for i, value in zip(rows, top):
                if value == float("-inf"):
                    tokens[i] = -1
        return SampleOutput(tokens, [None] * len(tokens))

    def _sample_rows(self, logits, rows, params, rngs) -> torch.Tensor:
        x = take_rows(logits, rows)
        if self._weights.shape[0] < len(rows) or self._weights.shape[1] != x.shape[1]:  # grows rarely
            self._weights = torch.empty(max(len(rows), 2 * self._weights.shape[0]), x.shape[1])
        out = self._weights[: len(rows)] if x.device.type == "cpu" and x.dtype == torch.float32 else None
        weights = sampling_weights(x, [params[i] for i in rows], out)
        return draw(weights, [draw_uniform(params[i], rngs[i]) for i in rows])


def _native(t: torch.Tensor):
    """sample.c's kernels for a tensor whose rows they can read (fp32 on the CPU, unit stride), or None."""
    if t.device.type != "cpu" or t.dtype != torch.float32 or t.stride(-1) != 1:
        return None
    return native.sample_kernels()


def draw(weights: torch.Tensor, u: list[float]) -> torch.Tensor:
    """Each row's token from its weights [rows, V] and its uniform in [0, 1): the first token whose
    cumulative weight passes u times the row's total (the total, not 1: float rounding, min_p's
    zeros). The scaled draw is kept below the total - in float32 a u just under 1 rounds to 1 - so
    a token of no weight (masked, or cut by top-k, top-p or min-p) is never drawn; a row with no
    weight at all gives V - 1 (its mask says so to the caller). On the CPU, native/sample.c
    (how it sums the row is said there); elsewhere torch's cumulative sum."""
    lib = _native(weights)
    if lib is not None:
        base, stride, n = weights.data_ptr(), weights.stride(0) * 4, weights.shape[1]
        return torch.tensor([lib.rudder_draw_row(base + i * stride, n, value) for i, value in enumerate(u)])
    return _torch_draw(weights, u)


def _torch_draw(weights: torch.Tensor, u: list[float]) -> torch.Tensor:
    """draw on a GPU (or without the native library)."""
    cdf = weights.cumsum(dim=-1)
    total = cdf[:, -1]
    target = torch.minimum(torch.tensor(u, dtype=cdf.dtype, device=cdf.device) * total,
                           torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)


def sampling_weights(x: torch.Tensor, params: list[SamplingParams], out: torch.Tensor | None = None) -> torch.Tensor:
    """The distribution each row samples from, as weights proportional to its probabilities: the
    one definition of temperature, top-k, top-p and min-p, for the Sampler and for speculative
    verification alike. `x`: [rows, V] logits after masks and logit processing, left as they are;
    every row's temperature is > 0. `out` ([rows, V] fp32, optional) takes the weights (the
    Sampler's, kept across steps). Top-k keeps the k most likely tokens (and ties with the k-th),
    top-p then the fewest most likely whose mass reaches top_p (ties with the last too), min_p
    drops what is under min_p times the most likely token. A row sums to 1 unless min_p dropped
    tokens (then to less: divide by the sum for probabilities). On the CPU, native/sample.c;
    elsewhere torch."""
    lib = _native(x)
    if lib is None:
        return _torch_weights(x, params)
    out = torch.empty(x.shape, dtype=torch.float32) if out is None else out
    n, base, stride = x.shape[1], x.data_ptr(), x.stride(0) * 4
    for j, p in enumerate(params):
        row = out[j].data_ptr()
        lib.rudder_softmax_row(base + j * stride, n, 1.0 / p.temperature, row)
        if 0 < p.top_k < n or p.top_p < 1.0 or p.min_p > 0:
            lib.rudder_cut_row(row, n, p.top_k if 0 < p.top_k < n else 0, p.top_p, p.min_p)
    return out


def _torch_weights(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """sampling_weights on a GPU (or without the native library): the same cuts as sample.c's."""
    temps = torch.tensor([p.temperature for p in params], dtype=x.dtype, device=x.device)
    x = x / temps.unsqueeze(1)
    for j, p in enumerate(params):
        if 0 < p.top_k < x.shape[1]:
            kth = x[j].topk(p.top_k).values[-1]
            x[j].masked_fill_(x[j] < kth, float("-inf"))
        if p.top_p < 1.0:
            keep_nucleus(x[j], p.top_p)
    probs = x.softmax(dim=-1)
    for j, p in enumerate(params):
        if p.min_p > 0:
            probs[j].masked_fill_(probs[j] < probs[j].max() * p.min_p, 0.0)
    return probs
