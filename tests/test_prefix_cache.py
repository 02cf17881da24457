"""Prefix caching: the block manager's bookkeeping under every edit a sequence sees (a property
test), admission from the cache, and engines with the cache on and off giving the same tokens
under every Branch kind."""

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rudder.engine.block_manager import BlockManager, KVCacheFull, block_digest

NUM_BLOCKS, BS = 16, 4


def kv_of(tokens) -> int:
    """What a fake forward pass writes at a position: a function of every token up to it (as a
    real key/value is)."""
    return hash(tuple(tokens)) & 0x7FFFFFFF


class PrefixMachine(RuleBasedStateMachine):
    """Drives a BlockManager with the prefix cache the way the engine does - admit from the cached
    prefix, write (copies first), commit what was written, fork, pop (backtrack, rewind), free -
    over a three-token alphabet so that prompts share prefixes, and checks that every sequence
    reads back exactly the KV of its own tokens and that every registered block holds the KV of
    the prefix its digest names."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BS, prefix_caching=True)
        self.store = np.full(NUM_BLOCKS * BS, -1, dtype=np.int64)
        self.tokens: dict[int, list[int]] = {}  # each sequence's tokens in the cache
        self.known: dict[bytes, list[int]] = {}  # digest -> the KV its block must hold
        self.ids = itertools.count()
        self.hits = 0

    def _write(self, seq, new):
        try:
            slots = self.bm.append(seq, len(new))
        except KVCacheFull:
            return
        for src, dst in self.bm.take_copies():  # what the runner does before the forward
            self.store[dst * BS:(dst + 1) * BS] = self.store[src * BS:(src + 1) * BS]
        toks = self.tokens[seq]
        for slot, t in zip(slots, new):
            toks.append(t)
            self.store[slot] = kv_of(toks)

    def _commit(self, seq):
        toks = self.tokens[seq]
        self.bm.commit(seq, toks, len(toks))
        digest = b""
        for i in range(len(toks) // BS):
            digest = block_digest(digest, toks[i * BS:(i + 1) * BS])
            self.known[digest] = [kv_of(toks[:p + 1]) for p in range(i * BS, (i + 1) * BS)]

    @rule(prompt=st.lists(st.integers(1, 3), min_size=1, max_size=14), commit=st.booleans())
    def admit(self, prompt, commit):
        prefix = self.bm.cached_prefix(prompt)
        if self.bm.blocks_to_admit(prefix, len(prompt)) > self.bm.num_free:
            return
        seq = next(self.ids)
        start = self.bm.add(seq, prefix)
        assert start == len(prefix) * BS < len(prompt)
        self.hits += start
        self.tokens[seq] = list(prompt[:start])
        self._write(seq, prompt[start:])
        if commit:
            self._commit(seq)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new=st.lists(st.integers(1, 3), min_size=1, max_size=6), commit=st.booleans())
    def append(self, data, new, commit):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self._write(seq, new)
        if commit:
            self._commit(seq)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = next(self.ids)
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def pop(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        n = data.draw(st.integers(0, len(self.tokens[seq])))
        self.bm.pop(seq, n)
        del self.tokens[seq][len(self.tokens[seq]) - n:]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(seq)
        del self.tokens[seq]

    @invariant()
    def consistent(self):
        bm = self.bm
        bm.check_invariants()
        for seq, toks in self.tokens.items():
            assert bm.length(seq) == len(toks)
            read = [int(self.store[bm.slot(seq, p)]) for p in range(len(toks))]
            assert read == [kv_of(toks[:p + 1]) for p in range(len(toks))], f"sequence {seq} reads another's KV"
        for digest, block in bm.cached.items():
            assert self.store[block * BS:(block + 1) * BS].tolist() == self.known[digest], \
                "a registered block no longer holds its prefix's KV"
        held = sum(1 for b in range(NUM_BLOCKS) if bm.ref_counts[b])
        assert held + bm.num_free == NUM_BLOCKS

    def teardown(self):
        for seq in list(self.tokens):
            self.bm.free(seq)
        self.bm.check_invariants()
        assert self.bm.num_free == NUM_BLOCKS, "blocks leaked"


TestPrefixMachine = PrefixMachine.TestCase
TestPrefixMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


def test_the_machine_does_hit_the_cache():
    """The property test is not vacuous: its kind of run reuses cached blocks."""
    machine = PrefixMachine()
    prompt = [1, 2, 3, 1, 2, 3, 1, 2, 3]
    machine.admit(prompt, commit=True)
    machine.admit(prompt + [2], commit=False)
    assert machine.hits == 8
    machine.consistent()
    machine.teardown()


# -- the block manager, case by case ------------------------------------------------------------


def committed(bm, seq, tokens):
    bm.add(seq)
    bm.append(seq, len(tokens))
    bm.commit(seq, tokens, len(tokens))


def test_a_new_sequence_starts_from_the_longest_cached_prefix_and_feeds_the_rest():
    bm = BlockManager(8, 4, prefix_caching=True)
    committed(bm, "a", list(range(10)))  # blocks 0-3, 4-7 full and registered; 8-9 not
    prefix = bm.cached_prefix(list(range(8)) + [50, 51])
    assert [b for b, _ in prefix] == bm.tables["a"][:2]
    assert bm.blocks_to_admit(prefix, 10) == 1  # the two shared blocks are held already
    assert bm.add("b", prefix) == 8
    assert bm.ref_counts[bm.tables["a"][0]] == 2
    # a prompt that is all cached still feeds its last block: its last token's logits are wanted
    assert len(bm.cached_prefix(list(range(8)))) == 1
    assert bm.cached_prefix([0, 1, 2, 9, 4, 5, 6, 7, 8]) == []  # the first block differs: nothing
    bm.check_invariants()


def test_released_blocks_stay_cached_until_the_free_ones_run_out_least_recently_used_first():
    bm = BlockManager(6, 4, prefix_caching=True)
    committed(bm, "a", list(range(8)))  # 2 blocks
    committed(bm, "b", list(range(100, 108)))  # 2 blocks
    bm.free("a")
    bm.free("b")
    assert bm.num_free == 6 and len(bm.evictable) == 4
    bm.add("c")
    bm.append("c", 8)  # the 2 never-registered blocks first: everything stays cached
    assert len(bm.cached_prefix(list(range(8)) + [0])) == 2
    bm.append("c", 4)  # then the least recently released, a chain's tail first: "a"'s second block
    assert len(bm.cached_prefix(list(range(8)) + [0])) == 1
    assert len(bm.cached_prefix(list(range(100, 108)) + [0])) == 2
    bm.check_invariants()


def test_a_block_popped_into_is_not_the_cached_one_once_written():
    bm = BlockManager(8, 4, prefix_caching=True)
    committed(bm, "a", list(range(8)))
    block = bm.tables["a"][1]
    bm.pop("a", 2)  # a backtrack into the second block: its data is still that prefix's...
    assert len(bm.cached_prefix(list(range(8)) + [0])) == 2
    bm.append("a", 1)  # ... until it is written: held by "a" alone, it leaves the cache
    assert bm.tables["a"][1] == block and block not in bm.digest_of
    assert len(bm.cached_prefix(list(range(8)) + [0])) == 1
    bm.check_invariants()


def test_a_shared_cached_block_popped_into_is_copied_on_write():
    bm = BlockManager(8, 4, prefix_caching=True)
    committed(bm, "a", list(range(8)))
    bm.add("b", bm.cached_prefix(list(range(8)) + [0]))
    shared = bm.tables["b"][1]
    bm.pop("b", 1)
    bm.append("b", 1)  # "a" still holds it: "b" writes into a copy, the cached block stays
    assert bm.tables["b"][1] != shared and bm.take_copies() == [(shared, bm.tables["b"][1])]
    assert bm.digest_of[shared] and len(bm.cached_prefix(list(range(8)) + [0])) == 2
    bm.check_invariants()


def test_the_same_prefix_computed_twice_at_once_registers_once():
    bm = BlockManager(8, 4, prefix_caching=True)
    committed(bm, "a", list(range(4)))
    committed(bm, "b", list(range(4)))  # admitted before "a" was committed: its own copy
    assert len(bm.cached) == 1 and bm.tables["b"][0] not in bm.digest_of
    bm.free("b")
    assert len(bm.free_blocks) == 7 and not bm.evictable  # "b"'s copy is a plain free block
    bm.check_invariants()


def test_off_it_caches_nothing():
    bm = BlockManager(8, 4)
    committed(bm, "a", list(range(8)))
    assert bm.cached_prefix(list(range(8)) + [0]) == [] and not bm.cached
    bm.free("a")
    assert len(bm.free_blocks) == 8
    bm.check_invariants()


# -- through the scheduler --------------------------------------------------------------------------


def test_admission_starts_from_the_cache_and_counts_the_prompts_hit_once():
    from rudder import SamplingParams
    from rudder.engine.scheduler import Scheduler
    from rudder.engine.sequence import Request, Sequence

    bm = BlockManager(64, 4, prefix_caching=True)
    sched = Scheduler(bm, max_batch_tokens=64)

    def add(prompt):
        params = SamplingParams()
        seq = Sequence(prompt, params, np.random.default_rng(0), Request(0, prompt, params))
        sched.add(seq)
        return seq

    def step():
        batch, _ = sched.schedule()
        for e in batch:  # what the engine does once the forward pass wrote the blocks
            e.seq.num_cached += e.num_tokens
            bm.commit(e.seq.seq_id, e.seq.token_ids, e.seq.num_cached)
        return {e.seq.seq_id: e.num_tokens for e in batch}

    system = list(range(1, 13))
    first = add(system + [50])
    assert step() == {first.seq_id: 13}
    second = add(system + [60, 61])
    assert step()[second.seq_id] == 2  # 12 tokens (3 blocks) from the cache
    assert second.num_cached == 14 and second.request.usage.cached_tokens == 12
    assert first.request.usage.cached_tokens == 0
    sched._preempt(second)  # readmitted: its own blocks are found again, the prompt's hit is not recounted
    assert step() == {second.seq_id: 2}
    assert second.request.usage.admissions == 2 and second.request.usage.cached_tokens == 12


# -- engines with the cache on and off give the same tokens -----------------------------------------

from rudder import LLM, SamplingParams  # noqa: E402
from rudder.branch import Branch  # noqa: E402

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SYSTEM = [7, 3, 9, 4, 11, 5, 13, 6, 15, 8, 17, 10, 19, 12, 21, 14]  # 4 blocks of 4
# controllers answer inline: which step a Branch comes at (and so which blocks are shared then)
# does not depend on the machine's load
OPTIONS = dict(kv_cache_tokens=2048, block_size=4, draft_model="layers:1", max_seqs=64, controller_threads=0)


@pytest.fixture(scope="module")
def on():
    return LLM("tiny", **OPTIONS)


@pytest.fixture(scope="module")
def off():
    return LLM("tiny", prefix_caching=False, **OPTIONS)


class Script:
    """A Python controller: at its k-th call answers `script[k]` (a Branch list), else samples
    freely; its forks follow the same script."""

    def __init__(self, script, calls=0):
        self.script, self.calls = script, calls

    def mid_process(self, branch_idx, backtrack, tokens):
        self.calls += 1
        return self.script.get(self.calls - 1, [Branch()])

    def fork(self):
        return Script(self.script, self.calls)

    def close(self):
        pass


def run(llm, plan):
    """Run requests on `llm`'s engine: `plan` is a list of (steps to run first, prompt, params,
    script or None). Returns each request's branches' token ids and its usage."""
    eng, reqs = llm.engine, []
    for wait, prompt, params, script in plan:
        for _ in range(wait):
            eng.step()
        reqs.append(eng.add_request(prompt, params, None if script is None else Script(script)))
    while eng.has_unfinished():
        eng.step()
    out = [([c.token_ids for c in eng.completions(r)], r.usage, r.spec_stats) for r in reqs]
    for r in reqs:  # what LLM.generate returns says it too
        assert {c.cached_tokens for c in eng.completions(r)} == {r.usage.cached_tokens}
        eng.forget(r)
    eng.block_manager.check_invariants()
    assert eng.block_manager.num_free == eng.block_manager.num_blocks
    return out


def same_tokens(on, off, plan):
    """The cache changes no token; returns the cached run's usages."""
    cached, plain = run(on, plan), run(off, plan)
    assert [tokens for tokens, _, _ in cached] == [tokens for tokens, _, _ in plain]
    assert all(u.cached_tokens == 0 for _, u, _ in plain)
    return [u for _, u, _ in cached]


