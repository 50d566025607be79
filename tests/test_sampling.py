"""ras_sampling (spec §3.5) on hand-computed distributions: nucleus rule, top-k, EOS mask, repetition fallback."""

from __future__ import annotations

import numpy as np
import pytest

from service.engine.sampling import SamplingParams, draw_index, nucleus_candidates, ras_sampling, softmax

OFFICIAL = SamplingParams(top_p=0.8, top_k=25, win_size=10, tau_r=0.1)


def logp_of(probs: list[float]) -> np.ndarray:
    p = np.asarray(probs, dtype=np.float64)
    with np.errstate(divide="ignore"):
        return np.log(p / p.sum()).astype(np.float32)


def draws(
    logp: np.ndarray, history: list[int], *, n: int = 400, eos: int = -1, ignore_eos: bool = False, seed: int = 0
) -> list[int]:
    rng = np.random.default_rng(seed)
    eos_index = eos if eos >= 0 else logp.size - 1
    return [ras_sampling(logp, history, rng, OFFICIAL, eos=eos_index, ignore_eos=ignore_eos) for _ in range(n)]


def test_softmax_of_log_probs_recovers_probs_and_masks_inf() -> None:
    p = softmax(np.array([np.log(0.5), np.log(0.25), np.log(0.25), -np.inf], dtype=np.float32))
    np.testing.assert_allclose(p, [0.5, 0.25, 0.25, 0.0], atol=1e-7)
    assert p[3] == 0.0 and p.dtype == np.float32


@pytest.mark.parametrize(
    ("u", "expected"),
    [(0.0, 0), (0.19, 0), (0.2, 1), (0.49, 1), (0.5, 2), (0.999, 2)],
)
def test_draw_index_inverts_the_cdf(u: float, expected: int) -> None:
    # cdf of [0.2, 0.3, 0.5] is [0.2, 0.5, 1.0]; boundaries belong to the next bin.
    assert draw_index(np.array([0.2, 0.3, 0.5]), u) == expected


def test_draw_index_normalises_and_never_picks_zero_weight() -> None:
    # weights [0, 2, 0, 2]: cdf [0, 2, 2, 4]; u * 4 = 2 -> first cdf > 2 is index 3, never index 2.
    w = np.array([0.0, 2.0, 0.0, 2.0])
    assert draw_index(w, 0.0) == 1
    assert draw_index(w, 0.5) == 3
    assert draw_index(w, 0.25) == 1


def test_nucleus_includes_the_token_that_crosses_top_p() -> None:
    # sorted: 0.4 (cum before 0) , 0.3 (0.4), 0.2 (0.7 < 0.8: kept, crosses to 0.9), 0.1 (0.9: stop)
    ids, probs = nucleus_candidates(np.array([0.1, 0.4, 0.2, 0.3], dtype=np.float32), 0.8, 25)
    assert ids.tolist() == [1, 3, 2]
    np.testing.assert_allclose(probs, [0.4, 0.3, 0.2])


def test_nucleus_keeps_a_single_dominant_token() -> None:
    ids, _ = nucleus_candidates(np.array([0.05, 0.9, 0.05], dtype=np.float32), 0.8, 25)
    assert ids.tolist() == [1]


def test_nucleus_top_k_caps_a_flat_distribution_and_breaks_ties_by_index() -> None:
    probs = np.full(100, 0.01, dtype=np.float32)
    ids, _ = nucleus_candidates(probs, 0.8, 25)
    assert ids.tolist() == list(range(25))  # stable sort: equal values keep index order


def test_nucleus_stable_order_with_ties_at_the_kth_value() -> None:
    # values 0.3 (idx 5), then 0.1 at idx 0,2,4,7,8, then 0.05s; top_k=3 must take 5, 0, 2.
    probs = np.array([0.1, 0.05, 0.1, 0.05, 0.1, 0.3, 0.05, 0.1, 0.1, 0.05], dtype=np.float32)
    ids, _ = nucleus_candidates(probs, 0.99, 3)
    assert ids.tolist() == [5, 0, 2]


