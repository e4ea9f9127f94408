"""How many tokens to draft next: the per-step heuristic and the time-window scheduler.

The window scheduler (our seed system's: adjust K from the acceptance observed over the last
~100 ms) keeps the steps that ended within the window and picks the k that maximizes the
expected tokens per second,

    E[tokens per step](k) = 1 + sum_{i=1..k} prod_{j<=i} a_j
    seconds per step(k)   = verify + k * draft_per_token
    k* = argmax_k E[tokens](k) / seconds(k),   1 <= k <= k_max,

with a_j the conditional acceptance at draft position j in the window (rows accepting j
among those accepting j-1), draft_per_token the draft's seconds per drafted position and
verify the target's seconds per step, all measured in the window. Positions never offered in
the window take the last observed rate (so k can grow past what was tried).

generate picks the schedule once, before its loop (make_schedule): fixed k, the per-step
heuristic, or the window.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from recipe import DecodeSettings


def heuristic_k(k: int, accepted: list[int], k_max: int) -> int:
    """transformers' 'heuristic': +2 after a step where every row accepted all k, else -1."""
    return min(k + 2, k_max) if min(accepted) == k else max(k - 1, 1)


def best_k(alpha: list[float], draft_per_token: float, verify: float, k_max: int) -> int:
    """The k in [1, k_max] with the most expected tokens per second (module docstring).
    alpha: conditional acceptance per position (at least one); seconds > 0."""
    rates = (alpha + [alpha[-1]] * k_max)[:k_max]
    best, best_rate, expected, survive = 1, 0.0, 1.0, 1.0
    for k in range(1, k_max + 1):
        survive *= rates[k - 1]
        expected += survive
        rate = expected / (verify + k * draft_per_token)
        if rate > best_rate + 1e-12:
            best, best_rate = k, rate
    return best


@dataclass
class StepRecord:
    end: float
    """perf_counter seconds at the step's end."""
    rows: int
    """Rows still decoding: each was offered the step's k draft positions."""
    accepted: list[int]
    """[k] rows that accepted draft position j."""
    draft_seconds: float
    verify_seconds: float


class WindowScheduler:
    """k for the next step from the steps of the last window_ms milliseconds."""

    def __init__(self, window_ms: float, k_max: int):
        self.window, self.k_max = window_ms / 1000, k_max
        self.steps: deque[StepRecord] = deque()

    def record(self, step: StepRecord) -> None:
        self.steps.append(step)
        while len(self.steps) > 1 and step.end - self.steps[0].end > self.window:
            self.steps.popleft()

    def next_k(self, current: int) -> int:
        """current: the k to keep while the window holds no acceptance to go by."""
        width = max(len(s.accepted) for s in self.steps)
        hits, bases = [0] * width, [0] * width  # conditional: accepted at j among rows at j-1
        for s in self.steps:
            for j in range(len(s.accepted)):
                bases[j] += s.rows if j == 0 else s.accepted[j - 1]
                hits[j] += s.accepted[j]
        alpha = []
        for hit, base in zip(hits, bases):
            if base == 0:
                break
            alpha.append(hit / base)
        if not alpha:
            return current
        draft_per_token = (sum(s.draft_seconds for s in self.steps)
                           / max(sum(len(s.accepted) for s in self.steps), 1))
        verify = sum(s.verify_seconds for s in self.steps) / len(self.steps)
        return best_k(alpha, max(draft_per_token, 1e-9), max(verify, 1e-9), self.k_max)


@dataclass
class StepTimes:
    end: float
    """perf_counter seconds at the step's end."""
    draft_seconds: float
    verify_seconds: float


class FixedK:
    def next_k(self, k: int, accepted: list[int], active: list[int], done: list[bool],
               times: StepTimes) -> int:
        return k


class HeuristicK:
    """heuristic_k over the rows still decoding after the step (all rows when none is)."""

    def __init__(self, k_max: int):
        self.k_max = k_max

    def next_k(self, k: int, accepted: list[int], active: list[int], done: list[bool],
               times: StepTimes) -> int:
        still = [n for n, d in zip(accepted, done) if not d] or accepted
        return heuristic_k(k, still, self.k_max)


class WindowK:
    """The WindowScheduler fed with each step: the rows active during it, the rows accepting
    each position, its draft and verify seconds."""

    def __init__(self, window_ms: float, k_max: int):
        self.window = WindowScheduler(window_ms, k_max)

    def next_k(self, k: int, accepted: list[int], active: list[int], done: list[bool],
               times: StepTimes) -> int:
        self.window.record(StepRecord(times.end, len(active),
                                      [sum(accepted[row] > j for row in active)
                                       for j in range(k)],
                                      times.draft_seconds, times.verify_seconds))
        return self.window.next_k(k)


def make_schedule(settings: DecodeSettings, drafting: bool) -> FixedK | HeuristicK | WindowK:
    """The k schedule settings ask for: fixed, per step (heuristic) or per time window."""
    if not drafting or not settings.adaptive_k:
        return FixedK()
    if settings.adaptive_policy == "window":
        return WindowK(settings.window_ms, settings.k_max)
    return HeuristicK(settings.k_max)
