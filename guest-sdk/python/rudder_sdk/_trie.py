"""The token trie of the host's token table (docs/abi.md, "The token table"), walked with a
byte-level recognizer: a subtree whose prefix the recognizer rejects is skipped whole, so
the cost follows the live part of the vocabulary, not its size."""

from __future__ import annotations

import sys
from array import array

from wit_world.imports import host as _host

__all__ = ["Trie"]

_MAGIC = 0x31545452
_trie = None  # one per instance: fetched on first use (during init, typically), never saved


class Trie:
    def __init__(self, table: bytes):
        words = array("I")
        words.frombytes(table[:len(table) - len(table) % 4])
        if sys.byteorder != "little":
            words.byteswap()
        magic, vocab, n_nodes, _ = words[0], words[1], words[2], words[3]
        if magic != _MAGIC:
            raise ValueError("not an RTT1 token table")
        self.vocab_size = vocab
        self.offsets = words[4:4 + vocab + 1]
        base = 4 + vocab + 1
        self.nodes = words[base:base + 2 * n_nodes]
        self.data = table[4 * (base + 2 * n_nodes):]

    @classmethod
    def get(cls) -> "Trie":
        global _trie
        if _trie is None:
            _trie = cls(_host.token_table().encode("latin-1"))
        return _trie

    def token_bytes(self, token: int) -> bytes:
        return self.data[self.offsets[token]:self.offsets[token + 1]]

    def tokens(self, push, start=0):
        """The TokenSet of tokens whose every byte `push(state, byte)` accepts (returns a state,
        None to reject)."""
        from ._sdk import TokenSet

        nodes = self.nodes
        bits = 0
        n = len(nodes) // 2
        # Depth-first: (node index, end of its subtree, state after its byte).
        stack = [(1, n, start)]
        while stack:
            i, end, state = stack.pop()
            while i < end:
                word0, size = nodes[2 * i], nodes[2 * i + 1]
                s = push(state, word0 & 0xFF)
                if s is None:
                    i += size
                    continue
                tid = word0 >> 8
                if tid:
                    bits |= 1 << (tid - 1)
                if size > 1:
                    stack.append((i + size, end, state))  # the siblings after this subtree
                    i, end, state = i + 1, i + size, s
                else:
                    i += 1
        return TokenSet(bits)
