"""Divergences between the target's and the draft's next-token distributions, per position.

Pure functions on logits [N, V] (N positions, V vocabulary), each returning a per-position loss
[N]; the training loop masks and averages over valid tokens. `temperature` divides both logits
first. Target logits may be -inf outside a top-k support (stage-1 top-k log-probs): terms with
p(v) = 0 count as 0, as in the definitions. DistillSpec (Zhou et al. 2023) shows the acceptance
rate is alpha = sum_v min(p(v), q(v)) = 1 - TVD(p, q), so TVD is the divergence that targets
acceptance directly; the KLs and JSD are smoother surrogates. The LK losses (Samarin et al.
2026, arXiv 2602.23881) target it too and train from a cold start, where TVD's gradient
vanishes over a large vocabulary: -log alpha, and an adaptive blend of forward KL and TVD.

dpace_weights is D-PACE's position weighting (arXiv 2605.18810) for drafts with several draft
positions per chain: a weight per position from the draft's own confidence along the chain.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _log_probs(target_logits, draft_logits, temperature):
    return (F.log_softmax(target_logits.float() / temperature, dim=-1),
            F.log_softmax(draft_logits.float() / temperature, dim=-1))


def _plogp_ratio(log_p, log_r):
    """sum_v p(v) (log p(v) - log r(v)), with 0 log 0 = 0. [N, V] x2 -> [N]."""
    p = log_p.exp()
    return torch.where(p > 0, p * (log_p - log_r), 0.0).sum(-1)


def hard_ce(draft_logits: torch.Tensor, target_tokens: torch.Tensor) -> torch.Tensor:
    """-log q(y) for the token the target wrote: draft_logits [N, V], target_tokens [N] -> [N].
    A label of -100 (a token outside a reduced draft vocabulary) counts 0."""
    return F.cross_entropy(draft_logits.float(), target_tokens, reduction="none")


def forward_kl(target_logits, draft_logits, temperature: float = 1.0) -> torch.Tensor:
    """KL(p || q) = sum_v p(v) (log p(v) - log q(v)): mode-covering. [N, V] x2 -> [N]."""
    log_p, log_q = _log_probs(target_logits, draft_logits, temperature)
    return _plogp_ratio(log_p, log_q)


def reverse_kl(target_logits, draft_logits, temperature: float = 1.0) -> torch.Tensor:
    """KL(q || p) = sum_v q(v) (log q(v) - log p(v)): mode-seeking. [N, V] x2 -> [N]."""
    log_p, log_q = _log_probs(target_logits, draft_logits, temperature)
    return (log_q.exp() * (log_q - log_p)).sum(-1)


def generalized_jsd(target_logits, draft_logits, beta: float = 0.5,
                    temperature: float = 1.0) -> torch.Tensor:
    """Generalised JSD (Agarwal et al. 2024, as in TRL's GKD), m = beta p + (1 - beta) q:
    beta KL(p || m) + (1 - beta) KL(q || m). It vanishes at both ends, where JSD / beta tends to
    KL(p || q) (beta -> 0) and JSD / (1 - beta) to KL(q || p) (beta -> 1); as in TRL the ends are
    taken as those KLs: beta = 0 -> forward KL, beta = 1 -> reverse KL. [N, V] x2 -> [N].
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta={beta} must be in [0, 1].")
    if beta == 0.0:
        return forward_kl(target_logits, draft_logits, temperature)
    if beta == 1.0:
        return reverse_kl(target_logits, draft_logits, temperature)
    log_p, log_q = _log_probs(target_logits, draft_logits, temperature)
    log_m = torch.logsumexp(torch.stack([log_p + math.log(beta), log_q + math.log(1 - beta)]),
                            dim=0)  # [N, V]
    kl_p = _plogp_ratio(log_p, log_m)
    kl_q = (log_q.exp() * (log_q - log_m)).sum(-1)
    return beta * kl_p + (1 - beta) * kl_q


def tvd(target_logits, draft_logits, temperature: float = 1.0) -> torch.Tensor:
    """Total variation 0.5 sum_v |p(v) - q(v)| in [0, 1]; 1 - TVD is the acceptance rate of one
    draft token sampled from q. [N, V] x2 -> [N]."""
    log_p, log_q = _log_probs(target_logits, draft_logits, temperature)
    return 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)


