"""Reading a `rudder_result` out of guest memory into Branch records (docs/abi.md).

This is on the per-token path, so it reads the fixed-size records with `struct.unpack_from`
(which also refuses to read past the buffer) and never loops over the vocabulary in Python:
the mask is handed out as a zero-copy numpy view of guest memory, and of its bits only the
last word (bits past vocab_size) and "is anything allowed" are checked.

Every pointer and length comes from untrusted code: each is checked against the memory size
before it is used, and every failure names the offending field.
"""

from __future__ import annotations

import struct

import numpy as np

from ..branch import Branch, mask_words
from .abi import BRANCH, RESULT, TOKENS
from .errors import ControllerError

__all__ = ["BranchRules", "Invalid", "ResultDecoder"]

_FORMATS: dict[int, struct.Struct] = {}


def _words(n: int) -> struct.Struct:
    s = _FORMATS.get(n)
    if s is None:
        s = _FORMATS[n] = struct.Struct(f"<{n}I")
    return s


class Invalid(Exception):
    """An answer that breaks a rule of docs/abi.md (`kind` invalid_result) or a limit (`kind` limit)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class _OutOfBounds(Invalid):
    """A pointer past the memory size we know; the guest may have grown its memory."""

    def __init__(self, message: str):
        super().__init__("invalid_result", message)


class BranchRules:
    """What an answer may hold, for one vocabulary and one set of limits, whatever shape's
    answer is read: each shape's decoder lifts its own form and checks it by these."""

    def __init__(self, vocab_size: int, max_forks: int, max_ff_tokens: int):
        self.vocab = vocab_size
        self.mask_words = mask_words(vocab_size)
        self.mask_bytes = 4 * self.mask_words
        self._zeros = bytes(self.mask_bytes)
        self.tail_bits = vocab_size % 32  # used bits of the last mask word (0: all 32)
        self.max_forks = max_forks
        self.max_ff = max_ff_tokens

    def refusal(self, e: Invalid, hook: str, log_tail: str) -> ControllerError:
        what = "an invalid result" if e.kind == "invalid_result" else "a result over a limit"
        return ControllerError(e.kind, f"{hook} returned {what}: {e}", log_tail)


