"""The accept/resample rule with toy distributions, and a statistical test of losslessness."""

import pytest
import torch

from decoding import speculative
from decoding.speculative import residual_distribution, sampling_probs, verify

V = 5


def _onehot(ids, v=V):
    return torch.nn.functional.one_hot(torch.tensor(ids), v).float()


def test_always_accept_when_draft_equals_target():
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(64, 4, V), -1)  # [B, k+1, V]
    tokens = torch.multinomial(p[:, :3].reshape(-1, V), 1).view(64, 3)
    out = verify(tokens, p[:, :3], p)
    assert out.num_accepted.tolist() == [3] * 64  # p/q = 1 everywhere


def test_never_accept_tokens_the_target_cannot_emit():
    q = _onehot([[4, 4, 4]] * 8)  # the draft is sure of token 4
    p = torch.tensor([0.5, 0.5, 0.0, 0.0, 0.0]).expand(8, 4, V)  # the target never says 4
    out = verify(torch.full((8, 3), 4), q, p)
    assert out.num_accepted.tolist() == [0] * 8
    assert set(out.next_token.tolist()) <= {0, 1}  # replacement from normalize(max(p - q, 0))


def test_partial_acceptance_stops_at_the_first_rejection():
    target_argmax = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]]
    draft = [[1, 2, 0], [0, 2, 3], [1, 2, 3]]  # row 0 fails at 2, row 1 at 0, row 2 never
    out = verify(torch.tensor(draft), _onehot(draft), _onehot(target_argmax))
    assert out.num_accepted.tolist() == [2, 0, 3]
    assert out.next_token.tolist() == [3, 1, 4]  # the target's token, bonus for row 2
    # a later match after a rejection does not count (row 1 matches at positions 1 and 2)


def test_acceptance_probability_is_min_one_p_over_q():
    p = torch.tensor([0.2, 0.8, 0, 0, 0]).expand(20000, 2, V)
    q = torch.tensor([0.6, 0.4, 0, 0, 0]).expand(20000, 1, V)
    out = verify(torch.zeros(20000, 1, dtype=torch.long), q, p,
                 torch.Generator().manual_seed(0))
    assert abs(out.num_accepted.float().mean().item() - 0.2 / 0.6) < 0.015


def test_argmax_drafting_accepts_with_p_and_resamples_from_p_without_the_draft_token():
    """A one-hot q (argmax drafting, vLLM's draft_sample_method 'greedy'): the draft token is
    accepted with probability p(x), the replacement follows p with x removed, renormalised; so
    the emitted token follows p."""
    n = 40000
    p = torch.tensor([0.1, 0.5, 0.3, 0.1, 0.0]).expand(n, 2, V)
    out = verify(torch.full((n, 1), 2), _onehot([[2]] * n), p, torch.Generator().manual_seed(0))
    accepted = out.num_accepted.bool()
    assert abs(accepted.float().mean().item() - 0.3) < 0.01
    replaced = torch.bincount(out.next_token[~accepted], minlength=V).float() / (~accepted).sum()
    torch.testing.assert_close(replaced, torch.tensor([1 / 7, 5 / 7, 0, 1 / 7, 0]), atol=0.01,
                               rtol=0)


def test_residual_distribution():
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.6, 0.2])
    torch.testing.assert_close(residual_distribution(p, q), torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(residual_distribution(p, p), p)  # empty residual stays a dist


def test_sampling_probs_filters():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert sampling_probs(logits, 0.0).tolist() == [1, 0, 0, 0]
    torch.testing.assert_close(sampling_probs(logits, 1.0), torch.tensor([0.5, 0.3, 0.15, 0.05]))
    torch.testing.assert_close(sampling_probs(logits, 1.0, top_k=2), torch.tensor([5, 3, 0, 0]) / 8)
    torch.testing.assert_close(sampling_probs(logits, 1.0, top_p=0.8), torch.tensor([5, 3, 0, 0]) / 8)
    torch.testing.assert_close(sampling_probs(logits, 1.0, top_p=0.81),
                               torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95)
    hot = sampling_probs(logits, 0.5)
    assert hot[0] > 0.5 and torch.isclose(hot.sum(), torch.tensor(1.0))


CHI2_CRITICAL_DF4_P001 = 18.467  # chi-square, 4 degrees of freedom, p = 0.001


def _chi_square_of_emitted(target_logits, draft_logits, temperature, k, n=40000, seed=0):
    """Worst chi-square of the first two emitted tokens vs the target's distribution.

    Toy models without context: each position has the same distributions, so each emitted
    token (accepted draft tokens, then the replacement or bonus) must follow p.
    """
    g = torch.Generator().manual_seed(seed)
    p = sampling_probs(target_logits, temperature)  # [V]
    q = sampling_probs(draft_logits, temperature)
    draft_probs = q.expand(n, k, V)
    tokens = torch.multinomial(q, n * k, replacement=True, generator=g).view(n, k)
    out = verify(tokens, draft_probs, p.expand(n, k + 1, V), g)
    first = torch.where(out.num_accepted > 0, tokens[:, 0], out.next_token)
    emitted = [first]
    if k > 1:  # the second token of rows that accepted the first one
        has_second = out.num_accepted > 0
        second = torch.where(out.num_accepted > 1, tokens[:, 1], out.next_token)
        emitted.append(second[has_second])
    chi2 = 0.0
    for tokens_at_position in emitted:
        observed = torch.bincount(tokens_at_position, minlength=V).float()
        expected = p * len(tokens_at_position)
        chi2 = max(chi2, ((observed - expected) ** 2 / expected).sum().item())
    return chi2, out


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.5])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_speculative_sampling_reproduces_the_target_distribution(temperature, k):
    target = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0])
    draft = torch.tensor([-1.0, 0.0, 1.0, 0.2, 0.1])  # deliberately different
    chi2, out = _chi_square_of_emitted(target, draft, temperature, k)
    assert chi2 < CHI2_CRITICAL_DF4_P001
    assert 0 < out.num_accepted.float().mean() < k  # both branches were exercised


@pytest.mark.parametrize("broken", ["always accept", "ratio q/p"])
def test_statistical_test_fails_when_the_acceptance_rule_is_broken(monkeypatch, broken):
    rules = {"always accept": lambda p, q, u: torch.ones_like(p, dtype=torch.bool),
             "ratio q/p": lambda p, q, u: u * p < q}
    monkeypatch.setattr(speculative, "acceptance_mask", rules[broken])
    target = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0])
    draft = torch.tensor([-1.0, 0.0, 1.0, 0.2, 0.1])
    chi2, _ = _chi_square_of_emitted(target, draft, 1.0, 3)
    assert chi2 > 10 * CHI2_CRITICAL_DF4_P001
