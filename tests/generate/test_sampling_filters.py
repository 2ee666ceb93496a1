"""The sampling filters on hand-built distributions, their order, the draw's statistics, seeds, validation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tinylm.errors import TinyLMError
from tinylm.generate.inspect import temperature_probabilities
from tinylm.generate.sampling import (
    SamplingParams,
    draw,
    filter_logits,
    make_generators,
    min_p_filter,
    sample,
    sampling_distribution,
    token_logprobs,
    top_k_filter,
    top_p_filter,
)


def logits_of(*probs: float) -> torch.Tensor:
    """Logits (1, V) whose softmax is the given distribution."""
    return torch.tensor([probs], dtype=torch.float32).log()


def kept(filtered: torch.Tensor) -> set[int]:
    """The token ids a filter left (finite logits) in a one-row result."""
    return set(torch.isfinite(filtered[0]).nonzero().flatten().tolist())


# ----- temperature ------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature, expected", [
    (1.0, (0.705, 0.259, 0.035)),  # the notes' example: softmax(2, 1, -1)
    (0.5, (0.879, 0.119, 0.002)),  # sharper: softmax(4, 2, -2)
    (2.0, (0.547, 0.331, 0.122)),  # flatter: softmax(1, 0.5, -0.5)
])
def test_temperature_reshapes_a_known_distribution(temperature, expected):
    probs = temperature_probabilities(torch.tensor([2.0, 1.0, -1.0]), temperature)
    torch.testing.assert_close(probs, torch.tensor(expected), atol=5e-4, rtol=0)


def test_temperature_zero_is_the_argmax_and_tiny_temperatures_approach_it():
    logits = torch.tensor([2.0, 3.0, -1.0])
    assert temperature_probabilities(logits, 0.0).tolist() == [0.0, 1.0, 0.0]
    assert temperature_probabilities(logits, 0.01)[1] > 0.999


def test_extreme_temperatures_and_top_p_stay_distributions():
    """A temperature of 1e-40 once overflowed u / tau to inf (NaN probabilities), and a top-p below
    the rounding tolerance once kept no token at all; both must degrade to greedy instead."""
    logits = torch.tensor([[2.0, 30.0, -1.0, float("-inf")]])
    for params in (SamplingParams(temperature=1e-40), SamplingParams(top_p=1e-9),
                   SamplingParams(temperature=1e-30, top_p=1e-12, min_p=0.999)):
        probs = sampling_distribution(logits, params)
        assert torch.isfinite(probs).all() and probs[0, 1] == 1.0
        assert sample(logits, params, make_generators(0, 1)).tolist() == [1]
    huge = torch.tensor([[3e38, 1e38, -3e38]])  # near float32's limit: the shift keeps it finite
    assert sampling_distribution(huge, SamplingParams(temperature=0.5))[0, 0] == 1.0


# ----- top-k --------------------------------------------------------------------------------------


@pytest.mark.parametrize("logits, k, expected", [
    ([1.0, 5.0, 3.0, 4.0, 2.0], 1, {1}),
    ([1.0, 5.0, 3.0, 4.0, 2.0], 3, {1, 2, 3}),
    ([1.0, 5.0, 3.0, 5.0, 2.0], 2, {1, 3}),  # two tied at the top, k = 2: exactly those two
    ([4.0, 2.0, 2.0, 2.0, 1.0], 2, {0, 1, 2, 3}),  # three tied for 2nd place: all kept, never an arbitrary one
    ([1.0, 5.0, 3.0, 4.0, 2.0], 5, {0, 1, 2, 3, 4}),
    ([1.0, 5.0, 3.0, 4.0, 2.0], 9, {0, 1, 2, 3, 4}),
    ([1.0, 5.0, 3.0, 4.0, 2.0], 0, {0, 1, 2, 3, 4}),  # 0 = off
])
def test_top_k_keeps_the_k_largest_and_ties_with_the_kth(logits, k, expected):
    assert kept(top_k_filter(torch.tensor([logits]), k)) == expected


def test_top_k_works_row_by_row():
    logits = torch.tensor([[1.0, 5.0, 3.0], [9.0, 0.0, 8.0]])
    out = top_k_filter(logits, 1)
    assert torch.isfinite(out).tolist() == [[False, True, False], [True, False, False]]
    assert out[0, 1] == 5.0 and out[1, 0] == 9.0  # kept logits are unchanged


# ----- top-p --------------------------------------------------------------------------------------


@pytest.mark.parametrize("p, expected", [
    (0.01, {0}),  # the most likely token is always kept
    (0.5, {0}),  # 0.5 alone reaches 0.5 exactly
    (0.51, {0, 1}),  # 0.5 < 0.51: the next token (0.3) crosses the threshold and is kept
    (0.8, {0, 1}),  # 0.5 + 0.3 reaches 0.8 exactly (despite float rounding): no third token
    (0.9, {0, 1, 2}),  # 0.8 < 0.9, then 0.95: the crossing token 0.15 is kept
    (0.97, {0, 1, 2, 3}),
    (1.0, {0, 1, 2, 3}),  # 1 = off
])
def test_top_p_keeps_the_smallest_set_reaching_p_including_the_crossing_token(p, expected):
    assert kept(top_p_filter(logits_of(0.5, 0.3, 0.15, 0.05), p)) == expected


def test_top_p_goes_by_probability_not_by_position():
    # the same distribution shuffled: ids 3, 0, 2, 1 hold 0.5, 0.3, 0.15, 0.05
    assert kept(top_p_filter(logits_of(0.3, 0.05, 0.15, 0.5), 0.9)) == {3, 0, 2}


def test_top_p_keeps_every_token_tied_with_the_crossing_one():
    # 0.4 < 0.5, then one of the 0.2s crosses 0.5; which one would be arbitrary, so all three are kept
    assert kept(top_p_filter(logits_of(0.4, 0.2, 0.2, 0.2), 0.5)) == {0, 1, 2, 3}
    assert kept(top_p_filter(logits_of(0.4, 0.2, 0.2, 0.1, 0.1), 0.5)) == {0, 1, 2}


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0.01, 10.0), min_size=1, max_size=40), st.floats(0.001, 1.0))
def test_top_p_keeps_a_smallest_set_reaching_p_on_any_distribution(weights, p):
    logits = torch.tensor([weights]).log()
    probs = torch.softmax(logits.double(), dim=-1)[0]  # the probabilities the filter works with
    keep = torch.isfinite(top_p_filter(logits, p))[0]
    assert probs[keep].sum() >= p - 1e-6  # the kept set reaches p
    if not keep.all():
        assert probs[keep].min() >= probs[~keep].max()  # it is made of the most likely tokens
    least = probs[keep].min()
    assert probs[keep & (probs > least)].sum() < p  # and without its least likely tokens it would not reach p


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(-5, 5), min_size=1, max_size=30), st.integers(1, 35))
def test_top_k_keeps_k_tokens_unless_there_are_ties(values, k):
    logits = torch.tensor([values], dtype=torch.float32)
    keep = torch.isfinite(top_k_filter(logits, k))[0]
    n = len(values)
    assert keep.sum() >= min(k, n)
    if keep.sum() > min(k, n):  # more than k only when tokens tie with the k-th largest
        kth = sorted(values, reverse=True)[k - 1]
        assert values.count(kth) > 1 and all(keep[i] == (v >= kth) for i, v in enumerate(values))


def test_top_p_works_row_by_row():
    logits = torch.cat([logits_of(0.5, 0.3, 0.15, 0.05), logits_of(0.05, 0.15, 0.3, 0.5)])
    expected = [[True, True, False, False], [False, False, True, True]]
    assert torch.isfinite(top_p_filter(logits, 0.7)).tolist() == expected


# ----- min-p --------------------------------------------------------------------------------------


@pytest.mark.parametrize("min_p, expected", [
    (0.0, {0, 1, 2, 3}),  # 0 = off
    (0.05, {0, 1, 2, 3}),  # cut at 0.025
    (0.25, {0, 1, 2}),  # cut at 0.125
    (0.5, {0, 1}),  # cut at 0.25
    (0.9, {0}),  # cut at 0.45
])
def test_min_p_keeps_tokens_at_least_min_p_times_the_top_probability(min_p, expected):
    assert kept(min_p_filter(logits_of(0.5, 0.3, 0.15, 0.05), min_p)) == expected


# ----- the order: temperature, top-k, top-p, min-p ----------------------------------------------


def test_top_p_applies_after_temperature():
    # at temperature 0.5 the distribution (0.4, 0.3, 0.2, 0.1) becomes (0.533, 0.3, 0.133, 0.033):
    # 0.8 is reached by two tokens (it would take three before the temperature)
    out = filter_logits(logits_of(0.4, 0.3, 0.2, 0.1), SamplingParams(temperature=0.5, top_p=0.8))
    assert kept(out) == {0, 1}


def test_top_p_sees_the_distribution_renormalised_after_top_k():
    # top-k 2 leaves (0.4, 0.3) -> (0.571, 0.429): the first alone reaches 0.5. (top-p first would keep two.)
    out = filter_logits(logits_of(0.4, 0.3, 0.2, 0.1), SamplingParams(top_k=2, top_p=0.5))
    assert kept(out) == {0}


def test_min_p_applies_after_top_p():
    # top-p 0.5 keeps (0.4, 0.3), then min-p 0.6 (cut 0.24) keeps both. (min-p first would leave
    # (0.571, 0.429), from which top-p 0.5 keeps one.)
    out = filter_logits(logits_of(0.4, 0.3, 0.2, 0.1), SamplingParams(top_p=0.5, min_p=0.6))
    assert kept(out) == {0, 1}


def test_filters_compose_in_the_documented_order():
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05)
    by_hand = min_p_filter(top_p_filter(top_k_filter(logits / 0.7, 20), 0.8), 0.05)
    filtered = filter_logits(logits, params)  # shifted by each row's maximum, which changes no probability
    assert torch.equal(torch.isinf(filtered), torch.isinf(by_hand))
    torch.testing.assert_close(torch.softmax(filtered, -1), torch.softmax(by_hand, -1), rtol=0, atol=1e-6)


# ----- drawing --------------------------------------------------------------------------------------

# chi-square critical value for 4 degrees of freedom at significance 0.001 (tables; scipy.stats.chi2.ppf(0.999, 4))
CHI2_CRITICAL_4DF = 18.467


def draw_many(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    """n tokens drawn from one distribution: batches of 250 rows, each row with its own generator."""
    rows = 250
    generators = make_generators(seed, rows)
    batch = logits.expand(rows, -1)
    return torch.cat([sample(batch, params, generators) for _ in range(n // rows)])


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_sampled_frequencies_match_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625])
    tokens = draw_many(probs.log()[None], SamplingParams(seed=0), 20_000)
    counts = torch.bincount(tokens, minlength=5).float()
    assert chi_square(counts, probs) < CHI2_CRITICAL_4DF
    # the test has power: the same counts are far from a slightly different distribution
    assert chi_square(counts, torch.tensor([0.45, 0.3, 0.125, 0.0625, 0.0625])) > 10 * CHI2_CRITICAL_4DF


def test_sampling_draws_only_from_what_the_filters_keep_in_proportion():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625])
    tokens = draw_many(probs.log()[None], SamplingParams(top_k=2), 10_000)
    counts = torch.bincount(tokens, minlength=5).float()
    assert counts[2:].sum() == 0
    # two outcomes, 1 degree of freedom: critical value 10.828 at 0.001
    assert chi_square(counts[:2], torch.tensor([2 / 3, 1 / 3])) < 10.828


def test_a_draw_is_the_first_id_whose_cumulative_probability_exceeds_the_rows_uniform():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3], [0.25, 0.25, 0.25, 0.25]])
    for seed in range(200):
        generators = [torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1000)]
        us = [torch.rand((), dtype=torch.float64, generator=torch.Generator().manual_seed(s)).item()
              for s in (seed, seed + 1000)]
        expected = []
        for row, u in zip(probs.tolist(), us):  # by hand, in Python floats
            total, i = 0.0, 0
            while total + row[i] <= u:
                total += row[i]
                i += 1
            expected.append(i)
        assert draw(probs, generators).tolist() == expected


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([0.0, 0.0, 1e-9, 0.3, 1.0, 5.0]), min_size=2, max_size=12).filter(any),
       st.integers(0, 2**31))
def test_a_draw_never_takes_an_id_of_probability_zero(weights, seed):
    probs = torch.tensor([weights] * 64, dtype=torch.float32)  # unnormalised: draw scales by the row's total
    generators = [torch.Generator().manual_seed(seed + b) for b in range(64)]
    ids = draw(probs, generators)
    assert all(weights[i] > 0 for i in ids.tolist())


def test_each_row_draws_with_its_own_generator_alone():
    probs = torch.softmax(torch.randn(5, 50, generator=torch.Generator().manual_seed(0)), dim=-1)
    together = draw(probs, make_generators(7, 5))
    alone = [int(draw(probs[b:b + 1], [g])[0]) for b, g in enumerate(make_generators(7, 5))]
    assert together.tolist() == alone


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.1])
def test_a_distribution_with_nan_inf_or_a_negative_entry_is_refused(bad):
    probs = torch.tensor([[0.5, 0.5, 0.0], [0.2, bad, 0.3]])
    with pytest.raises(RuntimeError, match="inf, nan or element < 0"):
        draw(probs, make_generators(0, 2))
    with pytest.raises(RuntimeError, match="sums to 0"):
        draw(torch.zeros(1, 3), make_generators(0, 1))


def test_greedy_takes_the_argmax_and_the_first_of_tied_maxima():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 2.0, 1.0]])
    assert sample(logits, SamplingParams(temperature=0)).tolist() == [1, 0]
    assert sampling_distribution(logits, SamplingParams(temperature=0)).tolist() == [[0, 1, 0], [1, 0, 0]]


def test_same_seed_same_draws_whatever_ran_before():
    logits = torch.zeros(3, 1000)  # uniform over 1000 tokens: a repeat by chance is unlikely
    params = SamplingParams(seed=42)
    first = [sample(logits, params, g).tolist() for g in [make_generators(42, 3)] for _ in range(5)]
    torch.manual_seed(123)
    torch.rand(10)  # disturb the global generator: it must not matter
    second = [sample(logits, params, g).tolist() for g in [make_generators(42, 3)] for _ in range(5)]
    assert first == second
    rows = list(zip(*first))  # each row's 5 draws
    assert len(set(rows)) == 3  # the rows of one batch draw differently
    other = [sample(logits, params, g).tolist() for g in [make_generators(43, 3)] for _ in range(5)]
    assert other != first


def test_no_seed_gives_fresh_draws():
    logits = torch.zeros(1, 1000)
    draws = [tuple(sample(logits, SamplingParams(), make_generators(None, 1)).tolist()) for _ in range(5)]
    assert len(set(draws)) > 1  # five fresh seeds drawing the same token of 1000: chance 1e-12


def test_token_logprobs_are_the_models_log_softmax():
    logits = torch.tensor([[2.0, 1.0, -1.0]])
    lp = token_logprobs(logits, torch.tensor([1]))
    assert math.isclose(float(lp), math.log(0.2594), abs_tol=1e-3)


# ----- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("changes", [
    {"temperature": -0.1}, {"temperature": float("nan")}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5},
    {"min_p": -0.1}, {"min_p": 2.0}, {"max_new_tokens": -1}, {"num_samples": 0}, {"num_beams": 0},
    {"stop": [""]}, {"stop_ids": [-1]}, {"num_beams": 2, "num_samples": 3}, {"seed": -1}, {"window_keep": 0},
    {"max_new_tokens": 2.5},
])
def test_bad_sampling_params_are_errors_that_say_what_is_expected(changes):
    with pytest.raises(TinyLMError):
        SamplingParams(**changes)


def test_a_lone_stop_string_is_one_stop_string():
    assert SamplingParams(stop="\n\n").stop == ("\n\n",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