class ResultDecoder(BranchRules):
    """Reads a core module's rudder_result records out of its memory."""

    def decode(self, inst, ptr: int) -> list[Branch]:
        """The Branch list of the result at `ptr` in `inst`'s memory; raises ControllerError."""
        try:
            try:
                return self._decode(inst, ptr)
            except _OutOfBounds:
                if not inst.check_growth():
                    raise
                return self._decode(inst, ptr)
        except Invalid as e:
            raise self.refusal(e, "rudder_mid_process", inst.log_tail()) from None

    def _decode(self, inst, ptr: int) -> list[Branch]:
        buf, size = inst.buf, inst.size
        ptr &= 0xFFFFFFFF
        if ptr == 0:
            raise Invalid("invalid_result", "a null pointer (the controller reported a failure)")
        if ptr + RESULT.size > size:
            raise _OutOfBounds(f"result pointer {ptr:#x} lies outside memory ({size} bytes)")
        n_branches, branches_ptr = RESULT.unpack_from(buf, ptr)
        if n_branches == 0:
            return []
        if n_branches > self.max_forks:
            raise Invalid("limit", f"{n_branches} branches, over the limit of {self.max_forks}")
        if branches_ptr + BRANCH.size * n_branches > size:
            raise _OutOfBounds(f"branches [{branches_ptr:#x}, +{BRANCH.size * n_branches}) lie "
                               f"outside memory ({size} bytes)")
        fields = _words(4 * n_branches).unpack_from(buf, branches_ptr)
        out = []
        ff_left = self.max_ff
        for i in range(n_branches):
            backtrack, mask_ptr, n_ff, ff_ptr = fields[4 * i:4 * i + 4]
            where = f"branch {i}: " if n_branches > 1 else ""
            mask = self._mask(inst, mask_ptr, where) if mask_ptr else None
            ff: list[list[int]] = []
            if n_ff:
                if mask is None and n_ff > 1:
                    raise Invalid("invalid_result", f"{where}{n_ff} fast-forward lists without a mask "
                                   f"(only one is allowed)")
                if n_ff > ff_left:  # lists under a mask are non-empty: this many cannot fit
                    raise Invalid("limit", f"{where}{n_ff} fast-forward lists, over the limit of "
                                   f"{self.max_ff} fast-forward tokens")
                ff, used = self._ff_lists(inst, ff_ptr, n_ff, ff_left, where, mask is not None, backtrack)
                ff_left -= used
            out.append(Branch(backtrack, mask, ff))
        return out

    def _mask(self, inst, mask_ptr: int, where: str) -> np.ndarray:
        size = inst.size
        if mask_ptr + self.mask_bytes > size:
            raise _OutOfBounds(f"{where}mask [{mask_ptr:#x}, +{self.mask_bytes}) lies "
                               f"outside memory ({size} bytes)")
        if mask_ptr & 3 == 0:
            mask = inst.u32[mask_ptr >> 2:(mask_ptr >> 2) + self.mask_words]  # zero-copy view
        else:  # unaligned (a C guest never does this): copy rather than hand out unaligned data
            mask = np.frombuffer(inst.buf, dtype=np.uint32, count=self.mask_words, offset=mask_ptr).copy()
        if self.tail_bits and int(mask[-1]) >> self.tail_bits:
            raise Invalid("invalid_result", f"{where}mask allows token ids at or past the vocabulary "
                           f"size {self.vocab}")
        if mask.tobytes() == self._zeros:  # a copy + memcmp: 4x faster than mask.any()
            raise Invalid("invalid_result", f"{where}mask allows no token at all")
        return mask

    def _ff_lists(self, inst, ff_ptr: int, n_ff: int, ff_left: int, where: str,
                  masked: bool, backtrack: int) -> tuple[list[list[int]], int]:
        buf, size = inst.buf, inst.size
        if ff_ptr + TOKENS.size * n_ff > size:
            raise _OutOfBounds(f"{where}fast-forward records [{ff_ptr:#x}, +{TOKENS.size * n_ff}) "
                               f"lie outside memory ({size} bytes)")
        recs = _words(2 * n_ff).unpack_from(buf, ff_ptr)
        total = sum(recs[0::2])
        if total > ff_left:
            raise Invalid("limit", f"{where}{total} fast-forward tokens, over the limit of "
                           f"{self.max_ff} per step")
        lists = []
        vocab = self.vocab
        for j in range(n_ff):
            n, tokens_ptr = recs[2 * j], recs[2 * j + 1]
            if n == 0:
                if masked:
                    raise Invalid("invalid_result", f"{where}fast-forward list {j} is empty (lists "
                                   f"under a mask must not be)")
                if backtrack == 0:
                    raise Invalid("invalid_result", f"{where}empty fast-forward without a backtrack "
                                   f"(it would do nothing)")
                lists.append([])
                continue
            if tokens_ptr + 4 * n > size:
                raise _OutOfBounds(f"{where}fast-forward list {j} [{tokens_ptr:#x}, "
                                   f"+{4 * n}) lies outside memory ({size} bytes)")
            if n <= 16:
                tokens = list(_words(n).unpack_from(buf, tokens_ptr))
                top = max(tokens)
            else:
                arr = np.frombuffer(buf, dtype="<u4", count=n, offset=tokens_ptr)
                top = int(arr.max())
                tokens = arr.tolist()
            if top >= vocab:
                raise Invalid("invalid_result", f"{where}fast-forward list {j} holds token id {top}, "
                               f"outside the vocabulary (0..{vocab - 1})")
            lists.append(tokens)
        return lists, total
