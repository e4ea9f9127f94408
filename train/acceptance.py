"""Predicted acceptance of a draft from the target's and the draft's distributions.

On data the target wrote, the draft proposing at position t is accepted with probability
a_t = sum_v min(p_t(v), q_t(v)) = 1 - TVD(p_t, q_t) when both sample (temperature 1), or
a_t = [argmax q_t == argmax p_t] under greedy decoding. A chain of k draft tokens starting at t is
accepted up to position j with probability prod_{i<j} a_{t+i} (the draft continues along the
target's own text, which is what an accepted prefix is). Hence, over all start positions t:

    alpha_j = E[prod_{i<j} a_{t+i}]           (draft position j accepted, so all before it were)
    tau     = 1 + sum_{j=1..k} E[prod_{i<j} a_{t+i}]                (tokens per target forward)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from drafts.kind import Slot


@dataclass
class PredictedAcceptance:
    tau: float
    """Expected tokens per target forward for k draft tokens, the bonus token included."""
    alpha: list[float]
    """alpha_1..alpha_k: the share of steps whose draft token j is accepted (and so all before
    it): vLLM's per-position acceptance (accepted_per_pos[j] / drafts) and our engine's."""
    windows: int
    """Start positions averaged over."""

    def to_dict(self) -> dict:
        return {"tau": self.tau, "alpha": self.alpha, "windows": self.windows}


def match_probability(target_logits: torch.Tensor, draft_logits: torch.Tensor,
                      greedy: bool = False) -> torch.Tensor:
    """Per-position acceptance a = sum_v min(p, q), or [argmax q == argmax p] when greedy.
    [N, V] x2 -> [N]."""
    if greedy:
        return (target_logits.argmax(-1) == draft_logits.argmax(-1)).float()
    p = torch.softmax(target_logits.float(), -1)
    q = torch.softmax(draft_logits.float(), -1)
    return torch.minimum(p, q).sum(-1)


def chain_sums(grid: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Sums over chain starts of prod_{i<=j} a_i, j = 1..k, for chains whose k positions are all
    valid. grid [B, T, k] (grid[b, s, j-1]: acceptance of draft position j of the chain starting
    at s), valid [B, T, k] bool -> (sums [k], number of chains). Head drafts (Medusa) fill the grid
    directly; an autoregressive draft's per-position values go through chained_acceptance."""
    ok = valid.all(-1)  # [B, T]
    chains = grid.double().cumprod(-1)[ok]  # [W, k]
    return chains.sum(0), int(ok.sum())


def chained_acceptance(a: torch.Tensor, valid: torch.Tensor, k: int) -> tuple[torch.Tensor, int]:
    """Sums over start positions of prod_{i<j} a_{t+i}, j = 1..k, for windows of k valid positions.

    a [B, T] per-position acceptance, valid [B, T] bool (positions the target wrote) ->
    (sums [k], number of windows).
    """
    if a.shape[1] < k:
        return torch.zeros(k, dtype=torch.float64), 0
    return chain_sums(a.double().unfold(1, k, 1), valid.unfold(1, k, 1))  # [B, T-k+1, k] each


def summarize(sums: torch.Tensor, windows: int) -> PredictedAcceptance:
    """(sums [k], windows) pooled over batches -> tau and alpha_1..alpha_k."""
    if windows == 0:
        raise ValueError("no window of k consecutive target-written tokens to evaluate on")
    expected = sums / windows  # [k] E[prod_{i<j} a]
    return PredictedAcceptance(tau=1.0 + float(expected.sum()),
                               alpha=[round(float(x), 6) for x in expected], windows=windows)


def split(draft_logits: torch.Tensor, slots: list[Slot]) -> list[torch.Tensor]:
    """[M, V] -> one [count, V] per slot."""
    return list(draft_logits.split([s.count for s in slots]))


def acceptance_grid(values: list[torch.Tensor], slots: list[Slot], pred_mask: torch.Tensor,
                    k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row acceptance probabilities (one [count] per slot) -> a [B, T, k] grid and its valid
    mask: grid[b, s, j-1] = acceptance of draft position j in a chain that starts after position
    s, scored against the target at s + j. An autoregressive draft's value at loss position t
    serves every j (as position j of the chain starting at t - j)."""
    batch, length = pred_mask.shape
    grid = torch.zeros(batch, length, k, dtype=torch.float64, device=pred_mask.device)
    valid = torch.zeros(batch, length, k, dtype=torch.bool, device=pred_mask.device)
    for a, slot in zip(values, slots):
        if slot.position is None:
            per_position = torch.zeros(batch, length, dtype=torch.float64, device=a.device)
            per_position[pred_mask] = a.double()
            for j in range(1, min(k, length - 1) + 1):
                grid[:, : length - j, j - 1] = per_position[:, j:]
                valid[:, : length - j, j - 1] = pred_mask[:, j:]
        elif slot.position <= k:
            grid[slot.starts[:, 0], slot.starts[:, 1], slot.position - 1] = a.double()
            valid[slot.starts[:, 0], slot.starts[:, 1], slot.position - 1] = True
    return grid, valid
