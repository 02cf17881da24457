"""The RTT1 token table (docs/abi.md, "The token table"), built once per tokenizer.

Controllers that constrain decoding need every token's bytes and, to build masks quickly, a
trie over them. Building the trie in the guest at every start would cost milliseconds, so the
host builds it once, in one flat u32 array the guest copies in with a single call:

    header   magic "RTT1", vocab_size, n_nodes, bytes_len
    offsets  vocab_size + 1 entries into `bytes`
    nodes    n_nodes x (byte | (token_id + 1) << 8, subtree size), depth-first pre-order
    bytes    token bytes, zero-padded to a multiple of 4

The trie's nodes are exactly the distinct non-empty prefixes of the token byte strings, plus
the root. Depth-first pre-order with children in increasing byte order is the same as sorting
those prefixes as byte strings (a prefix sorts before its extensions, siblings sort by their
last byte), so the trie is a sort plus one stack pass for the subtree sizes.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

from .abi import TOKEN_TABLE_HEADER_WORDS as HEADER_WORDS
from .abi import TOKEN_TABLE_MAGIC as MAGIC

__all__ = ["MAGIC", "build_token_table", "token_table_for", "parse_header"]

MAX_VOCAB = (1 << 24) - 2  # token_id + 1 must fit in the 24 high bits of word0

_cache: "weakref.WeakKeyDictionary[object, bytes]" = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()


def _table_bytes(tokenizer) -> list[bytes]:
    """Bytes of every id as the table spells them: special tokens are empty (they are
    referred to by id), as are ids the tokenizer pads its vocabulary with."""
    special = getattr(tokenizer, "special_token_ids", frozenset())
    table = list(tokenizer.token_bytes)
    for i in special:
        if 0 <= i < len(table):
            table[i] = b""
    return table


def build_token_table(tokenizer) -> bytes:
    """The RTT1 table of `tokenizer` (anything with `token_bytes` and `special_token_ids`)."""
    token_bytes = _table_bytes(tokenizer)
    vocab = len(token_bytes)
    if vocab > MAX_VOCAB:
        raise ValueError(f"vocabulary of {vocab} tokens is too large for the RTT1 table")

    lengths = np.fromiter(map(len, token_bytes), dtype=np.int64, count=vocab)
    offsets = np.zeros(vocab + 1, dtype=np.uint32)
    np.cumsum(lengths, out=offsets[1:])
    data = b"".join(token_bytes)

    # Smallest id per distinct byte string (ids are visited in increasing order).
    owner: dict[bytes, int] = {}
    for i, b in enumerate(token_bytes):
        if b and b not in owner:
            owner[b] = i
    prefixes = {b[:k] for b in owner for k in range(1, len(b) + 1)}
    nodes_sorted = sorted(prefixes)

    n_nodes = len(nodes_sorted) + 1
    word0 = np.zeros(n_nodes, dtype=np.uint32)
    size = np.zeros(n_nodes, dtype=np.uint32)
    # Root (node 0): no byte, no token; its subtree is the whole trie.
    size[0] = n_nodes
    stack: list[tuple[bytes, int]] = []  # open ancestors: (prefix, node index)
    get_owner = owner.get
    for idx, p in enumerate(nodes_sorted, start=1):
        while stack and not p.startswith(stack[-1][0]):
            q, j = stack.pop()
            size[j] = idx - j
        tid = get_owner(p)
        word0[idx] = p[-1] | ((tid + 1) << 8 if tid is not None else 0)
        stack.append((p, idx))
    while stack:
        q, j = stack.pop()
        size[j] = n_nodes - j

    nodes = np.empty((n_nodes, 2), dtype=np.uint32)
    nodes[:, 0] = word0
    nodes[:, 1] = size
    pad = (-len(data)) % 4
    header = np.array([MAGIC, vocab, n_nodes, len(data)], dtype=np.uint32)
    return b"".join([header.astype("<u4").tobytes(), offsets.astype("<u4").tobytes(),
                     nodes.astype("<u4").tobytes(), data, b"\0" * pad])


def token_table_for(tokenizer) -> bytes:
    """The table of `tokenizer`, built on first use and cached for the tokenizer's lifetime."""
    with _cache_lock:
        try:
            return _cache[tokenizer]
        except (KeyError, TypeError):
            pass
    table = build_token_table(tokenizer)  # outside the lock: a large vocabulary takes a while
    with _cache_lock:
        try:
            return _cache.setdefault(tokenizer, table)
        except TypeError:  # not weak-referenceable: don't cache
            return table


def parse_header(table: bytes) -> dict:
    """Decode a table into numpy views (for tests and tools): header fields, offsets,
    nodes (n, 2) and the bytes."""
    words = np.frombuffer(table, dtype="<u4")
    magic, vocab, n_nodes, bytes_len = (int(x) for x in words[:HEADER_WORDS])
    if magic != MAGIC:
        raise ValueError("not an RTT1 token table")
    o = HEADER_WORDS
    offsets = words[o:o + vocab + 1]
    o += vocab + 1
    nodes = words[o:o + 2 * n_nodes].reshape(n_nodes, 2)
    o += 2 * n_nodes
    data = table[4 * o:4 * o + bytes_len]
    return {"vocab_size": vocab, "n_nodes": n_nodes, "bytes_len": bytes_len,
            "offsets": offsets, "nodes": nodes, "bytes": data}
