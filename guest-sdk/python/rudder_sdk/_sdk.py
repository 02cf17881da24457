"""Controller, Branch, TokenSet and the host functions (wit/controller.wit's `host`)."""

from __future__ import annotations

from wit_world.imports import host as _host

__all__ = ["Branch", "Controller", "HandOff", "Refuse", "Step", "TokenSet", "arg", "config", "detokenize",
           "eos_token", "log", "token_bytes", "tokenize", "var_get", "var_set", "vocab_size"]

_vocab: int | None = None


def vocab_size() -> int:
    global _vocab
    if _vocab is None:
        _vocab = _host.vocab_size()
    return _vocab


def eos_token() -> int | None:
    """The end-of-sequence token id, or None."""
    eos = _host.eos_token()
    return None if eos < 0 else eos


def config(key: int) -> int:
    return _host.config(key)


def arg() -> bytes | None:
    """The request's argument (None during init)."""
    a = _host.arg()
    return None if a is None else a.encode("latin-1")


def tokenize(text: str) -> list[int]:
    return list(_host.tokenize(text))


def detokenize(tokens) -> bytes:
    """The bytes of these tokens (special tokens give none)."""
    return _host.detokenize(list(tokens)).encode("latin-1")


def token_bytes(token: int) -> bytes:
    return detokenize([token])


def log(*parts) -> None:
    """Append to the request's log (print() goes there too)."""
    _host.log(" ".join(str(p) for p in parts) + "\n")


def var_get(key: str) -> bytes | None:
    v = _host.var_get(key)
    return None if v is None else v.encode("latin-1")


def var_set(key: str, value: bytes | str) -> bool:
    if isinstance(value, str):
        value = value.encode("utf-8")
    return _host.var_set(key, bytes(value).decode("latin-1"))


class Refuse(Exception):
    """Raise from init/start to refuse (the request fails with this message), or from
    mid_process to give up."""


class TokenSet:
    """A set of token ids as a bitmask (the mask format of docs/abi.md). Set operations work on
    whole masks at C speed (Python ints); single tokens by bit."""

    __slots__ = ("_bits", "_wire")

    def __init__(self, bits: int = 0):
        self._bits = bits
        self._wire = None  # the mask as the host wants it, made once per value

    @classmethod
    def of(cls, tokens) -> "TokenSet":
        bits = 0
        for t in tokens:
            if 0 <= t < vocab_size():
                bits |= 1 << t
        return cls(bits)

    @classmethod
    def all(cls) -> "TokenSet":
        return cls((1 << vocab_size()) - 1)

    @classmethod
    def from_bytes(cls, mask: bytes) -> "TokenSet":
        return cls(int.from_bytes(mask, "little"))

    @classmethod
    def from_trie(cls, push, start=0) -> "TokenSet":
        """Every token whose bytes a byte-level recognizer accepts: `push(state, byte)` returns
        the next state, or None to reject (the whole subtree is skipped). See Trie."""
        from ._trie import Trie

        return Trie.get().tokens(push, start)

    def add(self, token: int) -> None:
        self._bits |= 1 << token
        self._wire = None

    def discard(self, token: int) -> None:
        self._bits &= ~(1 << token)
        self._wire = None

    def __contains__(self, token: int) -> bool:
        return token >= 0 and (self._bits >> token) & 1 == 1

    def __len__(self) -> int:
        return self._bits.bit_count()

    def __bool__(self) -> bool:
        return self._bits != 0

    def __iter__(self):
        bits, t = self._bits, 0
        while bits:
            low = bits & -bits
            t = low.bit_length() - 1
            yield t
            bits ^= low

    def __or__(self, other: "TokenSet") -> "TokenSet":
        return TokenSet(self._bits | other._bits)

    def __and__(self, other: "TokenSet") -> "TokenSet":
        return TokenSet(self._bits & other._bits)

    def __sub__(self, other: "TokenSet") -> "TokenSet":
        return TokenSet(self._bits & ~other._bits)

    def __invert__(self) -> "TokenSet":
        return TokenSet(((1 << vocab_size()) - 1) & ~self._bits)

    def __eq__(self, other) -> bool:
        return isinstance(other, TokenSet) and self._bits == other._bits

    def __hash__(self) -> int:
        return hash(self._bits)

    def to_bytes(self) -> bytes:
        n = (vocab_size() + 31) // 32 * 4
        return self._bits.to_bytes(n, "little")

    def wire(self) -> str:
        """The mask as a WIT bytes string (one char per byte), cached."""
        if self._wire is None:
            self._wire = self.to_bytes().decode("latin-1")
        return self._wire

    def __getstate__(self):
        return self._bits

    def __setstate__(self, bits):
        self._bits, self._wire = bits, None

    def __repr__(self) -> str:
        return f"TokenSet({len(self)} tokens)"


