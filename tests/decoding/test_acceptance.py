"""Predicted acceptance: the chained formula against its definition and a simulation."""

import pytest
import torch

from decoding.acceptance import (
    chain_sums,
    chained_acceptance,
    greedy_walk,
    match_probability,
    summarize,
)
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
    g = torch.Generator().manual_seed(3)
    p, q = torch.randn(5, 9, generator=g), torch.randn(5, 9, generator=g)
    torch.testing.assert_close(match_probability(p, q), 1 - tvd(p, q))
    q_same_argmax = p + 0.01 * torch.randn(5, 9, generator=g)
    assert match_probability(p, q_same_argmax, greedy=True).tolist() == [1.0] * 5


def test_no_window_is_an_error():
    with pytest.raises(ValueError, match="no window"):
        _predict([0.5, 0.5], [True, True], k=3)


def test_the_greedy_walk_steps_as_an_engine_and_restarts_in_each_reply():
    """Matches a[t] (the target's token at t predicted) over two replies of one row: positions
    0..6 (an easy stretch, then a hard one) and 9..10. The engine's steps, by hand: in the first
    reply s=0 accepts 2 (next s=3), s=3, 4 and 5 accept none (the last drafts 1 position); in
    the second, s=9 drafts 1 position and accepts it. Averaging over start positions instead
    counts the easy stretch once per start and says tau 2.0 for the first reply alone."""
    k = 2
    a = [0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 0]
    pred = torch.tensor([[t <= 6 or t in (9, 10) for t in range(len(a))]])
    grid = torch.zeros(1, len(a), k)
    valid = torch.zeros(1, len(a), k, dtype=torch.bool)
    for s in range(len(a)):
        for j in range(1, k + 1):
            if s + j < len(a) and pred[0, s] and pred[0, s + j]:
                grid[0, s, j - 1], valid[0, s, j - 1] = a[s + j], True
    assert greedy_walk(grid, valid, pred) == (5, [2, 1])
    first = pred.clone()
    first[0, 9:] = False
    assert greedy_walk(grid, valid & first[..., None], first) == (4, [1, 1])  # tau 1.5
    sums, windows = chain_sums(grid * first[..., None], valid & first[..., None])
    assert summarize(sums, windows).tau == pytest.approx(2.0)


def test_a_walk_through_an_unscored_start_is_no_walk():
    """A block drafter trained on some starts (train.block_starts > 0) scores only those: a walk
    that reaches another start cannot say what the engine would accept there."""
    pred = torch.tensor([[True] * 6 + [False]])
    grid = torch.ones(1, 7, 2)
    valid = torch.zeros(1, 7, 2, dtype=torch.bool)
    valid[0, 0] = True  # start 0 scored (accepts 2, so the walk goes on at 3), start 3 not
    assert greedy_walk(grid, valid, pred) is None
    valid[0, 3] = True
    assert greedy_walk(grid, valid, pred) == (2, [2, 2])


def test_predicted_speedup_is_tau_over_the_cost_of_a_step():
    from decoding.acceptance import predicted_speedup

    assert predicted_speedup([], 1.0, 0.3) == 1.0  # no draft: plain decoding
    assert predicted_speedup([0.5, 0.25], 1.0, 0.0) == pytest.approx(1.75)  # free verify
    assert predicted_speedup([0.5, 0.25], 1.25, 0.05) == pytest.approx(1.75 / 1.35)
    assert predicted_speedup([1.0, 1.0, 1.0], 1.0, 0.0) == 4.0  # the bound: k + 1


def test_prompt_bootstrap_tau_pools_prompts_and_resamples_them():
    from decoding.acceptance import prompt_bootstrap_tau

    drafts, accepted = [10, 10, 20], [5, 15, 10]
    tau, low, high = prompt_bootstrap_tau(drafts, accepted, seed=1)
    assert tau == 1 + 30 / 40 and low <= tau <= high and high - low > 0.1
    same = prompt_bootstrap_tau([10] * 8, [6] * 8)  # identical prompts: no spread
    assert same == pytest.approx((1.6, 1.6, 1.6))
    # paired: a head that accepts one more token per step on every prompt
    diff, low, high = prompt_bootstrap_tau(drafts, [a + d for a, d in zip(accepted, drafts)],
                                           drafts, accepted)
    assert (diff, low, high) == pytest.approx((1.0, 1.0, 1.0))
    diff, low, high = prompt_bootstrap_tau([10, 10], [9, 1], [10, 10], [1, 9], seed=0)
    assert diff == 0.0 and low < 0 < high  # better on one prompt, worse on the other
    with pytest.raises(ValueError, match="no prompts"):
        prompt_bootstrap_tau([], [])


def test_a_method_is_ahead_only_where_every_seeds_interval_excludes_zero():
    from decoding.acceptance import seeds_verdict as verdict

    assert verdict([(0.05, 0.01, 0.09), (0.04, 0.002, 0.08)]) == "ahead"
    assert verdict([(-0.05, -0.09, -0.01), (-0.04, -0.08, -0.002)]) == "behind"
    assert verdict([(0.05, 0.01, 0.09), (0.03, -0.01, 0.07)]) == "not resolved"
    assert verdict([(0.05, 0.01, 0.09), (-0.05, -0.09, -0.01)]) == "not resolved"
    assert verdict([]) == "not resolved"