def test_shared_prompts_one_after_another_and_together(on, off):
    plan = [(0, SYSTEM + [100, 101, 102], GREEDY, None), (20, SYSTEM + [200, 201], GREEDY, None),
            (20, SYSTEM + [100, 101, 102], GREEDY, None), (0, SYSTEM + [300], GREEDY, None)]
    usages = same_tokens(on, off, plan)
    # the first computes everything; the others find the system prompt, the repeat all but its last block
    assert [u.cached_tokens for u in usages] == [0, 16, 16, 16]


def test_a_backtrack_into_a_cached_block_then_a_fast_forward(on, off):
    """The second request holds the first's prompt blocks from the cache and, after 3 tokens,
    backtracks 6 (into the prompt's last block) and fast-forwards other tokens there: alone with
    the block (the first request has finished) it takes it out of the cache; sharing it (the
    first still runs) it writes into a copy, and the cached block stays. Either way a third
    request with the first's prompt gets the first's tokens."""
    backtrack = {3: [Branch(backtrack=6, ff=[[300, 301, 302, 303, 304]])]}
    for wait, third_hit in ((20, 12), (2, 16)):  # the first request is over / still running
        plan = [(0, SYSTEM + [40, 41], GREEDY, None), (wait, SYSTEM + [40, 41], GREEDY, backtrack),
                (20, SYSTEM + [40, 41], GREEDY, None)]
        usages = same_tokens(on, off, plan)
        assert usages[1].cached_tokens == 16 and usages[2].cached_tokens == third_hit


