"""The paged-KV forward pass equals a dense causal reference, under chunking, batching,
pop-then-reappend and fork (tiny random model, so it runs in seconds)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from rudder.config import TINY_CONFIG
from rudder.engine.block_manager import BlockManager
from rudder.engine.model_runner import ModelRunner, ScheduledSeq
from rudder.engine.sequence import SamplingParams, Sequence
from rudder.model import apply_rope, build_model

CFG = TINY_CONFIG


@pytest.fixture(scope="module")
def model():
    return build_model(CFG, None, seed=1)


def dense_logits(model, tokens: list[int]) -> torch.Tensor:
    """Reference: plain causal attention over the whole sequence, no cache, no paging."""
    ids = torch.tensor(tokens)
    T = len(tokens)
    x = model.embed_tokens(ids)
    cos = model.rope_cos[:T].unsqueeze(1)
    sin = model.rope_sin[:T].unsqueeze(1)
    for layer in model.layers:
        a = layer.self_attn
        h = layer.input_layernorm(x)
        q, k, v = a.qkv_proj(h).split(a.splits, dim=-1)
        q = apply_rope(q.reshape(T, CFG.num_heads, CFG.head_dim), cos, sin).transpose(0, 1)
        k = apply_rope(k.reshape(T, CFG.num_kv_heads, CFG.head_dim), cos, sin).transpose(0, 1)
        v = v.reshape(T, CFG.num_kv_heads, CFG.head_dim).transpose(0, 1)
        rep = CFG.num_heads // CFG.num_kv_heads
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0), is_causal=True)
        x = x + a.o_proj(out.transpose(0, 1).reshape(T, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.logits(model.norm(x))


class Harness:
    """Feeds sequences through BlockManager + ModelRunner the way the engine does."""

    def __init__(self, model, num_blocks=64, block_size=4):
        self.bm = BlockManager(num_blocks, block_size)
        self.runner = ModelRunner(model, num_blocks, block_size)

    def new(self, tokens):
        seq = Sequence(tokens, SamplingParams(), np.random.default_rng(0), 0)
        self.bm.add(seq.seq_id)
        return seq

    def feed(self, feeds: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Feed n pending tokens of each sequence in one ragged step; logits of each last token."""
        batch = []
        for seq, n in feeds:
            slots = self.bm.append(seq.seq_id, n)
            batch.append(ScheduledSeq(seq, n, slots, self.bm.tables[seq.seq_id], True))
        self.runner.copy_blocks(self.bm.take_copies())
        logits = self.runner.run(batch)
        for seq, n in feeds:
            seq.num_cached += n
        return logits

    def pop(self, seq, n):
        self.bm.pop(seq.seq_id, n)
        seq.num_cached -= n
        del seq.token_ids[len(seq.token_ids) - n:]


def test_prefill_matches_dense(model):
    tokens = list(range(3, 40))
    h = Harness(model)
    seq = h.new(tokens)
    got = h.feed([(seq, len(tokens))])[0]
    torch.testing.assert_close(got, dense_logits(model, tokens)[-1], atol=1e-4, rtol=1e-4)


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=5), chunk=st.integers(1, 12), data=st.data())
def test_ragged_chunked_batches_match_dense(model, lengths, chunk, data):
    """Several sequences fed in chunks of different sizes in one batch: every step's last-token
    logits equal the dense reference on that prefix."""
    rng = np.random.default_rng(sum(lengths) * 31 + chunk)
    h = Harness(model, num_blocks=200)
    seqs = [h.new(rng.integers(3, CFG.vocab_size, n).tolist()) for n in lengths]
    # Causal: row k of the whole sequence's dense logits is the reference for its first k+1 tokens.
    dense = {s.seq_id: dense_logits(model, s.token_ids) for s in seqs}
    while any(s.num_pending for s in seqs):
        feeds = [(s, min(s.num_pending, data.draw(st.integers(1, chunk)))) for s in seqs if s.num_pending]
        logits = h.feed(feeds)
        for (seq, _), row in zip(feeds, logits):
            torch.testing.assert_close(row, dense[seq.seq_id][seq.num_cached - 1], atol=1e-4, rtol=1e-4)


def test_pop_then_reappend_equals_fresh_run(model):
    h = Harness(model)
    seq = h.new(list(range(5, 27)))
    h.feed([(seq, 22)])
    h.pop(seq, 9)  # crosses block boundaries (block size 4)
    seq.token_ids.extend([100, 101, 102, 103, 104])
    got = h.feed([(seq, 5)])[0]
    fresh = dense_logits(model, list(range(5, 18)) + [100, 101, 102, 103, 104])[-1]
    torch.testing.assert_close(got, fresh, atol=1e-4, rtol=1e-4)
    assert h.bm.num_free == 64 - 5  # 18 positions in blocks of 4


def test_forks_diverge_without_disturbing_each_other(model):
    h = Harness(model)
    parent = h.new(list(range(7, 25)))  # 18 tokens: last block half full, so forks copy it on write
    h.feed([(parent, 18)])
    child = Sequence(list(parent.token_ids), SamplingParams(), np.random.default_rng(0), 0, branch=1)
    child.num_cached = parent.num_cached
    h.bm.fork(parent.seq_id, child.seq_id)
    parent.token_ids.append(200)
    child.token_ids.extend([300, 301])
    logits = h.feed([(parent, 1), (child, 2)])
    torch.testing.assert_close(logits[0], dense_logits(model, list(range(7, 25)) + [200])[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1], dense_logits(model, list(range(7, 25)) + [300, 301])[-1], atol=1e-4, rtol=1e-4)
    h.bm.check_invariants()