class Branch:
    """What one sequence does next (docs/abi.md): backtrack, then sample (under `mask`, with
    ff lists for the sampled token) or fast-forward (`ff` without a mask: one list)."""

    __slots__ = ("backtrack", "mask", "ff")

    def __init__(self, backtrack: int = 0, mask=None, ff=()):
        self.backtrack = backtrack
        self.mask = mask
        self.ff = ff

    @classmethod
    def sample(cls, mask=None, ff_lists=(), backtrack: int = 0) -> "Branch":
        """Sample one token (under `mask`: a TokenSet or the mask's bytes); if an ff list
        starts with the sampled token, that whole list is appended."""
        return cls(backtrack, mask, [list(x) for x in ff_lists])

    @classmethod
    def fast_forward(cls, tokens, backtrack: int = 0) -> "Branch":
        return cls(backtrack, None, [list(tokens)])

    @classmethod
    def take_back(cls, n: int) -> "Branch":
        """Only remove `n` tokens (the next step has fresh logits)."""
        return cls(n, None, [[]])

    def __repr__(self) -> str:
        return f"Branch(backtrack={self.backtrack}, mask={self.mask!r}, ff={self.ff!r})"


class HandOff:
    """Hand the sequence to a built-in constraint controller (json, regex, grammar, choices...)
    with this argument until it stops; mid_process is then called with every token of the span."""

    __slots__ = ("controller", "arg")

    def __init__(self, controller: str, arg: str = ""):
        self.controller, self.arg = controller, arg

    @classmethod
    def json(cls, schema) -> "HandOff":
        import json

        return cls("json", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def regex(cls, pattern: str) -> "HandOff":
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, text: str) -> "HandOff":
        return cls("grammar", text)


class Step:
    """One call of mid_process: `index` (0 first), `branch` (after a fork: which branch this
    sequence is), `backtrack` and `tokens` (removed and appended since the last step; the
    prompt on the first), `seq` (the whole sequence) of which `seq[:prompt_len]` is the prompt."""

    __slots__ = ("index", "branch", "backtrack", "tokens", "seq", "prompt_len")

    def __init__(self, index, branch, backtrack, tokens, seq, prompt_len):
        self.index, self.branch, self.backtrack, self.tokens = index, branch, backtrack, tokens
        self.seq, self.prompt_len = seq, prompt_len

    @property
    def generated(self) -> list[int]:
        return self.seq[self.prompt_len:]


class Controller:
    """Subclass this and define mid_process(step) -> Branch | list[Branch] | HandOff | None.

    Optional: init() (once per module and tokenizer: what it leaves on self is saved and every
    request starts from it), start(arg: bytes) (once per request; raise Refuse to refuse it).
    The SDK keeps `self.seq` and `self.prompt_len` (the sequence so far) for you."""

    def init(self) -> None:
        pass

    def start(self, arg: bytes) -> None:
        pass

    def mid_process(self, step: Step):
        raise NotImplementedError("a controller must define mid_process(step)")