def test_forks_of_a_cached_prompt(on, off):
    forks = {0: [Branch(ff=[[40]]), Branch(ff=[[41, 42]]), Branch(ff=[[43, 44, 45, 46, 47]])],
             4: [Branch(), Branch(backtrack=3)]}
    plan = [(0, SYSTEM + [60], GREEDY, None), (20, SYSTEM + [60], GREEDY, forks), (0, SYSTEM + [61], GREEDY, forks)]
    usages = same_tokens(on, off, plan)
    assert usages[1].forks == usages[2].forks == 5 and usages[1].cached_tokens == 16  # 2, then 1 each


def test_speculative_drafts_rewound_over_cached_blocks(on, off):
    """A draft model that is the target's first layer alone: most drafts are rejected, and the
    rewinds cross blocks the cache has registered."""
    # (seeded: how much it drafts does not depend on the clock)
    spec = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, speculative="draft", spec_k=6, seed=1)
    plan = [(0, SYSTEM + [70, 71], spec, None), (30, SYSTEM + [70, 71], spec, None),
            (0, SYSTEM + [70, 72], spec, {2: [Branch(backtrack=5)]})]
    cached, plain = run(on, plan), run(off, plan)
    assert [t for t, _, _ in cached] == [t for t, _, _ in plain]
    assert cached[1][1].cached_tokens == 16
    assert all(0 < stats.accepted < stats.drafted for _, _, stats in cached), "no draft was rewound"


