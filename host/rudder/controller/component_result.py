"""Reading what a component's hook returned (C API values) into Branch records, checked by the
rules of docs/abi.md exactly as result.py checks a core module's records.

A mask arrives as a WIT `bytes` string (one char per byte): its UTF-8 is copied out in one
piece and decoded in C (no Python loop over the vocabulary); ff lists are read with one
strided numpy view each. Every kind tag is checked before its payload is read, although the
export types were checked at load: a mismatch must never make the host read the wrong field.
"""

from __future__ import annotations

import numpy as np

from ..branch import Branch
from .capi import KIND, ffi
from .component_host import u32_list
from .result import BranchRules, Invalid

__all__ = ["StepDecoder", "HandOff", "read_failure", "read_string"]



class HandOff:
    """A step that hands the sequence to a built-in controller."""

    __slots__ = ("controller", "arg")

    def __init__(self, controller: str, arg: str):
        self.controller, self.arg = controller, arg


def read_string(val) -> bytes:
    if val.kind != KIND["STRING"]:
        raise Invalid("invalid_result", "a value that should be a string is not")
    s = val.of.string
    return ffi.unpack(ffi.cast("char *", s.data), s.size) if s.size else b""


def _name(name) -> bytes:
    return ffi.unpack(ffi.cast("char *", name.data), name.size)


def _variant(val) -> tuple[bytes, object]:
    if val.kind != KIND["VARIANT"]:
        raise Invalid("invalid_result", "a value that should be a variant is not")
    var = val.of.variant
    return _name(var.discriminant), var.val


def read_failure(val) -> tuple[str, str]:
    """(case, text) of a `failure` value."""
    case, payload = _variant(val)
    text = read_string(payload[0]).decode("utf-8", "replace") if payload != ffi.NULL else ""
    return case.decode(), " ".join(text.split())[:500]


def _u32s(val, what: str) -> np.ndarray:
    tokens = u32_list(val)
    if tokens is None:
        raise Invalid("invalid_result", f"{what} is not a list<u32>")
    return tokens


class StepDecoder(BranchRules):
    """Lifts a component's `step` values into Branch records."""

    def decode(self, val, log_tail) -> "list[Branch] | HandOff":
        try:
            case, payload = _variant(val)
            if case == b"hand-off":
                return self._hand_off(payload[0])
            if case != b"branches":
                raise Invalid("invalid_result", f"an unknown step {case!r}")
            return self._branches(payload[0])
        except Invalid as e:
            raise self.refusal(e, "mid-process", log_tail()) from None

    def _hand_off(self, val) -> HandOff:
        if val.kind != KIND["RECORD"] or val.of.record.size != 2:
            raise Invalid("invalid_result", "a hand-off that is not a record")
        rec = val.of.record.data
        try:
            name = read_string(rec[0].val).decode("utf-8")
            arg = read_string(rec[1].val).decode("utf-8")
        except UnicodeDecodeError:
            raise Invalid("invalid_result", "a hand-off whose text is not UTF-8") from None
        return HandOff(name, arg)

    def _branches(self, val) -> list[Branch]:
        if val.kind != KIND["LIST"]:
            raise Invalid("invalid_result", "branches that are not a list")
        n = val.of.list.size
        if n == 0:
            return []
        if n > self.max_forks:
            raise Invalid("limit", f"{n} branches, over the limit of {self.max_forks}")
        items = val.of.list.data
        out = []
        ff_left = self.max_ff
        for i in range(n):
            where = f"branch {i}: " if n > 1 else ""
            rec = items[i]
            if rec.kind != KIND["RECORD"] or rec.of.record.size != 3:
                raise Invalid("invalid_result", f"{where}not a branch record")
            fields = rec.of.record.data
            bt = fields[0].val
            if bt.kind != KIND["U32"]:
                raise Invalid("invalid_result", f"{where}backtrack is not a u32")
            backtrack = bt.of.u32
            opt = fields[1].val
            if opt.kind != KIND["OPTION"]:
                raise Invalid("invalid_result", f"{where}mask is not an option")
            mask = self._mask(opt.of.option[0], where) if opt.of.option != ffi.NULL else None
            ff, used = self._ff(fields[2].val, where, mask is not None, backtrack, ff_left)
            ff_left -= used
            out.append(Branch(backtrack, mask, ff))
        return out

    def _mask(self, val, where: str) -> np.ndarray:
        utf8 = read_string(val)
        try:
            raw = utf8 if len(utf8) == self.mask_bytes and utf8.isascii() else utf8.decode("utf-8").encode("latin-1")
        except (UnicodeDecodeError, UnicodeEncodeError):
            raise Invalid("invalid_result", f"{where}mask is not a bytes string (a char past U+00FF)") from None
        if len(raw) != self.mask_bytes:
            raise Invalid("invalid_result", f"{where}mask is {len(raw)} bytes; the vocabulary of {self.vocab} "
                           f"tokens needs {self.mask_bytes}")
        mask = np.frombuffer(raw, dtype="<u4")
        if self.tail_bits and int(mask[-1]) >> self.tail_bits:
            raise Invalid("invalid_result", f"{where}mask allows token ids at or past the vocabulary size {self.vocab}")
        if raw == self._zeros:
            raise Invalid("invalid_result", f"{where}mask allows no token at all")
        return mask

    def _ff(self, val, where: str, masked: bool, backtrack: int, ff_left: int) -> tuple[list[list[int]], int]:
        if val.kind != KIND["LIST"]:
            raise Invalid("invalid_result", f"{where}ff is not a list")
        n_ff = val.of.list.size
        if n_ff == 0:
            return [], 0
        if not masked and n_ff > 1:
            raise Invalid("invalid_result", f"{where}{n_ff} fast-forward lists without a mask (only one is allowed)")
        if n_ff > ff_left:
            raise Invalid("limit", f"{where}{n_ff} fast-forward lists, over the limit of {self.max_ff} "
                           f"fast-forward tokens")
        items = val.of.list.data
        lists, total = [], 0
        for j in range(n_ff):
            tokens = _u32s(items[j], f"{where}fast-forward list {j}")
            total += len(tokens)
            if total > ff_left:
                raise Invalid("limit", f"{where}{total} fast-forward tokens, over the limit of {self.max_ff} per step")
            if len(tokens) == 0:
                if masked:
                    raise Invalid("invalid_result", f"{where}fast-forward list {j} is empty (lists under a mask "
                                   f"must not be)")
                if backtrack == 0:
                    raise Invalid("invalid_result", f"{where}empty fast-forward without a backtrack (it would do nothing)")
            elif int(tokens.max()) >= self.vocab:
                raise Invalid("invalid_result", f"{where}fast-forward list {j} holds token id {int(tokens.max())}, "
                               f"outside the vocabulary (0..{self.vocab - 1})")
            lists.append(tokens.tolist())
        return lists, total
