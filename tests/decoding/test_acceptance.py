"""Predicted acceptance: the chained formula against its definition and a simulation."""

import pytest
import torch

from decoding.acceptance import chained_acceptance, match_probability, summarize
from train.divergences import tvd


def _predict(a, valid, k):
    sums, n = chained_acceptance(torch.as_tensor(a, dtype=torch.float64)[None],
                                 torch.as_tensor(valid)[None], k)
    return summarize(sums, n)


def test_always_accepted_gives_k_plus_one():
    result = _predict([1.0] * 10, [True] * 10, k=4)
    assert result.tau == pytest.approx(5.0)
    assert result.alpha == [1.0] * 4
    assert result.windows == 7


def test_constant_rate_gives_geometric_sum():
    c = 0.6
    result = _predict([c] * 12, [True] * 12, k=3)
    assert result.tau == pytest.approx(1 + c + c**2 + c**3)
    assert result.alpha == pytest.approx([c, c**2, c**3], abs=1e-6)  # vLLM's per-position rate


def test_windows_never_cross_an_invalid_position():
    # two replies of 3 tokens separated by a prompt token: k=3 fits once in each
    a = [0.5, 0.5, 0.5, 1.0, 0.9, 0.9, 0.9]
    valid = [True, True, True, False, True, True, True]
    result = _predict(a, valid, k=3)
    assert result.windows == 2
    expected = ((0.5 + 0.25 + 0.125) + (0.9 + 0.81 + 0.729)) / 2
    assert result.tau == pytest.approx(1 + expected)


def test_matches_a_simulation_of_speculative_acceptance():
    torch.manual_seed(0)
    a = torch.rand(40).double()
    k, trials = 4, 20000
    result = _predict(a, [True] * 40, k)
    accepted = []
    for t in range(40 - k + 1):
        coins = torch.rand(trials, k) < a[t:t + k]  # accept draft position j with prob a_{t+j}
        accepted.append(coins.int().cumprod(-1).sum(-1).double().mean())
    assert result.tau == pytest.approx(1 + float(torch.stack(accepted).mean()), abs=0.02)


def test_match_probability_is_one_minus_tvd_and_greedy_is_argmax_agreement():
    p, q = torch.randn(5, 9), torch.randn(5, 9)
    torch.testing.assert_close(match_probability(p, q), 1 - tvd(p, q))
    q_same_argmax = p + 0.01 * torch.randn(5, 9)
    assert match_probability(p, q_same_argmax, greedy=True).tolist() == [1.0] * 5


def test_no_window_is_an_error():
    with pytest.raises(ValueError, match="no window"):
        _predict([0.5, 0.5], [True, True], k=3)