def test_preemption_and_readmission():
    """A cache too small for all of them: preempted sequences come back through the prefix cache
    (their own blocks, while not evicted) and end with the tokens they would have had."""
    small = dict(kv_cache_tokens=96, block_size=4, max_seqs=64)
    plan = [(0, SYSTEM + [80 + i], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), None)
            for i in range(5)]
    cached = run(LLM("tiny", **small), plan)
    plain = run(LLM("tiny", prefix_caching=False, **small), plan)
    assert [t for t, _, _ in cached] == [t for t, _, _ in plain]
    assert any(u.admissions > 1 for _, u, _ in cached), "nothing was preempted: the test tests nothing"


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_decodes_over_a_shared_cached_prompt_read_it_once_and_match_the_uncached_run(params):
    """On the native kernels (bf16), sequences decoding over the same cached prompt blocks attend
    over them as one cascade (native/attention.c reads the shared tiles once): the tokens are the
    uncached run's, whose sequences each hold their own copy."""
    from rudder import kernels

    opts = {k: v for k, v in OPTIONS.items() if k != "draft_model"}
    prompt = list(range(10, 110))  # 100 tokens: 6 whole key tiles
    plan = [(0, prompt + [200], params, None)] + [(2 if i == 0 else 0, prompt + [201 + i], params, None)
                                                  for i in range(5)]
    with LLM("tiny", dtype="bf16", **opts) as cached_llm, \
            LLM("tiny", dtype="bf16", prefix_caching=False, **opts) as plain_llm:
        assert cached_llm.engine.runner.capabilities.native_decoder
        before = kernels.attention_cascade_rows()
        usages = same_tokens(cached_llm, plain_llm, plan)
        assert kernels.attention_cascade_rows() > before, "no cascade: the test tests nothing"
    assert [u.cached_tokens for u in usages] == [0] + [100] * 5


