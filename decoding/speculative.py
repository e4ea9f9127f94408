"""The math of lossless speculative decoding, as pure functions on tensors.

Leviathan et al. 2023 / Chen et al. 2023: the draft proposes x_1..x_k with probabilities q, the
target scores all of them in one forward pass giving p. Draft token x_i is accepted with
probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the replacement is sampled from
normalize(max(p_i - q_i, 0)); when all k are accepted a bonus token is sampled from p_{k+1}.
The emitted tokens are then distributed exactly as if sampled from the target alone.

Greedy decoding is the same rule on one-hot distributions: a draft token is accepted iff it is
the target's argmax, and the replacement is the target's argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def draw(probs: torch.Tensor, temperature: float, generator=None) -> torch.Tensor:
    """One token per row: probs [..., V] -> [...]. At temperature 0, probs is sampling_probs'
    one-hot argmax, read as such: torch.multinomial would draw V exponentials a row for the
    same token (2.4 ms of a 4-token draft step over SmolLM2's 49,152 tokens on 2 CPU cores)."""
    if temperature == 0:
        return probs.argmax(-1)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0,
                   top_k: int = 0) -> torch.Tensor:
    """The distribution decoding samples from: logits [..., V] -> probs [..., V] (float32).

    temperature 0 gives the one-hot argmax; otherwise softmax(logits / T), then top_k, then
    top_p (the smallest set of most likely tokens whose mass reaches top_p), renormalised.
    Applied identically to target and draft so both speak of the same distribution.
    """
    logits = logits.float()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly likelier tokens
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def acceptance_mask(p_token: torch.Tensor, q_token: torch.Tensor,
                    uniform: torch.Tensor) -> torch.Tensor:
    """Accept draft token i iff u_i < p_i(x_i) / q_i(x_i). All [B, k]; returns bool [B, k]."""
    return uniform * q_token < p_token  # the ratio without dividing by a possibly tiny q


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(p - q, 0)) over the last dim: [..., V] -> [..., V].

    Where p == q the residual is empty; such a position is never rejected, so p is returned
    there only to keep the result a distribution.
    """
    residual = (p - q).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp(min=1e-30), p)


@dataclass
class Verification:
    num_accepted: torch.Tensor
    """[B] draft tokens accepted per row, 0..k."""
    next_token: torch.Tensor
    """[B] the token emitted after the accepted ones: the replacement at the first rejection,
    or the bonus token when all k were accepted."""


def verify(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
           generator: torch.Generator | None = None) -> Verification:
    """One speculative step for a batch.

    draft_tokens [B, k] (long), draft_probs [B, k, V] (q, the distribution each draft token was
    sampled from), target_probs [B, k+1, V] (p at the k draft positions and the bonus position).
    Each row emits num_accepted draft tokens followed by next_token.
    """
    batch, k = draft_tokens.shape
    rows = torch.arange(batch, device=draft_tokens.device)
    p_token = target_probs[:, :k].gather(-1, draft_tokens[..., None])[..., 0]  # [B, k]
    q_token = draft_probs.gather(-1, draft_tokens[..., None])[..., 0]  # [B, k]
    uniform = torch.rand(batch, k, device=draft_tokens.device, generator=generator)
    accepted = acceptance_mask(p_token, q_token, uniform)  # [B, k]
    # accepted prefix length: index of the first rejection, k if none
    num_accepted = torch.cumprod(accepted.int(), dim=1).sum(1)  # [B]
    residual = residual_distribution(target_probs[:, :k], draft_probs)  # [B, k, V]
    choices = torch.cat([residual, target_probs[:, k:]], dim=1)  # [B, k+1, V]
    next_dist = choices[rows, num_accepted]  # [B, V]
    next_token = torch.multinomial(next_dist, 1, generator=generator)[:, 0]  # [B]
    return Verification(num_accepted, next_token)
