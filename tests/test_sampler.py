"""The batched sampler: masks, seeds, truncation, logprobs."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rudder.engine.sampler import Sampler
from rudder.engine.sequence import SamplingParams

V = 1000  # not a multiple of 32: the last mask word is partial


def mask_from_allowed(allowed: np.ndarray, vocab=V) -> np.ndarray:
    """Reference packing: token i is bit i&31 of word i>>5."""
    words = np.zeros((vocab + 31) // 32, dtype=np.uint32)
    for t in np.flatnonzero(allowed):
        words[t >> 5] |= np.uint32(1 << (t & 31))
    return words


def rngs(seeds):
    return [np.random.default_rng(s) for s in seeds]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), density=st.floats(0.001, 0.5), temperature=st.sampled_from([0.0, 0.5, 1.0, 3.0]))
def test_masked_tokens_are_never_sampled(seed, density, temperature):
    gen = np.random.default_rng(seed)
    rows = 6
    allowed = gen.random((rows, V)) < density
    allowed[:, gen.integers(V)] = True  # at least one allowed token per row
    masks = [mask_from_allowed(a) for a in allowed]
    masks[2] = None  # an unconstrained row in the same batch
    logits = torch.from_numpy(gen.normal(0, 4, (rows, V)).astype(np.float32))
    params = [SamplingParams(temperature=temperature)] * rows
    out = Sampler(V).sample(logits.clone(), params, rngs(range(rows)), masks)
    for i, tok in enumerate(out.tokens):
        assert 0 <= tok < V
        if masks[i] is not None:
            assert allowed[i, tok], f"row {i} sampled masked token {tok}"
    if temperature == 0:
        best = torch.where(torch.from_numpy(allowed[0]), logits[0], float("-inf")).argmax().item()
        assert out.tokens[0] == best


def test_same_seed_same_tokens_regardless_of_batch():
    gen = np.random.default_rng(0)
    logits = torch.from_numpy(gen.normal(0, 1, (4, V)).astype(np.float32))
    p = SamplingParams(temperature=1.0, top_p=0.95, top_k=200)
    sampler = Sampler(V)

    def draw(rows, seeds, steps=20):
        rs = rngs(seeds)
        return [sampler.sample(logits[rows].clone(), [p] * len(rows), rs).tokens for _ in range(steps)]

    solo = draw([1], [42])
    together = draw([0, 1, 2], [7, 42, 9])
    assert [t[0] for t in solo] == [t[1] for t in together]
    assert draw([1], [42]) == solo
    assert draw([1], [43]) != solo


def test_top_k_and_top_p_truncate():
    logits = torch.linspace(0, 10, V).repeat(3, 1)  # token V-1 most likely
    sampler = Sampler(V)
    probs = torch.softmax(logits[0], -1)
    order = probs.argsort(descending=True)
    nucleus = set(order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())
    for seed in range(200):
        out = sampler.sample(logits.clone(), [SamplingParams(temperature=1.0, top_k=5),
                                              SamplingParams(temperature=1.0, top_p=0.5),
                                              SamplingParams(temperature=1.0, top_k=1)], rngs([seed] * 3))
        assert out.tokens[0] >= V - 5
        assert out.tokens[1] in nucleus
        assert out.tokens[2] == V - 1


def test_sampling_follows_the_distribution():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = torch.log(torch.tensor(probs, dtype=torch.float32)).unsqueeze(0)
    sampler = Sampler(4)
    rng = rngs([123])
    counts = np.bincount([sampler.sample(logits.clone(), [SamplingParams(temperature=1.0)], rng).tokens[0]
                          for _ in range(4000)], minlength=4)
    chi2 = (((counts - 4000 * probs) ** 2) / (4000 * probs)).sum()
    assert chi2 < 16.3, f"chi-square {chi2:.1f} (p < 0.001 at 3 dof)"


def test_logprobs_and_top_n():
    gen = np.random.default_rng(3)
    logits = torch.from_numpy(gen.normal(0, 2, (2, V)).astype(np.float32))
    allowed = np.zeros(V, bool)
    allowed[[3, 500, 999]] = True
    out = Sampler(V).sample(logits.clone(), [SamplingParams(temperature=0, logprobs=3)] * 2, rngs([0, 1]),
                            [None, mask_from_allowed(allowed)])
    ref = torch.log_softmax(logits[0], -1)
    assert out.logprobs[0]["logprob"] == pytest.approx(ref.max().item(), abs=1e-5)
    assert [t for t, _ in out.logprobs[0]["top"]] == ref.topk(3).indices.tolist()
    # Under a mask, logprobs are of the constrained distribution: the 3 allowed tokens sum to 1.
    top = out.logprobs[1]["top"]
    assert {t for t, _ in top} == {3, 500, 999}
    assert sum(np.exp(lp) for _, lp in top) == pytest.approx(1.0, abs=1e-5)


def test_empty_mask_and_bad_mask():
    sampler = Sampler(V)
    logits = torch.zeros(1, V)
    out = sampler.sample(logits.clone(), [SamplingParams(temperature=1.0)], rngs([0]),
                         [np.zeros((V + 31) // 32, np.uint32)])
    assert out.tokens == [-1]
    with pytest.raises(ValueError, match="32 uint32 words"):
        sampler.sample(logits.clone(), [SamplingParams()], rngs([0]), [np.zeros(5, np.uint32)])


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), vocab=st.sampled_from([31, 32, 33, 1000, 49152]))
def test_native_mask_kernel_equals_the_numpy_path(seed, vocab):
    from rudder import native

    assert native.mask_kernel() is not None, native.unavailable_reason  # zig is a dependency: it must build
    gen = np.random.default_rng(seed)
    words = gen.integers(0, 2**32, (vocab + 31) // 32, dtype=np.uint64).astype(np.uint32)
    words[gen.random(words.shape) < 0.3] = 0  # whole-word shortcuts too
    words[gen.random(words.shape) < 0.3] = 0xFFFFFFFF
    words[-1] &= np.uint32((1 << (vocab % 32)) - 1) if vocab % 32 else np.uint32(0xFFFFFFFF)
    logits = torch.from_numpy(gen.normal(0, 1, (3, vocab)).astype(np.float32))
    masks = [words, None, words[::-1].copy()]
    fast = logits.clone()
    Sampler(vocab).apply_masks(fast, masks)
    slow = logits.clone()
    kernel = native.mask_kernel
    native.mask_kernel = lambda: None
    try:
        Sampler(vocab).apply_masks(slow, masks)
    finally:
        native.mask_kernel = kernel
    assert torch.equal(fast, slow)
    allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab].astype(bool)
    assert torch.isneginf(fast[0]).numpy().tolist() == (~allowed).tolist()
    assert torch.equal(fast[1], logits[1])


def test_greedy_rows_take_the_argmax_and_draw_nothing():
    gen = np.random.default_rng(3)
    logits = torch.from_numpy(gen.normal(0, 1, (3, V + 24)).astype(np.float32))  # padded past the vocabulary
    logits[1, V + 5] = 100.0  # a padding column never wins
    want = logits[:, :V].argmax(dim=-1).tolist()
    greedy = [SamplingParams(temperature=0)] * 3
    for masks in (None, [None] * 3):  # unconstrained: no mask list, or one of Nones
        generators = rngs([5, 6, 7])
        assert Sampler(V).sample(logits.clone(), greedy, generators, masks).tokens == want
        assert generators[0].random() == np.random.default_rng(5).random()  # greedy consumes no uniform
    mixed = greedy[:2] + [SamplingParams(temperature=1.0)]  # a sampled row in the batch: the general path
    assert Sampler(V).sample(logits.clone(), mixed, rngs([0, 1, 2])).tokens[:2] == want[:2]


def test_greedy_under_masks_is_the_general_paths_answer():
    """The greedy fast path (masks, no processing) gives what the general path does: the masked
    argmax per row, the plain argmax for an unmasked row, -1 where the mask allows nothing."""
    gen = np.random.default_rng(11)
    logits = torch.from_numpy(gen.normal(0, 3, (4, V + 24)).astype(np.float32))  # padded past the vocabulary
    allowed = gen.random((4, V)) < 0.2
    masks = [mask_from_allowed(allowed[0]), None, np.zeros((V + 31) // 32, np.uint32), mask_from_allowed(allowed[3])]
    greedy = [SamplingParams(temperature=0)] * 4
    fast = Sampler(V).sample(logits.clone(), greedy, rngs(range(4)), masks)
    want = [int(torch.where(torch.from_numpy(allowed[0]), logits[0, :V], float("-inf")).argmax()),
            int(logits[1, :V].argmax()), -1,
            int(torch.where(torch.from_numpy(allowed[3]), logits[3, :V], float("-inf")).argmax())]
    assert fast.tokens == want and fast.logprobs == [None] * 4
    general = Sampler(V).sample(logits.clone(), [SamplingParams(temperature=0, logprobs=0)] * 4, rngs(range(4)),
                                masks)  # logprobs asked: the general path
    assert general.tokens == want


def test_take_rows_matches_index_select_and_copies_only_when_asked():
    from rudder.engine.sampler import take_rows

    t = torch.arange(5 * 7, dtype=torch.float32).view(5, 7)
    for rows in ([0], [1, 2, 3], [0, 1, 2, 3, 4], [3, 1], [2, 2, 2], [0, 2, 4], [4]):
        expected = t.index_select(0, torch.tensor(rows))
        assert torch.equal(take_rows(t, rows), expected)
        assert torch.equal(take_rows(t, rows, copy=True), expected)
    view = take_rows(t, [1, 2])  # consecutive: a view, so in-place work reaches the rows
    view[0, 0] = -1.0
    assert t[1, 0] == -1.0
    copied = take_rows(t, [1, 2], copy=True)
    copied[0, 0] = -2.0
    assert t[1, 0] == -1.0
    shared = take_rows(t, [3, 3])  # forks sharing a row get rows of their own
    shared[0, 0] = -3.0
    assert t[3, 0] != -3.0 and shared[1, 0] != -3.0


# -- the distribution each parameter gives ------------------------------------------------------
#
# The Sampler draws by inverse CDF: a token takes exactly one uniform u, and token i is drawn for
# the u in an interval as long as its probability. Driving u by hand and finding where the drawn
# token changes recovers the whole distribution it samples from, to 1e-7: no statistics, and a
# parameter applied at the wrong strength moves the boundaries far more than that.

ROW = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0], dtype=np.float32)
PROMPT = [6, 7, 1]  # the history of the penalized rows: a prompt, then output tokens
OUTPUT = [0, 0, 2, 3, 0]


class FixedU:
    """A generator that gives the one uniform set on it."""

    u = 0.0

    def random(self):
        return self.u


def drawn_distribution(params: SamplingParams, row=ROW, history=None, mask=None) -> np.ndarray:
    """The probabilities the Sampler draws `row`'s tokens with, recovered from the boundaries of
    the u intervals (bisection)."""
    sampler, gen = Sampler(len(row)), FixedU()

    def token(u: float) -> int:
        gen.u = u
        return sampler.sample(torch.from_numpy(row.copy()).unsqueeze(0), [params], [gen],
                              None if mask is None else [mask], None if history is None else [history]).tokens[0]

    edges = [0.0]
    for k in range(1, len(row)):  # the least u that draws a token >= k
        lo, hi = edges[-1], 1.0
        if token(np.nextafter(1.0, 0.0)) < k:
            edges.append(1.0)
            continue
        while hi - lo > 1e-9:
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if token(mid) < k else (lo, mid)
        edges.append(hi)
    edges.append(1.0)
    return np.diff(edges)


def softmax(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def truncated(p, keep) -> np.ndarray:
    """`p` restricted to `keep` (token ids), renormalized."""
    out = np.zeros_like(p)
    out[list(keep)] = p[list(keep)]
    return out / out.sum()


def test_a_plain_row_is_drawn_from_its_softmax():
    np.testing.assert_allclose(drawn_distribution(SamplingParams(temperature=1.0)), softmax(ROW), atol=1e-6)


@pytest.mark.parametrize("temperature", [0.25, 0.5, 2.0])
def test_temperature_divides_the_logits(temperature):
    got = drawn_distribution(SamplingParams(temperature=temperature))
    np.testing.assert_allclose(got, softmax(ROW / temperature), atol=1e-6)


def test_top_k_keeps_the_k_most_likely():
    got = drawn_distribution(SamplingParams(temperature=1.0, top_k=3))
    np.testing.assert_allclose(got, truncated(softmax(ROW), [0, 1, 2]), atol=1e-6)
    # after the temperature: top-k picks the same tokens, from the sharpened distribution
    got = drawn_distribution(SamplingParams(temperature=0.5, top_k=2))
    np.testing.assert_allclose(got, truncated(softmax(ROW / 0.5), [0, 1]), atol=1e-6)


def test_top_p_keeps_the_smallest_set_that_reaches_p():
    p = softmax(ROW)  # 0.53, 0.20, 0.12, 0.07, ...: the mass before each token 0, 0.53, 0.73, 0.84, 0.92
    np.testing.assert_allclose(drawn_distribution(SamplingParams(temperature=1.0, top_p=0.8)),
                               truncated(p, [0, 1, 2]), atol=1e-6)
    np.testing.assert_allclose(drawn_distribution(SamplingParams(temperature=1.0, top_p=0.9)),
                               truncated(p, [0, 1, 2, 3]), atol=1e-6)
    np.testing.assert_allclose(drawn_distribution(SamplingParams(temperature=1.0, top_p=0.7)),
                               truncated(p, [0, 1]), atol=1e-6)
    np.testing.assert_allclose(drawn_distribution(SamplingParams(temperature=1.0, top_p=0.3)),
                               truncated(p, [0]), atol=1e-6)  # the most likely token always stays
    # on the tempered distribution (0.5: 0.82, 0.11, 0.04, ...)
    np.testing.assert_allclose(drawn_distribution(SamplingParams(temperature=0.5, top_p=0.9)),
                               truncated(softmax(ROW / 0.5), [0, 1]), atol=1e-6)


def test_min_p_drops_what_is_under_min_p_times_the_top_token():
    p = softmax(ROW)  # ratios to the top one: 1, 0.37, 0.22, 0.14, 0.08, ...
    np.testing.assert_allclose(drawn_distribution(SamplingParams(temperature=1.0, min_p=0.2)),
                               truncated(p, [0, 1, 2]), atol=1e-6)
    np.testing.assert_allclose(drawn_distribution(SamplingParams(temperature=1.0, min_p=0.1)),
                               truncated(p, [0, 1, 2, 3]), atol=1e-6)
    # on the tempered distribution (0.5: ratios 1, 0.135, 0.05, ...)
    np.testing.assert_allclose(drawn_distribution(SamplingParams(temperature=0.5, min_p=0.1)),
                               truncated(softmax(ROW / 0.5), [0, 1]), atol=1e-6)


def test_truncations_compose_in_order_top_k_top_p_min_p():
    """top-k first; top-p on what top-k kept (renormalized); min-p last, relative to the top token."""
    p = truncated(softmax(ROW), range(5))  # top_k=5: 0.55, 0.20, 0.12, 0.07, 0.05
    # top_p=0.85 of the top five keeps three (of the whole row it would keep four)
    got = drawn_distribution(SamplingParams(temperature=1.0, top_k=5, top_p=0.85))
    np.testing.assert_allclose(got, truncated(p, [0, 1, 2]), atol=1e-6)
    got = drawn_distribution(SamplingParams(temperature=1.0, top_k=5, top_p=0.85, min_p=0.3))
    np.testing.assert_allclose(got, truncated(p, [0, 1]), atol=1e-6)  # 0.12 / 0.55 < 0.3


def penalized(logits, presence=0.0, frequency=0.0, repetition=1.0):
    x = np.array(logits, dtype=np.float64)
    for t in set(PROMPT + OUTPUT):
        x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
    for t in set(OUTPUT):
        x[t] -= frequency * OUTPUT.count(t) + presence
    return x


@pytest.mark.parametrize("name, value, expect", [
    ("presence_penalty", 0.8, lambda: penalized(ROW, presence=0.8)),   # once per output token
    ("frequency_penalty", 0.6, lambda: penalized(ROW, frequency=0.6)),  # per occurrence: token 0 three times
    ("repetition_penalty", 1.7, lambda: penalized(ROW, repetition=1.7)),  # prompt and output; /p above 0, *p below
    ("presence_penalty", -0.5, lambda: penalized(ROW, presence=-0.5)),  # negative: repeats are favoured
])
def test_each_penalty_at_its_strength(name, value, expect):
    params = SamplingParams(temperature=1.0, **{name: value}).validate()
    got = drawn_distribution(params, history=(PROMPT + OUTPUT, len(PROMPT)))
    np.testing.assert_allclose(got, softmax(expect()), atol=1e-6)
    assert np.abs(got - softmax(ROW)).max() > 0.02  # it does change the distribution


def test_penalties_combine_and_come_before_the_temperature():
    params = SamplingParams(temperature=0.7, presence_penalty=0.3, frequency_penalty=0.2,
                            repetition_penalty=1.3).validate()
    got = drawn_distribution(params, history=(PROMPT + OUTPUT, len(PROMPT)))
    np.testing.assert_allclose(got, softmax(penalized(ROW, 0.3, 0.2, 1.3) / 0.7), atol=1e-6)


def test_logit_bias_adds_to_the_logit_before_the_temperature():
    params = SamplingParams(temperature=0.5, logit_bias={3: 1.5, 0: -2.0, 7: 4.0}).validate()
    x = ROW.astype(np.float64) + np.array([-2.0, 0, 0, 1.5, 0, 0, 0, 4.0])
    np.testing.assert_allclose(drawn_distribution(params), softmax(x / 0.5), atol=1e-6)


def test_a_mask_restricts_the_distribution_before_truncation():
    """top-p and min-p act on the masked, renormalized distribution."""
    allowed = [1, 2, 4, 5, 6]
    mask = mask_from_allowed(np.isin(np.arange(len(ROW)), allowed), vocab=len(ROW))
    p = truncated(softmax(ROW), allowed)  # 0.50, 0.30, 0.11, 0.07, 0.02
    got = drawn_distribution(SamplingParams(temperature=1.0, top_p=0.85), mask=mask)
    np.testing.assert_allclose(got, truncated(p, [1, 2, 4]), atol=1e-6)
    got = drawn_distribution(SamplingParams(temperature=1.0, min_p=0.2), mask=mask)
    np.testing.assert_allclose(got, truncated(p, [1, 2, 4]), atol=1e-6)


def test_sampling_weights_leave_the_logits_as_they_are():
    """The sampler and speculative verification pass logits rows without copying them (the scaled
    copy is sampling_weights' own): temperature, top-k, top-p and min-p never write to them."""
    from rudder.engine.sampler import sampling_weights

    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    before = x.clone()
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=5),
              SamplingParams(temperature=0.9, top_p=0.8), SamplingParams(temperature=1.0, min_p=0.1)]
    weights = sampling_weights(x, params)
    assert torch.equal(x, before)
    assert (weights[1] > 0).sum() == 5 and weights[0].sum().item() == pytest.approx(1.0)


