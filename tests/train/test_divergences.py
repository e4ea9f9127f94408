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


def test_acceptance_is_the_overlap_and_one_minus_tvd():
    from train.divergences import acceptance

    p, q = torch.softmax(P, -1), torch.softmax(Q, -1)
    torch.testing.assert_close(acceptance(P, Q), torch.minimum(p, q).sum(-1))
    torch.testing.assert_close(acceptance(P, Q), 1 - tvd(P, Q))


def test_lk_alpha_is_minus_log_acceptance_and_cross_entropy_at_a_one_hot_target():
    from train.divergences import acceptance, lk_alpha

    torch.testing.assert_close(lk_alpha(P, P), torch.zeros(6), atol=1e-6, rtol=0)
    torch.testing.assert_close(lk_alpha(P, Q), -torch.log(acceptance(P, Q)))
    labels = torch.randint(0, 11, (6,))
    one_hot = torch.full((6, 11), float("-inf")).scatter(1, labels[:, None], 0.0)
    torch.testing.assert_close(lk_alpha(one_hot, Q), hard_ce(Q, labels))
    disjoint = torch.full((1, 4), float("-inf"))
    disjoint[0, 0] = 0.0
    far = torch.tensor([[-1e4, 0.0, 0.0, 0.0]])  # no overlap: finite, at the floor
    assert torch.isfinite(lk_alpha(disjoint, far)).all()


def test_lk_lambda_runs_from_forward_kl_to_tvd_with_no_gradient_through_its_weight():
    from train.divergences import acceptance, lk_lambda

    torch.testing.assert_close(lk_lambda(P, Q, eta=0.0), forward_kl(P, Q))
    torch.testing.assert_close(lk_lambda(P, Q, eta=1e4), tvd(P, Q), atol=1e-4, rtol=0)
    weight = torch.exp(-3.0 * acceptance(P, Q))
    torch.testing.assert_close(lk_lambda(P, Q, eta=3.0),
                               weight * forward_kl(P, Q) + (1 - weight) * tvd(P, Q))
    q = Q.clone().requires_grad_(True)
    lk_lambda(P, q, eta=3.0).sum().backward()
    fixed = Q.clone().requires_grad_(True)  # the same blend, its weight a constant
    (weight * forward_kl(P, fixed) + (1 - weight) * tvd(P, fixed)).sum().backward()
    torch.testing.assert_close(q.grad, fixed.grad)
    with pytest.raises(ValueError, match="eta"):
        lk_lambda(P, Q, eta=-1.0)


def test_dpace_weighs_each_position_by_the_accepted_length_it_contributes_to():
    from train.divergences import dpace_weights

    sure, unsure = torch.ones(1, 3), torch.zeros(1, 3)
    every = torch.ones(1, 3, dtype=torch.bool)
    # confident everywhere: P = 1, 1, 1 -> w_j = the chain's length from j on
    torch.testing.assert_close(dpace_weights(sure, every), torch.tensor([[3.0, 2.0, 1.0]]))
    # no confidence, smoothing 0.5: P = 0.5, 0.25, 0.125
    torch.testing.assert_close(dpace_weights(unsure, every),
                               torch.tensor([[0.875, 0.375, 0.125]]))
    # a chain ends at its first invalid position
    gap = torch.tensor([[True, False, True]])
    torch.testing.assert_close(dpace_weights(sure, gap), torch.tensor([[1.0, 0.0, 0.0]]))
    confidence = torch.rand(4, 5, requires_grad=True)
    weights = dpace_weights(confidence, torch.ones(4, 5, dtype=torch.bool), 0.3)
    assert not weights.requires_grad and (weights[:, :-1] >= weights[:, 1:]).all()
    with pytest.raises(ValueError, match="smoothing"):
        dpace_weights(sure, every, 0.0)


def test_the_loop_gives_each_draft_row_the_dpace_weight_of_its_chain():
    from drafts.kind import chain_loss_rows
    from train.loop import dpace_row_weights

    pred_mask = torch.tensor([[False, True, True, True, True]])  # loss positions 1..4
    runs = chain_loss_rows(pred_mask, 3, 0.8)  # starts s, positions j: s + j a loss position
    labels = torch.tensor([2, 0, 1, 3])  # the target's token at each loss position
    rows = [torch.full((run.count, 4), -1e4).scatter(1, run.pick(labels)[:, None], 0.0)
            for run in runs]  # a draft certain of the target's token: confidence 1
    weights = dpace_row_weights(runs, rows, labels, 0.5)
    # chain from s = 0 covers positions 1..3 (loss positions 1, 2, 3): weights 3, 2, 1
    for run, w in zip(runs, weights):
        from_zero = (run.starts[:, 1] == 0).nonzero()[:, 0]
        assert w[from_zero].tolist() == [3.0 - (run.position - 1)]
    last = runs[0].starts[:, 1] == 3  # from s = 3 only position 1 exists: weight 1
    assert weights[0][last].tolist() == [1.0]
    outside = labels.clone()
    outside[0] = -100  # the label at loss position 1 is outside the draft's vocabulary
    weights = dpace_row_weights(runs, rows, outside, 0.5)
    # confidence 0 there: c~ = 0.5, then 1 and 1 -> P = 0.5, 0.5, 0.5 -> w_1 = 1.5
    assert weights[0][runs[0].starts[:, 1] == 0].tolist() == [1.5]
