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


def to_pairs(k, v, block):
    """Standard caches [slots, kv heads, d] in engine/kv_cache.py's paired layout, written out
    here on their own: per block and KV head, keys [d/2][position][2], values [position/2][d][2]."""
    n, kv_heads, d = k.shape
    blocks = n // block
    keys = k.view(blocks, block, kv_heads, d // 2, 2).permute(0, 2, 3, 1, 4).reshape(blocks, kv_heads, block * d)
    values = v.view(blocks, block // 2, 2, kv_heads, d).permute(0, 3, 1, 4, 2).reshape(blocks, kv_heads, block * d)
    return keys.contiguous(), values.contiguous()


def from_pairs(keys, values, d):
    blocks, kv_heads, n = keys.shape
    block = n // d
    k = keys.view(blocks, kv_heads, d // 2, block, 2).permute(0, 3, 1, 2, 4).reshape(-1, kv_heads, d)
    v = values.view(blocks, kv_heads, block // 2, d, 2).permute(0, 2, 4, 1, 3).reshape(-1, kv_heads, d)
    return k, v


class Case:
    """Two sequences with scattered blocks, random K/V already cached for their contexts; `paired`:
    the caches in pairs, as a bf16 model's KVCache holds them."""

    def __init__(self, heads, kv_heads, d, dtype, contexts, seed=0, block=BLOCK, paired=False):
        g = torch.Generator().manual_seed(seed)
        self.heads, self.kv_heads, self.d, self.dtype = heads, kv_heads, d, dtype
        self.contexts, self.block, self.paired = contexts, block, paired
        width = (max(contexts) + 64) // block + 1
        blocks = torch.randperm(width * len(contexts), generator=g)
        self.tables = blocks.reshape(len(contexts), width).to(torch.int64)
        n_slots = width * len(contexts) * block
        self.k = torch.randn(n_slots, kv_heads, d, generator=g).to(dtype)
        self.v = torch.randn(n_slots, kv_heads, d, generator=g).to(dtype)
        self.cos, self.sin = rope_tables(max(contexts) + 64, d)
        self.gen = g

    def caches(self):
        """Fresh copies of the cached K and V, in the case's layout."""
        return to_pairs(self.k, self.v, self.block) if self.paired else (self.k.clone(), self.v.clone())

    def standard(self, k, v):
        """Caches of the case's layout as [slots, kv heads, d]."""
        return from_pairs(k, v, self.d) if self.paired else (k, v)

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
                                     self.kv_heads, self.d, self.dtype, self.dtype, 1 / math.sqrt(self.d),
                                     paired=self.paired)
        if threads is not None:
            step.struct.threads = threads
        return kernels.attention(step, qkv, k, v)


@pytest.mark.parametrize("heads,kv_heads,d,dtype,paired", [(9, 3, 64, torch.bfloat16, True),
                                                           (9, 3, 64, torch.bfloat16, False),
                                                           (9, 3, 64, torch.float32, False),
                                                           (4, 2, 16, torch.float32, False),
                                                           (6, 2, 48, torch.bfloat16, False),
                                                           (12, 1, 16, torch.float32, False),
                                                           (20, 2, 32, torch.bfloat16, True)])
def test_rows_of_a_group_equal_rows_decoded_one_at_a_time(heads, kv_heads, d, dtype, paired):
    """Rows at positions that start and end inside key tiles, groups longer than one call's most
    (40 rows), two sequences interleaved and back to back; every output row and every K/V slot
    written equals the one-token calls' bit for bit. The generic code (head_dim 48 or 32, or 16
    with more than 4 heads per KV head) keeps 16 rows x up to 16 heads of running state per item."""
    case = Case(heads, kv_heads, d, dtype, contexts=[7, 37], paired=paired)
    rows = [(0, 7 + i) for i in range(9)] + [(1, 37 + i) for i in range(40)] + [(0, 16), (1, 77)]
    qkv = case.qkv(len(rows))
    k_all, v_all = case.caches()
    together = case.run(rows, qkv, k_all, v_all)

    k_one, v_one = case.caches()
    alone = torch.cat([case.run([r], qkv[i:i + 1], k_one, v_one) for i, r in enumerate(rows)])
    assert torch.equal(k_all, k_one) and torch.equal(v_all, v_one)
    assert torch.equal(together, alone)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_a_verified_draft_split_for_the_threads_equals_rows_decoded_alone(threads):
    """A verified draft is one group per KV head, too few items for the threads: the call splits
    it into groups of half the rows; every row still equals the one-token call bit for bit."""
    case = Case(9, 3, 64, torch.bfloat16, contexts=[37], paired=True)
    rows = [(0, 37 + i) for i in range(9)]
    qkv = case.qkv(len(rows))
    k_all, v_all = case.caches()
    together = case.run(rows, qkv, k_all, v_all, threads=threads)
    k_one, v_one = case.caches()
    alone = torch.cat([case.run([r], qkv[i:i + 1], k_one, v_one, threads=1) for i, r in enumerate(rows)])
    assert torch.equal(k_all, k_one) and torch.equal(v_all, v_one)
    assert torch.equal(together, alone)


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("heads,kv_heads,d,dtype,block,paired", [(9, 3, 64, torch.bfloat16, 16, True),
                                                                 (9, 3, 64, torch.bfloat16, 32, True),
                                                                 (9, 3, 64, torch.float32, 16, False),
                                                                 (8, 1, 128, torch.bfloat16, 16, True),
                                                                 (9, 3, 64, torch.bfloat16, 8, False),
                                                                 (4, 2, 16, torch.float32, 32, False)])
def test_decoding_rows_over_a_shared_prefix_equal_rows_decoded_alone(threads, heads, kv_heads, d, dtype, block, paired):
    """Decoding rows of sequences whose tables begin with the same blocks (a prompt from the
    prefix cache) read the shared tiles once, as a cascade; every row equals its one-token call
    bit for bit. Contexts end inside a tile and on one; one sequence shares fewer blocks, one
    none, and a prefill chunk comes in the same call."""
    contexts = [80, 83, 91, 96, 88, 40, 70]
    case = Case(heads, kv_heads, d, dtype, contexts, block=block, paired=paired)
    share = 80 // block  # the first 80 positions
    own = int(case.tables[4, share - 1])
    case.tables[1:5, :share] = case.tables[0, :share]
    case.tables[4, share - 1] = own  # the fifth shares one block fewer
    rows = [(i, contexts[i]) for i in range(5)] + [(5, 40 + i) for i in range(4)] + [(6, 70)]
    qkv = case.qkv(len(rows))
    before = kernels.attention_cascade_rows()
    k_all, v_all = case.caches()
    together = case.run(rows, qkv, k_all, v_all, threads=threads)
    assert kernels.attention_cascade_rows() - before >= 4  # the call took the cascade
    k_one, v_one = case.caches()
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


@pytest.mark.parametrize("heads,kv_heads,d,paired", [(9, 3, 64, True), (9, 3, 64, False), (8, 1, 128, True),
                                                     (6, 2, 32, True)])
def test_bf16_rows_match_a_float64_reference(heads, kv_heads, d, paired):
    """A bf16 model's attention multiplies bf16 pairs (its queries and softmax weights rounded to
    bf16, as its torch path holds them): every kind of item - decoding rows alone, a cascade over a
    shared prefix, a prefill group - stays within bf16's precision of the exact result."""
    contexts = [80, 83, 91, 30]
    case = Case(heads, kv_heads, d, torch.bfloat16, contexts, paired=paired)
    case.tables[1:3, :5] = case.tables[0, :5]  # three rows share 80 positions: a cascade
    rows = [(i, contexts[i]) for i in range(3)] + [(3, 30 + i) for i in range(12)]
    qkv = case.qkv(len(rows))
    k, v = case.caches()
    out = case.run(rows, qkv, k, v).double().reshape(len(rows), heads, d)
    k, v = case.standard(k, v)

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


@pytest.mark.parametrize("block", [16, 32])
def test_a_paired_cache_gives_the_standard_layouts_results(block):
    """The same keys and values in pairs (a bf16 model's KVCache) and in the standard layout: the
    same outputs bit for bit, for rows alone, a prefill group and a cascade, and the new tokens'
    K/V land in the same places. The paired cache is read in place, except where a context ends
    inside a tile (copied with zeros past its end); the standard one is gathered."""
    contexts = [80, 83, 91, 30]
    runs = []
    for paired in (False, True):
        case = Case(9, 3, 64, torch.bfloat16, contexts, block=block, paired=paired)
        case.tables[1:3, :80 // block] = case.tables[0, :80 // block]
        rows = [(i, contexts[i]) for i in range(3)] + [(3, 30 + i) for i in range(12)]
        k, v = case.caches()
        out = case.run(rows, case.qkv(len(rows)), k, v, threads=2)
        runs.append((out, *case.standard(k, v)))
    (out_s, k_s, v_s), (out_p, k_p, v_p) = runs
    assert torch.equal(out_s, out_p)
    assert torch.equal(k_s, k_p) and torch.equal(v_s, v_p)


def test_the_torch_path_reads_and_writes_a_paired_cache():
    """engine/kv_cache.py's write_slots / read_blocks (the torch path's access) on a paired cache:
    what it writes reads back at the same slots, and the blocks read equal the standard layout's."""
    from rudder.engine.kv_cache import read_blocks, write_slots

    g = torch.Generator().manual_seed(1)
    k = torch.randn(6 * 16, 3, 64, generator=g).to(torch.bfloat16)
    v = torch.randn(6 * 16, 3, 64, generator=g).to(torch.bfloat16)
    kp, vp = to_pairs(k, v, 16)
    slots = torch.tensor([5, 17, 18, 95, 40])
    new_k = torch.randn(5, 3, 64, generator=g).to(torch.bfloat16)
    new_v = torch.randn(5, 3, 64, generator=g).to(torch.bfloat16)
    write_slots(kp, vp, slots, new_k, new_v)
    k[slots], v[slots] = new_k, new_v
    assert torch.equal(torch.stack(from_pairs(kp, vp, 64)), torch.stack((k, v)))
    blocks = torch.tensor([3, 0, 5])
    keys, values = read_blocks(kp, vp, blocks, 64)
    assert torch.equal(keys, k.view(6, 16, 3, 64)[blocks].reshape(-1, 3, 64))
    assert torch.equal(values, v.view(6, 16, 3, 64)[blocks].reshape(-1, 3, 64))