class _LastDraw:
    """A generator whose uniform is the largest double below 1: as float32 it rounds to 1.0."""

    def random(self):
        return 1.0 - 2.0 ** -53


def test_a_uniform_that_rounds_to_one_still_draws_an_allowed_token():
    """Inverse-CDF sampling scales the uniform by the row's total weight; a draw that rounds to
    1.0 in float32 (about one in 2^25) must still land on a token of positive weight, not on the
    vocabulary's last one whatever its mask or truncation says - for the sampler and for
    speculative verification's residual draws alike."""
    from rudder.engine.speculative import _inverse_cdf

    allowed = np.zeros(V, dtype=bool)
    allowed[[3, 10, 17]] = True  # the last token is masked out
    logits = torch.zeros(2, V)
    logits[1, [5, 6]] = 5.0  # top-k 2 keeps these two
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=2)]
    out = Sampler(V).sample(logits.clone(), params, [_LastDraw(), _LastDraw()],
                            [mask_from_allowed(allowed), None])
    assert allowed[out.tokens[0]] and out.tokens[1] in (5, 6)
    weights = torch.zeros(V)
    weights[[3, 10, 17]] = 1 / 3
    assert _inverse_cdf(weights, _LastDraw().random()) in (3, 10, 17)


@pytest.mark.parametrize("peaked", [False, True])
def test_native_weights_match_torch_softmax(peaked):
    """native/sample.c's weights (the CPU's) are torch's softmax of the tempered logits, cut by
    top-k, top-p and min-p, to float rounding: the same tokens cut, cut ones at exactly 0; a row
    with nothing allowed weighs 0 everywhere. Peaked rows find their thresholds among a few
    likely tokens, flat ones through the histogram (sample.c)."""
    from rudder.engine.sampler import _native, _torch_weights, sampling_weights

    x = torch.randn(8, 49159, generator=torch.Generator().manual_seed(1)) * 4  # (not a multiple of 16)
    if peaked:
        x[:, 100:130] += torch.linspace(20, 8, 30)
    assert _native(x) is not None
    x[1, 7:] = float("-inf")
    x[2, :] = float("-inf")
    params = [SamplingParams(temperature=0.8), SamplingParams(temperature=1.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=2.0, top_k=40), SamplingParams(temperature=0.5, top_p=0.9, min_p=0.01),
              SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=1.3, top_k=500, top_p=0.5),
              SamplingParams(temperature=0.7, min_p=0.2)]
    got = sampling_weights(x, params).double()
    assert (got[1, 7:] == 0).all() and (got[2] == 0).all()  # (torch's softmax gives NaN for row 2)
    keep = [0, 1, 3, 4, 5, 6, 7]
    got, want = got[keep], _torch_weights(x[keep], [params[j] for j in keep]).double()
    assert torch.equal(got == 0, want == 0)  # the same tokens cut, the same masked
    assert (got[keep.index(5)] > 0).sum() == 3  # (top-k 3)
    live = want > 1e-30
    assert ((got - want).abs()[live] / want[live]).max() < 2e-5
    for j in range(6):  # (row 7's min_p drops mass: it sums to less)
        assert got[j].sum().item() == pytest.approx(1.0, abs=1e-5)


