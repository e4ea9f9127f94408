"""Divergences tested with no model, in the style of TRL's GKD tests."""

import pytest
import torch

from train.divergences import forward_kl, generalized_jsd, hard_ce, reverse_kl, tvd

torch.manual_seed(0)
P = torch.randn(6, 11) * 2  # target logits [N, V]
Q = torch.randn(6, 11) * 2  # draft logits


@pytest.mark.parametrize("fn", [forward_kl, reverse_kl, generalized_jsd, tvd])
def test_equal_inputs_give_zero(fn):
    torch.testing.assert_close(fn(P, P), torch.zeros(6), atol=1e-6, rtol=0)


def test_kls_match_torch_and_differ_from_each_other():
    p, log_q = torch.softmax(P, -1), torch.log_softmax(Q, -1)
    expected = torch.nn.functional.kl_div(log_q, p, reduction="none").sum(-1)  # KL(p || q)
    torch.testing.assert_close(forward_kl(P, Q), expected)
    torch.testing.assert_close(reverse_kl(P, Q), forward_kl(Q, P))
    assert not torch.allclose(forward_kl(P, Q), reverse_kl(P, Q))


def test_jsd_ends_are_the_two_kls_and_the_limits_agree():
    torch.testing.assert_close(generalized_jsd(P, Q, beta=0.0), forward_kl(P, Q))
    torch.testing.assert_close(generalized_jsd(P, Q, beta=1.0), reverse_kl(P, Q))
    torch.testing.assert_close(generalized_jsd(P, Q, beta=1e-4) / 1e-4, forward_kl(P, Q),
                               rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(generalized_jsd(P, Q, beta=1 - 1e-4) / 1e-4, reverse_kl(P, Q),
                               rtol=2e-2, atol=1e-3)
    half = generalized_jsd(P, Q, beta=0.5)
    assert (half >= 0).all() and (half <= torch.log(torch.tensor(2.0)) + 1e-6).all()
    torch.testing.assert_close(half, generalized_jsd(Q, P, beta=0.5))  # symmetric at 0.5


def test_tvd_is_in_unit_interval_and_one_minus_acceptance():
    d = tvd(P, Q)
    assert (d >= 0).all() and (d <= 1).all()
    p, q = torch.softmax(P, -1), torch.softmax(Q, -1)
    torch.testing.assert_close(1 - d, torch.minimum(p, q).sum(-1))  # expected acceptance
    disjoint = torch.tensor([[10.0, -1e4], [-1e4, 10.0]])
    torch.testing.assert_close(tvd(disjoint[:1], disjoint[1:]), torch.ones(1))


def test_temperature_flattens_both():
    assert (forward_kl(P, Q, temperature=4.0) < forward_kl(P, Q)).all()


def test_hard_ce_is_minus_log_q_of_the_target_token():
    tokens = P.argmax(-1)
    torch.testing.assert_close(hard_ce(Q, tokens),
                               -torch.log_softmax(Q, -1).gather(-1, tokens[:, None])[:, 0])


@pytest.mark.parametrize("fn", [forward_kl, reverse_kl, generalized_jsd, tvd])
def test_gradients_are_finite_even_for_peaked_logits(fn):
    q = (Q * 50).requires_grad_()
    fn(P * 50, q).sum().backward()
    assert torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0


def test_beta_out_of_range_is_refused():
    with pytest.raises(ValueError, match="beta"):
        generalized_jsd(P, Q, beta=1.5)


def test_topk_target_with_minus_inf_outside_its_support():
    from train.divergences import divergence

    sparse = torch.full_like(P, float("-inf"))
    top = P.topk(3, dim=-1)
    sparse.scatter_(1, top.indices, top.values)
    for fn in (forward_kl, tvd, lambda p, q: generalized_jsd(p, q, beta=0.5)):
        value = fn(sparse, Q)
        assert torch.isfinite(value).all()
    p_top = torch.softmax(top.values, -1)  # forward KL over the k tokens only
    log_q_top = torch.log_softmax(Q, -1).gather(1, top.indices)
    torch.testing.assert_close(forward_kl(sparse, Q), (p_top * (p_top.log() - log_q_top)).sum(-1))
    mix = divergence([(0.25, "fkl"), (0.75, "tvd")], sparse, Q, torch.zeros(6, dtype=torch.long))
    torch.testing.assert_close(mix, 0.25 * forward_kl(sparse, Q) + 0.75 * tvd(sparse, Q))


def test_mix_with_hard_ce_needs_no_target_logits():
    from train.divergences import divergence

    labels = torch.arange(6)
    torch.testing.assert_close(divergence([(1.0, "ce")], None, Q, labels), hard_ce(Q, labels))


def test_training_on_stored_top_k_matches_full_logits_where_the_top_k_hold_the_mass():
    """A draft (free logits) trained with forward KL against stage-1's top-8 log-probs learns
    what training against the full distribution learns, when the top 8 hold >= 99.9 % of the
    mass: after every step its full-distribution KL is within 0.001 nats of the full-trained
    draft's, and the loss falls 5x. With a flat target (the top 8 hold ~1 %) it is not, which
    is what the tolerance is there to tell apart."""
    from types import SimpleNamespace

    from train.divergences import forward_kl
    from train.loop import stored_target_logits

    def curves(target_logits, steps=40):
        top = target_logits.log_softmax(-1).topk(8)  # what stage 1 stores: ids, log-probs
        stored = stored_target_logits(SimpleNamespace(topk_ids=top.indices,
                                                      topk_logprobs=top.values), vocab)
        out = {}
        for name, p in (("full", target_logits), ("top-8", stored)):
            q = torch.zeros_like(target_logits, requires_grad=True)  # [N, V]
            optimizer = torch.optim.Adam([q], lr=0.1)
            out[name] = []
            for _ in range(steps):
                loss = forward_kl(p, q).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                out[name].append(float(forward_kl(target_logits, q.detach()).mean()))
        return top.values.exp().sum(-1).min(), out

    vocab = 1000
    torch.manual_seed(0)
    peaked = torch.randn(16, vocab)
    peaked[:, :8] += 14.0  # [N, V]: the top 8 hold >= 99.9 % of the mass
    mass, out = curves(peaked)
    assert mass >= 0.999
    assert out["top-8"][-1] < out["top-8"][0] / 5
    assert max(abs(a - b) for a, b in zip(out["top-8"], out["full"])) <= 1e-3
    mass, out = curves(torch.randn(16, vocab) * 0.1)  # flat: the top 8 hold ~1 %
    assert mass < 0.05 and max(abs(a - b) for a, b in zip(out["top-8"], out["full"])) > 0.5
