"""native/attention.c: a group of rows (consecutive tokens of one sequence: a drafted
continuation, a prefill chunk) attends over shared key tiles, and each row's output is bit for bit
what that token gets when it is decoded alone - the property that keeps speculative verification
exact. Checked against one-token calls and against a float64 reference."""

import math

import pytest
import torch

from rudder import kernels

pytestmark = pytest.mark.skipif("not kernels.available()", reason="no native kernels")  # evaluated at set-up, not collection

BLOCK = 16


def rope_tables(max_pos: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().contiguous(), ang.sin().contiguous()


class Case:
    """Two sequences with scattered blocks, random K/V already cached for their contexts."""

    def __init__(self, heads, kv_heads, d, dtype, contexts, seed=0, block=BLOCK):
        g = torch.Generator().manual_seed(seed)
        self.heads, self.kv_heads, self.d, self.dtype = heads, kv_heads, d, dtype
        self.contexts, self.block = contexts, block
        width = (max(contexts) + 64) // block + 1
        blocks = torch.randperm(width * len(contexts), generator=g)
        self.tables = blocks.reshape(len(contexts), width).to(torch.int64)
        n_slots = width * len(contexts) * block
        self.k = torch.randn(n_slots, kv_heads, d, generator=g).to(dtype)
        self.v = torch.randn(n_slots, kv_heads, d, generator=g).to(dtype)
        self.cos, self.sin = rope_tables(max(contexts) + 64, d)
        self.gen = g

    def slot(self, seq, pos):
        return int(self.tables[seq, pos // self.block]) * self.block + pos % self.block

    def qkv(self, n):
        return torch.randn(n, (self.heads + 2 * self.kv_heads) * self.d, generator=self.gen).to(self.dtype)

    def run(self, tokens, qkv, k, v, threads=None):
        """tokens: [(seq, position)]; attention of those rows in one call (on `threads` threads)."""
        positions = torch.tensor([p for _, p in tokens], dtype=torch.int64)
        seq_of = torch.tensor([s for s, _ in tokens], dtype=torch.int64)
        slots = torch.tensor([self.slot(s, p) for s, p in tokens], dtype=torch.int64)
        step = kernels.AttentionStep(positions, slots, seq_of, self.tables, self.block, self.cos, self.sin, self.heads,
                                     self.kv_heads, self.d, self.dtype, self.dtype, 1 / math.sqrt(self.d))
        if threads is not None:
            step.struct.threads = threads
        return kernels.attention(step, qkv, k, v)


@pytest.mark.parametrize("heads,kv_heads,d,dtype", [(9, 3, 64, torch.bfloat16), (9, 3, 64, torch.float32),
                                                    (4, 2, 16, torch.float32), (6, 2, 48, torch.bfloat16),
                                                    (12, 1, 16, torch.float32), (20, 2, 32, torch.bfloat16)])
def test_rows_of_a_group_equal_rows_decoded_one_at_a_time(heads, kv_heads, d, dtype):
    """Rows at positions that start and end inside key tiles, groups longer than one call's most
    (40 rows), two sequences interleaved and back to back; every output row and every K/V slot
    written equals the one-token calls' bit for bit. The generic code (head_dim 48 or 32, or 16
    with more than 4 heads per KV head) keeps 16 rows x up to 16 heads of running state per item."""
    case = Case(heads, kv_heads, d, dtype, contexts=[7, 37])
    rows = [(0, 7 + i) for i in range(9)] + [(1, 37 + i) for i in range(40)] + [(0, 16), (1, 77)]
    qkv = case.qkv(len(rows))
    k_all, v_all = case.k.clone(), case.v.clone()
    together = case.run(rows, qkv, k_all, v_all)

    k_one, v_one = case.k.clone(), case.v.clone()
    alone = torch.cat([case.run([r], qkv[i:i + 1], k_one, v_one) for i, r in enumerate(rows)])
    assert torch.equal(k_all, k_one) and torch.equal(v_all, v_one)
    assert torch.equal(together, alone)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_a_verified_draft_split_for_the_threads_equals_rows_decoded_alone(threads):
    """A verified draft is one group per KV head, too few items for the threads: the call splits
    it into groups of half the rows; every row still equals the one-token call bit for bit."""
    case = Case(9, 3, 64, torch.bfloat16, contexts=[37])
    rows = [(0, 37 + i) for i in range(9)]
    qkv = case.qkv(len(rows))
    k_all, v_all = case.k.clone(), case.v.clone()
    together = case.run(rows, qkv, k_all, v_all, threads=threads)
    k_one, v_one = case.k.clone(), case.v.clone()
    alone = torch.cat([case.run([r], qkv[i:i + 1], k_one, v_one, threads=1) for i, r in enumerate(rows)])
    assert torch.equal(k_all, k_one) and torch.equal(v_all, v_one)
    assert torch.equal(together, alone)


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("heads,kv_heads,d,dtype,block", [(9, 3, 64, torch.bfloat16, 16), (9, 3, 64, torch.float32, 16),
                                                          (8, 1, 128, torch.bfloat16, 16), (9, 3, 64, torch.bfloat16, 8),
                                                          (4, 2, 16, torch.float32, 32)])
def test_decoding_rows_over_a_shared_prefix_equal_rows_decoded_alone(threads, heads, kv_heads, d, dtype, block):
    """Decoding rows of sequences whose tables begin with the same blocks (a prompt from the
    prefix cache) read the shared tiles once, as a cascade; every row equals its one-token call
    bit for bit. Contexts end inside a tile and on one; one sequence shares fewer blocks, one
    none, and a prefill chunk comes in the same call."""
    contexts = [80, 83, 91, 96, 88, 40, 70]
    case = Case(heads, kv_heads, d, dtype, contexts, block=block)
    share = 80 // block  # the first 80 positions
    own = int(case.tables[4, share - 1])
    case.tables[1:5, :share] = case.tables[0, :share]
    case.tables[4, share - 1] = own  # the fifth shares one block fewer
    rows = [(i, contexts[i]) for i in range(5)] + [(5, 40 + i) for i in range(4)] + [(6, 70)]
    qkv = case.qkv(len(rows))
    before = kernels.attention_cascade_rows()
    k_all, v_all = case.k.clone(), case.v.clone()
    together = case.run(rows, qkv, k_all, v_all, threads=threads)
    assert kernels.attention_cascade_rows() - before >= 4  # the call took the cascade
    k_one, v_one = case.k.clone(), case.v.clone()
    alone = torch.cat([case.run([r], qkv[i:i + 1], k_one, v_one, threads=1) for i, r in enumerate(rows)])
    assert torch.equal(k_all, k_one) and torch.equal(v_all, v_one)
    assert torch.equal(together, alone)


def test_a_group_matches_a_float64_reference():
    """The grouped rows compute attention: causal over each row's own context, RoPE applied."""
    heads, kv_heads, d = 4, 2, 16
    case = Case(heads, kv_heads, d, torch.float32, contexts=[21])
    rows = [(0, 21 + i) for i in range(12)]
    qkv = case.qkv(len(rows))
    k, v = case.k.clone(), case.v.clone()
    out = case.run(rows, qkv, k, v).double().reshape(len(rows), heads, d)

    def rope(x, pos):  # rotate-half RoPE at one position
        c, s = case.cos[pos].double(), case.sin[pos].double()
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return x * c + torch.cat([-x2, x1], dim=-1) * s

    q = qkv.double()[:, : heads * d].reshape(len(rows), heads, d)
    for i, (seq, pos) in enumerate(rows):
        keys = torch.stack([k[case.slot(seq, p)] for p in range(pos + 1)]).double()  # [ctx, kvh, d]
        vals = torch.stack([v[case.slot(seq, p)] for p in range(pos + 1)]).double()
        for hd in range(heads):
            g = hd // (heads // kv_heads)
            scores = keys[:, g] @ rope(q[i, hd], pos) / math.sqrt(d)
            want = torch.softmax(scores, 0) @ vals[:, g]
            assert torch.allclose(out[i, hd], want, atol=1e-4), (i, hd)


@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (8, 1, 128), (6, 2, 32)])
def test_bf16_rows_match_a_float64_reference(heads, kv_heads, d):
    """A bf16 model's attention multiplies bf16 pairs (its queries and softmax weights rounded to
    bf16, as its torch path holds them): every kind of item - decoding rows alone, a cascade over a
    shared prefix, a prefill group - stays within bf16's precision of the exact result."""
    contexts = [80, 83, 91, 30]
    case = Case(heads, kv_heads, d, torch.bfloat16, contexts)
    case.tables[1:3, :5] = case.tables[0, :5]  # three rows share 80 positions: a cascade
    rows = [(i, contexts[i]) for i in range(3)] + [(3, 30 + i) for i in range(12)]
    qkv = case.qkv(len(rows))
    k, v = case.k.clone(), case.v.clone()
    out = case.run(rows, qkv, k, v).double().reshape(len(rows), heads, d)

    def rope(x, pos):
        c, s = case.cos[pos].double(), case.sin[pos].double()
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return x * c + torch.cat([-x2, x1], dim=-1) * s

    q = qkv.double()[:, : heads * d].reshape(len(rows), heads, d)
    errors = []
    for i, (seq, pos) in enumerate(rows):
        keys = torch.stack([k[case.slot(seq, p)] for p in range(pos + 1)]).double()
        vals = torch.stack([v[case.slot(seq, p)] for p in range(pos + 1)]).double()
        for hd in range(heads):
            g = hd // (heads // kv_heads)
            want = torch.softmax(keys[:, g] @ rope(q[i, hd], pos) / math.sqrt(d), 0) @ vals[:, g]
            errors.append((out[i, hd] - want).abs())
    errors = torch.cat(errors)
    assert errors.max() < 1.5e-2 and errors.mean() < 1e-3, (errors.max(), errors.mean())