def acceptance(target_logits, draft_logits, temperature: float = 1.0) -> torch.Tensor:
    """alpha = sum_v min(p(v), q(v)) = 1 - TVD, the acceptance rate of one draft token sampled
    from q. [N, V] x2 -> [N]."""
    log_p, log_q = _log_probs(target_logits, draft_logits, temperature)
    return torch.minimum(log_p.exp(), log_q.exp()).sum(-1)


def lk_alpha(target_logits, draft_logits, temperature: float = 1.0,
             floor: float = 1e-6) -> torch.Tensor:
    """LK^alpha: -log alpha, the negative log acceptance rate. Its gradient is TVD's times
    1 / alpha, large where the overlap is small; 0 at q = p; at a one-hot p it is the
    cross-entropy -log q(y). alpha is floored at `floor` (no infinity at zero overlap).
    [N, V] x2 -> [N]."""
    return -torch.log(acceptance(target_logits, draft_logits, temperature).clamp_min(floor))


def lk_lambda(target_logits, draft_logits, eta: float = 3.0,
              temperature: float = 1.0) -> torch.Tensor:
    """LK^lambda: lambda KL(p || q) + (1 - lambda) TVD, lambda = exp(-eta sg[alpha]) per
    position (sg: no gradient through the weight): KL's gradient leads while the overlap is
    small, TVD's, acceptance itself, takes over as it grows. eta = 0 is forward KL, a large
    eta tends to TVD. [N, V] x2 -> [N]."""
    if eta < 0:
        raise ValueError(f"eta={eta} must be >= 0.")
    log_p, log_q = _log_probs(target_logits, draft_logits, temperature)
    p, q = log_p.exp(), log_q.exp()
    alpha = torch.minimum(p, q).sum(-1)
    weight = torch.exp(-eta * alpha.detach())
    return weight * _plogp_ratio(log_p, log_q) + (1 - weight) * (1 - alpha)


def dpace_weights(confidence: torch.Tensor, valid: torch.Tensor,
                  smoothing: float = 0.5) -> torch.Tensor:
    """D-PACE's weight of each draft position of a chain, from the draft's confidence in the
    target's token there (c_j = q(y_j)). confidence, valid [C, k] (C chains, k positions; a
    chain ends at its first invalid position) -> weights [C, k], no gradient:

        c~_j = (1 - smoothing) c_j + smoothing,   P_m = prod_{i <= m} c~_i,
        w_j = sum_{m >= j} P_m   (over the chain's valid positions)

    P_m is the chance the chain is accepted up to m, so w_j is the accepted length position j
    contributes to: a position the chain rarely reaches weighs little, and once the early
    positions are confident the later ones weigh more. smoothing in (0, 1]; 1 weighs position
    j by the chain's valid length from j on, whatever the confidence."""
    if not 0.0 < smoothing <= 1.0:
        raise ValueError(f"smoothing={smoothing} must be in (0, 1].")
    with torch.no_grad():
        reached = valid.bool().int().cumprod(dim=1).bool()  # [C, k] up to the first gap
        smoothed = ((1 - smoothing) * confidence.float() + smoothing) * reached
        prefix = smoothed.cumprod(dim=1)  # [C, k] P_m, 0 past the chain's end
        return prefix.flip(1).cumsum(1).flip(1) * reached  # suffix sums


def divergence(terms: list[tuple[float, str]], target_logits: torch.Tensor | None,
               draft_logits: torch.Tensor, target_tokens: torch.Tensor, *, beta: float = 0.5,
               temperature: float = 1.0, eta: float = 3.0) -> torch.Tensor:
    """A weighted mix sum_i w_i D_i (e.g. [(0.5, 'fkl'), (0.5, 'tvd')]), per position.
    target_logits [N, V] (None when only 'ce'), draft_logits [N, V], target_tokens [N] -> [N]."""
    total = torch.zeros(draft_logits.shape[0], device=draft_logits.device)
    for weight, name in terms:
        if name == "ce":
            value = hard_ce(draft_logits, target_tokens)
        elif name == "fkl":
            value = forward_kl(target_logits, draft_logits, temperature)
        elif name == "rkl":
            value = reverse_kl(target_logits, draft_logits, temperature)
        elif name == "jsd":
            value = generalized_jsd(target_logits, draft_logits, beta, temperature)
        elif name == "tvd":
            value = tvd(target_logits, draft_logits, temperature)
        elif name == "lk_alpha":
            value = lk_alpha(target_logits, draft_logits, temperature)
        elif name == "lk_lambda":
            value = lk_lambda(target_logits, draft_logits, eta, temperature)
        else:
            raise ValueError(f"unknown divergence {name!r}")
        total = total + weight * value
    return total