def test_pipeline_stages_share_the_cached_blocks(off):
    """The block tables (and copies) the stages receive are rank 0's: a pipeline with the cache
    gives the tokens one process without it gives."""
    backtrack = {3: [Branch(backtrack=6, ff=[[300, 301]])]}
    plan = [(0, SYSTEM + [90], GREEDY, None), (20, SYSTEM + [90], GREEDY, backtrack),
            (2, SYSTEM + [91], GREEDY, None)]
    with LLM("tiny", pipeline_stages=2, **{k: v for k, v in OPTIONS.items() if k != "draft_model"}) as piped:
        cached = run(piped, plan)
    plain = run(off, plan)
    assert [t for t, _, _ in cached] == [t for t, _, _ in plain]
    assert [u.cached_tokens for _, u, _ in cached] == [0, 16, 16]


# -- over HTTP: usage and /metrics ------------------------------------------------------------------


def test_cached_prompt_tokens_in_usage_and_the_hit_rate_in_metrics():
    """The second request with the same system message finds it in the cache: OpenAI's
    `usage.prompt_tokens_details.cached_tokens` says how many of its prompt tokens (whole
    responses and streams alike), and /metrics counts them."""
    from openai import OpenAI

    from rudder.server import ServerConfig
    from serve_util import LiveServer

    system = "You answer in one word, the shortest there is, and never explain yourself at all. " * 2
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    with LiveServer(ServerConfig(model="tiny", max_concurrent=4, max_queue=4)) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
        second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        hit = second.usage.prompt_tokens_details.cached_tokens
        assert hit == (second.usage.prompt_tokens - 1) // 16 * 16 > len(system) / 2  # tiny: a token a byte
        chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, stream=True,
                                                     stream_options={"include_usage": True}))
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == hit
        metrics = server.metrics()
        prompts = 3 * second.usage.prompt_tokens
        assert metrics["rudder_prefix_cache_hits_total"] == 2 * hit
        assert metrics["rudder_prefix_cache_hit_rate"] == pytest.approx(2 * hit / prompts, abs=1e-6)


# -- the KV cache sized from the machine's memory ---------------------------------------------------


