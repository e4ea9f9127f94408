"""Divergences between the target's and the draft's next-token distributions, per position.

Pure functions on logits [N, V] (N positions, V vocabulary), each returning a per-position loss
[N]; the training loop masks and averages over valid tokens. `temperature` divides both logits
first. Target logits may be -inf outside a top-k support (stage-1 top-k log-probs): terms with
p(v) = 0 count as 0, as in the definitions. DistillSpec (Zhou et al. 2023) shows the acceptance rate is 1 - TVD(p, q), so TVD is the
divergence that targets acceptance directly; the KLs and JSD are smoother surrogates.
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


def divergence(terms: list[tuple[float, str]], target_logits: torch.Tensor | None,
               draft_logits: torch.Tensor, target_tokens: torch.Tensor, *, beta: float = 0.5,
               temperature: float = 1.0) -> torch.Tensor:
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
        else:
            raise ValueError(f"unknown divergence {name!r}")
        total = total + weight * value
    return total