def test_native_cuts_keep_ties_at_the_threshold():
    """Tokens as likely as the k-th (top-k) or as the nucleus's last (top-p) all stay, as in the
    sort-based definition."""
    from rudder.engine.sampler import sampling_weights

    x = torch.full((2, 300), -10.0)
    x[:, [3, 50, 51, 52, 299]] = torch.tensor([5.0, 4.0, 4.0, 4.0, 1.0])
    w = sampling_weights(x, [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_p=0.8)])
    assert torch.nonzero(w[0]).flatten().tolist() == [3, 50, 51, 52]
    assert torch.nonzero(w[1]).flatten().tolist() == [3, 50, 51, 52]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.sampled_from([1, 15, 16, 255, 256, 257, 1000, 49152, 49159]),
       live=st.integers(1, 5), u=st.one_of(st.floats(0, 1, exclude_max=True), st.just(1.0 - 2.0 ** -53),
                                             st.just(0.0)))
def test_native_draw_lands_on_a_weighted_token_where_the_cdf_says(seed, n, live, u):
    """The native draw (blocks summed in lanes, then one block's weights one by one) picks a
    token of positive weight whatever the row's length and where its few weighted tokens lie, and
    the one a float64 inverse CDF picks unless the draw falls within float rounding of a boundary."""
    from rudder.engine.sampler import draw

    gen = np.random.default_rng(seed)
    w = np.zeros(n, dtype=np.float32)
    at = gen.choice(n, size=min(live, n), replace=False)
    w[at] = gen.random(len(at)).astype(np.float32) + 1e-3
    tok = int(draw(torch.from_numpy(w).unsqueeze(0), [u])[0])
    assert w[tok] > 0
    cdf = np.cumsum(w.astype(np.float64))
    target = np.float64(np.float32(u)) * cdf[-1]
    if target < cdf[-1] * (1 - 1e-5):
        lo = cdf[tok] - w[tok]
        assert lo - 1e-5 * cdf[-1] <= target < cdf[tok] + 1e-5 * cdf[-1]


def test_native_and_torch_draws_agree_but_at_rounding():
    """The CPU's native draw and torch's cumulative-sum draw (a GPU's) follow one rule: over many
    uniforms on SmolLM2-sized rows they pick the same token but for float rounding at boundaries."""
    from rudder.engine.sampler import _torch_draw, _torch_weights, draw, sampling_weights

    x = torch.randn(16, 49152, generator=torch.Generator().manual_seed(2)) * 3
    params = [SamplingParams(temperature=0.9)] * 16
    native_w, torch_w = sampling_weights(x, params), _torch_weights(x, params)
    gen = np.random.default_rng(5)
    same = total = 0
    for _ in range(200):
        u = gen.random(16).tolist()
        a = draw(native_w, u)
        b = _torch_draw(torch_w, u)
        same += int((a == b).sum())
        total += 16
    assert same / total > 0.995