def test_the_kv_cache_takes_its_share_of_the_available_memory_and_says_so(caplog):
    import torch

    from rudder.config import ModelConfig
    from rudder.engine.kv_cache import bytes_per_token, tokens_for_memory

    cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=30, num_heads=4,
                      num_kv_heads=3, head_dim=16)
    per_token = bytes_per_token(cfg, torch.bfloat16)
    assert per_token == 30 * 2 * 3 * 16 * 2  # layers x K,V x KV heads x head dim x 2 bytes
    with caplog.at_level("INFO", logger="rudder.engine"):
        tokens = tokens_for_memory(cfg, torch.bfloat16, "cpu", 0.25, most=10 ** 9, available=8 << 30)
    assert tokens == (2 << 30) // per_token
    assert f"KV cache: {tokens} tokens" in caplog.text and "25% of the 8.0 GiB available" in caplog.text
    # never more than every sequence at full context can use
    assert tokens_for_memory(cfg, torch.bfloat16, "cpu", 0.25, most=64 * 8192, available=1 << 40) == 64 * 8192


def test_an_engine_without_a_size_takes_it_from_the_machine():
    llm = LLM("tiny", block_size=4)
    config = llm.engine.config
    assert config.kv_cache_tokens > 0 and llm.engine.block_manager.num_blocks == config.kv_cache_tokens // 4
    with pytest.raises(ValueError, match="kv_cache_tokens and kv_cache_memory both size the KV cache"):
        LLM("tiny", kv_cache_tokens=1024, kv_cache_memory=0.2)
    with pytest.raises(ValueError, match="kv_cache_memory must be a share"):
        LLM("tiny", kv_cache_memory=1.5)


def test_a_large_kv_cache_costs_memory_only_as_blocks_are_written():
    """On the CPU the cache is zero pages until written: sized for the machine, it takes memory
    as it is used (the process's resident memory grows by what is written, not by the size)."""
    import torch

    from rudder.config import ModelConfig
    from rudder.engine.kv_cache import KVCache

    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))

    cfg = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=128, num_layers=8, num_heads=4,
                      num_kv_heads=4, head_dim=32)
    before = rss()
    cache = KVCache(cfg, num_blocks=16384, block_size=16, device="cpu", dtype=torch.bfloat16)  # 1 GiB
    assert cache.tensor.numel() * 2 == 1 << 30
    assert rss() - before < 64 << 20
    cache.tensor[:, :, :100] = 1.0  # 100 blocks written: ~6 MiB
    grown = rss() - before
    assert 6 << 20 <= grown < 64 << 20
    assert float(cache.tensor[:, :, 100:200].abs().sum()) == 0.0  # unwritten blocks read as zeros


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_a_bf16_models_tokens_do_not_depend_on_its_caches_layout(params):
    """A bf16 model whose head_dim takes the kernel's pair products (64, as SmolLM2's) keeps
    its KV cache in pairs when a block holds whole 16-key tiles, else in the standard layout: the
    same tokens either way, prefills, decodes and a cascade over a cached prompt included."""
    from rudder import kernels
    from rudder.config import TINY_CONFIG
    from rudder.engine import Engine, EngineConfig
    from rudder.model import build_model
    from rudder.tokenizer import Tokenizer

    if not kernels.available():
        pytest.skip("no native kernels: the cache is never in pairs")
    cfg = TINY_CONFIG.replace(head_dim=64)
    prompt = list(range(10, 110))
    plan = [(0, prompt + [200], params, None)] + [(2 if i == 0 else 0, prompt + [201 + i], params, None)
                                                  for i in range(5)]
    runs = []
    for block_size, paired in ((16, True), (8, False)):
        engine = Engine(build_model(cfg, None, "cpu", dtype="bf16"), Tokenizer.byte_level(cfg.vocab_size),
                        EngineConfig(kv_cache_tokens=2048, block_size=block_size, max_seqs=64, controller_threads=0))
        assert engine.runner.kv_cache.paired == paired and engine.runner.capabilities.native_decoder
        before = kernels.attention_cascade_rows()
        runs.append(run(SimpleNamespace(engine=engine), plan))
        assert kernels.attention_cascade_rows() > before, "no cascade: the test tests nothing"
    (paired_run, standard_run) = runs
    assert [tokens for tokens, _, _ in paired_run] == [tokens for tokens, _, _ in standard_run]