def test_ras_only_draws_inside_the_nucleus() -> None:
    logp = logp_of([0.4, 0.3, 0.2, 0.06, 0.04])
    got = set(draws(logp, []))
    assert got == {0, 1, 2}


def test_ras_draw_frequencies_follow_renormalised_nucleus() -> None:
    logp = logp_of([0.4, 0.3, 0.2, 0.06, 0.04])
    got = np.bincount(draws(logp, [], n=3000), minlength=5) / 3000
    np.testing.assert_allclose(got[:3], [4 / 9, 3 / 9, 2 / 9], atol=0.04)


def test_ras_masks_eos_before_min_len() -> None:
    logp = logp_of([0.05, 0.05, 0.9])  # EOS = last index dominates
    assert set(draws(logp, [], n=50, ignore_eos=False)) == {2}
    assert 2 not in draws(logp, [], n=200, ignore_eos=True)


def test_ras_does_not_modify_the_callers_log_probs() -> None:
    logp = logp_of([0.05, 0.05, 0.9])
    before = logp.copy()
    draws(logp, [0], n=5, ignore_eos=True)
    np.testing.assert_array_equal(logp, before)


def test_repetition_in_window_falls_back_with_the_token_masked() -> None:
    # Nucleus always picks 0 (p=0.9); 0 was decoded 3 steps ago -> fallback over the full
    # distribution with 0 masked: only 1 and 2 are possible, in ratio 0.06 : 0.04.
    logp = logp_of([0.9, 0.06, 0.04])
    got = draws(logp, [7, 0, 7, 7], n=2000)
    assert 0 not in got
    counts = np.bincount(got, minlength=3)
    assert abs(counts[1] / 2000 - 0.6) < 0.05


def test_one_occurrence_is_enough_and_the_window_is_ten_tokens() -> None:
    logp = logp_of([0.9, 0.06, 0.04])
    inside = [0] + [5] * 9  # 0 is the 10th most recent token
    outside = [0] + [5] * 10  # 0 is 11 tokens back
    assert 0 not in draws(logp, inside, n=100)
    assert set(draws(logp, outside, n=100)) == {0}


def test_fallback_keeps_eos_masked() -> None:
    # Token 0 repeats -> fallback; EOS (index 3) has most of the remaining mass but stays masked.
    logp = logp_of([0.85, 0.01, 0.01, 0.13])
    got = draws(logp, [0], n=500, ignore_eos=True)
    assert set(got) <= {1, 2} and set(got) == {1, 2}


def test_fallback_may_choose_eos_after_min_len() -> None:
    logp = logp_of([0.85, 0.01, 0.01, 0.13])
    got = draws(logp, [0], n=500, ignore_eos=False)
    assert 3 in got and 0 not in got


def test_same_seed_same_tokens_and_different_seed_differs() -> None:
    logp = logp_of([1.0] * 30)
    a = draws(logp, [], n=50, seed=3)
    b = draws(logp, [], n=50, seed=3)
    c = draws(logp, [], n=50, seed=4)
    assert a == b and a != c


def test_every_stop_token_is_masked_before_min_len() -> None:
    """A vocabulary with stop tokens after EOS (CosyVoice2: 6561-6563): a forced length must never end early on one of
    them (a benchmark seed stopped at 77 of 125 tokens when only EOS was masked)."""
    eos = 4
    logp = np.log(np.array([0.01, 0.01, 0.01, 0.01, 0.02, 0.47, 0.47], dtype=np.float32))  # EOS 4, stops 5 and 6
    rng = np.random.default_rng(0)
    drawn = {ras_sampling(logp, [], rng, SamplingParams(), eos=eos, ignore_eos=True) for _ in range(200)}
    assert drawn <= {0, 1, 2, 3}
    after = {ras_sampling(logp, [], rng, SamplingParams(), eos=eos, ignore_eos=False) for _ in range(200)}
    assert after & {5, 6}
