"""Acceptance of a draft: predicted from the target's and the draft's distributions (training's
held-out figures), and measured from an engine's counters with their 95 % intervals (eval,
serving.validate).

Predicted: on data the target wrote, the draft proposing at position t is accepted with probability
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
        return a.new_zeros(k, dtype=torch.float64), 0  # on a's device, as the sums it joins
    return chain_sums(a.double().unfold(1, k, 1), valid.unfold(1, k, 1))  # [B, T-k+1, k] each


def greedy_walk(grid: torch.Tensor, valid: torch.Tensor, pred_mask: torch.Tensor
                ) -> tuple[int, list[int]] | None:
    """What a greedy chain engine realises on the target's own greedy text, from the grid of
    argmax matches: (drafting steps, accepted per draft position [k]), as an engine counts them.

    Averaging over every start position (chain_sums) weighs easy stretches, which an engine
    crosses in few long steps, as much as hard ones, where it steps one token at a time, so it
    overstates tau. The walk steps as the engine does: in each reply (a run of pred_mask
    positions a..e), the first chain starts at a, reading the prompt's last state and the first
    reply token; L leading accepted draft positions end the step, and the next one starts at
    s + L + 1 (the bonus token's state), until the reply's last token is written (s = e).
    grid [B, T, k] 0/1 (grid[b, s, j-1]: draft position j of the chain starting at s matches the
    target), valid [B, T, k] bool, pred_mask [B, T] bool. None when a start the walk reaches was
    not scored at every draft position it drafts (drafters trained on a random subset of block
    starts, train.block_starts > 0, score only those)."""
    k = grid.shape[-1]
    matched, scored = (grid.bool() & valid).tolist(), valid.tolist()
    steps, accepted = 0, [0] * k
    for row, ok, mask in zip(matched, scored, pred_mask.tolist()):
        t = 0
        while t < len(mask):
            if not mask[t]:
                t += 1
                continue
            end = t
            while end + 1 < len(mask) and mask[end + 1]:
                end += 1
            s = t
            while s < end:  # x_{s+1} is written; x_{s+2}.. x_{end+1} are still to come
                if not all(ok[s][:min(k, end - s)]):
                    return None
                length = 0
                while length < min(k, end - s) and row[s][length]:
                    length += 1
                steps += 1
                for j in range(length):
                    accepted[j] += 1
                s += length + 1
            t = end + 1
    return steps, accepted


def summarize(sums: torch.Tensor, windows: int) -> PredictedAcceptance:
    """(sums [k], windows) pooled over batches -> tau and alpha_1..alpha_k."""
    if windows == 0:
        raise ValueError("no window of k consecutive target-written tokens to evaluate on")
    expected = sums / windows  # [k] E[prod_{i<j} a]
    return PredictedAcceptance(tau=1.0 + float(expected.sum()),
                               alpha=[round(float(x), 6) for x in expected], windows=windows)


def split(draft_logits: torch.Tensor, runs: list) -> list[torch.Tensor]:
    """[M, V] -> one [count, V] per drafts.kind.LossRows."""
    return list(draft_logits.split([s.count for s in runs]))


def acceptance_grid(values: list[torch.Tensor], runs: list, pred_mask: torch.Tensor,
                    k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row acceptance probabilities (one [count] per LossRows) -> a [B, T, k] grid and its valid
    mask: grid[b, s, j-1] = acceptance of draft position j in a chain that starts after position
    s, scored against the target at s + j. An autoregressive draft's value at loss position t
    serves every j (as position j of the chain starting at t - j)."""
    batch, length = pred_mask.shape
    grid = torch.zeros(batch, length, k, dtype=torch.float64, device=pred_mask.device)
    valid = torch.zeros(batch, length, k, dtype=torch.bool, device=pred_mask.device)
    for a, run in zip(values, runs):
        if run.position is None:
            per_position = torch.zeros(batch, length, dtype=torch.float64, device=a.device)
            per_position[pred_mask] = a.double()
            for j in range(1, min(k, length - 1) + 1):
                grid[:, : length - j, j - 1] = per_position[:, j:]
                valid[:, : length - j, j - 1] = pred_mask[:, j:]
        elif run.position <= k:
            grid[run.starts[:, 0], run.starts[:, 1], run.position - 1] = a.double()
            valid[run.starts[:, 0], run.starts[:, 1], run.position - 1] = True
    return grid, valid


# Measured: an engine's counters over requests ---------------------------------------------


def measured_acceptance(stats: list) -> tuple[float, list[float], float]:
    """Pool requests (decoding.engine.RequestStats): tau = 1 + accepted / steps, alpha_k =
    accepted_k / drafted_k, and the share of drafted tokens accepted."""
    steps = sum(s.steps for s in stats)
    accepted = sum(s.accepted for s in stats)
    drafted = sum(s.drafted for s in stats)
    width = max(len(s.drafted_per_position) for s in stats)
    alpha = []
    for position in range(width):
        d = sum(s.drafted_per_position[position] for s in stats)
        if d:
            alpha.append(sum(s.accepted_per_position[position] for s in stats) / d)
    return 1 + accepted / max(steps, 1), alpha, accepted / max(drafted, 1)


def rates(steps: int, accepted: list[int], drafted: list[int]) -> tuple[float, list[float]]:
    """Summed counters (drafting steps, accepted per position, steps that drafted each position)
    -> (tau, alpha_1..k conditional on the position being drafted)."""
    return (1 + sum(accepted) / max(steps, 1),
            [c / max(d, 1) for c, d in zip(accepted, drafted)])


def summed_counts(stats: list) -> tuple[int, list[int]]:
    """Our engine's counters in an engine's terms: (drafting steps, accepted per position)."""
    width = max(len(s.accepted_per_position) for s in stats)
    return (sum(s.steps for s in stats),
            [sum(s.accepted_per_position[j] for s in stats if j < len(s.accepted_per_position))
             for j in range(width)])


def tau_interval(drafts: int, accepted_per_position: list[int], design_effect: float = 1.0,
                 z: float = 1.96) -> tuple[float, float]:
    """95 % interval of tau = 1 + E[X] from an engine's counters, X the tokens accepted in one
    drafting step: P(X >= j) = accepted_per_position[j-1] / drafts, so E[X] = sum_j c_j / N and
    E[X^2] = sum_j (2j - 1) c_j / N. Steps of one request are correlated: the variance is scaled
    by design_effect (>= 1, measured on our engine's requests, see design_effect)."""
    n = max(drafts, 1)
    mean = sum(accepted_per_position) / n
    second = sum((2 * j + 1) * c for j, c in enumerate(accepted_per_position)) / n
    half = z * (max(second - mean * mean, 0.0) * design_effect / n) ** 0.5
    return 1 + mean - half, 1 + mean + half


def alpha_intervals(drafts: int | list[int], accepted_per_position: list[int],
                    design_effect: float = 1.0, z: float = 1.96) -> list[tuple[float, float]]:
    """95 % Wilson score interval of each alpha_j = c_j / N_j (a proportion of the drafting steps
    that drafted position j: N_j = drafts, or drafts[j] where an engine drafted fewer at the end).
    Wilson, not Wald: alpha_j for j >= 2 is often a few counts in hundreds, where Wald's
    a +- z sqrt(a(1 - a)/n) covers far less than 95 % and collapses to [0, 0] at c_j = 0. The
    design effect shrinks n to the effective number of independent steps."""
    counts = drafts if isinstance(drafts, list) else [drafts] * len(accepted_per_position)
    out = []
    for c, steps in zip(accepted_per_position, counts):
        n = max(steps, 1) / max(design_effect, 1.0)  # effective steps
        a = c / max(steps, 1)
        shrink = 1 + z * z / n
        center = (a + z * z / (2 * n)) / shrink
        half = z / shrink * (a * (1 - a) / n + z * z / (4 * n * n)) ** 0.5
        out.append((max(center - half, 0.0), min(center + half, 1.0)))
    return out


def design_effect(stats: list) -> float:
    """How much the per-request clustering of drafting steps inflates the variance of the
    pooled accepted-per-step mean: the cluster-robust (per-request) variance of the ratio
    sum(accepted) / sum(steps) over the variance that independent steps would give; >= 1."""
    rows = [(s.accepted, s.steps) for s in stats if s.steps]
    steps = sum(n for _, n in rows)
    if len(rows) < 2 or steps == 0:
        return 1.0
    mean = sum(a for a, _ in rows) / steps
    cluster = len(rows) / (len(rows) - 1) * sum((a - mean * n) ** 2 for a, n in rows) / steps ** 2
    low, high = tau_interval(*summed_counts(stats), 1.0, 1.0)
    independent = ((high - low) / 2) ** 2
    return max(1.0, cluster / independent) if independent > 0 else 1.0


def predicted_speedup(alpha: list[float], verify_ratio: float, draft_share: float) -> float:
    """Plain decoding's time per token over speculative decoding's, for a chain of k = len(alpha):

        speedup(k) = tau(k) / (verify_ratio(k) + k * draft_share),  tau(k) = 1 + sum_j alpha_j

    alpha [k]: the acceptance rate at each draft position (alpha_j: the share of steps whose
    j-th drafted token is accepted, as eval reports it, so it is the same at any longer k);
    verify_ratio: a (k + 1)-token target forward over a 1-token one; draft_share: one draft
    step over a 1-token target forward."""
    return (1 + sum(alpha)) / (verify_ratio + len(alpha) * draft_share)


def prompt_bootstrap_tau(drafts: list[int], accepted: list[int],
                         other_drafts: list[int] | None = None,
                         other_accepted: list[int] | None = None, draws: int = 2000,
                         seed: int = 0) -> tuple[float, float, float]:
    """tau = 1 + sum(accepted) / sum(drafts) over prompts (one engine's drafting steps and
    accepted tokens per prompt, [P] each), with a 95 % interval from resampling prompts with
    replacement (the prompt, not the drafting step, is the independent unit) -> (tau, low,
    high). With other_*: the paired difference tau - tau_other on the same prompts, resampled
    together -> (difference, low, high)."""
    import random

    def tau(d: list[int], a: list[int], ix) -> float:
        total = sum(d[i] for i in ix)
        return 1 + sum(a[i] for i in ix) / total if total else float("nan")

    def value(ix) -> float:
        own = tau(drafts, accepted, ix)
        return own if other_drafts is None else own - tau(other_drafts, other_accepted, ix)

    n, rng = len(drafts), random.Random(seed)
    if n == 0:
        raise ValueError("no prompts to resample.")
    samples = sorted(value([rng.randrange(n) for _ in range(n)]) for _ in range(draws))
    samples = [s for s in samples if s == s] or [float("nan")]  # a draw with no drafts at all
    low, high = (samples[min(len(samples) - 1, int(q * len(samples)))] for q in (0.025, 0.975))
    return value(range(n)), low, high


def seeds_verdict(differences: list[tuple[float, float, float]]) -> str:
    """One method against another from each training seed's paired (difference, low, high):
    'ahead' or 'behind' when every seed's 95 % interval excludes 0 on the same side, else
    'not resolved' (one seed's interval over prompts cannot speak for the variation between
    trainings)."""
    if differences and all(low > 0 for _, low, _ in differences):
        return "ahead"
    if differences and all(high < 0 for _, _, high in differences):
        return "behind"
    return "not resolved"
