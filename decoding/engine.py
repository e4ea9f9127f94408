"""The speculative decoding loop: propose k with the draft, verify in one target forward, accept
with min(1, p/q), resample from max(p - q, 0) at a rejection, bonus token when all k pass.

With settings.tree (or ngram_branch) a step verifies a token tree instead: the draft's chain
with its ranked alternatives per position (or a static tree of ranks, settings.tree_paths, or
a dynamic EAGLE-2 tree the draft expands, settings.tree_nodes) and the n-gram match, in one
target forward with a tree mask, accepted by the lossless walk of decoding/tree.py. The step
(decoding/steps.py) and the k schedule (decoding/schedule.py) are chosen once, before the loop.

When sampling, the draft proposes at settings.draft_temperature if set (0: argmax drafting with a
one-hot q, vLLM's and llama.cpp's default), else at the target's settings; settings.draft_top_k
filters its q instead of the target's top_k (llama.cpp's probabilistic drafting: 10).

Without a draft the same loop is plain target decoding (k = 0: every step emits the bonus token).
Batches of any size: rows accept different numbers of tokens, their caches keep holes instead
of being cropped (decoding/kv.py). The settings are recipe.DecodeSettings; the draft is anything
that implements Draft (drafts/ holds every kind).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch

from decoding.kv import CachedLM
from decoding.schedule import StepTimes, make_schedule
from decoding.speculative import draw, sampling_probs
from decoding.steps import Outcome, make_step
from recipe import DecodeSettings


class Sampling(Protocol):
    temperature: float
    top_p: float
    top_k: int


class Draft(Protocol):
    """What the engine asks of a draft, whatever its kind (drafts/ holds them). A draft proposes
    k tokens per row with the distribution q each was sampled from; verification keeps the
    output the target's whatever it proposes."""

    name: str
    uses_target_hidden: bool
    """True: start/accept receive target_hidden, the hidden states of the target's last forward
    (HF output_hidden_states: a tuple of [B, t, H], post-norm last hidden state last)."""

    def start(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
              first_token: torch.Tensor, target_hidden=None) -> None:
        """A new batch: prompts [B, T] (left-padded) and the target's first token [B]."""

    def propose(self, k: int, sampling: Sampling, history: list[list[int]],
                generator: torch.Generator | None = None):
        """-> (tokens [B, k] long, probs [B, k, V] float): what the draft proposes and the
        distribution q each token was sampled from. history: each row's tokens so far;
        generator: the engine's, which every random draw of the draft must use (a seeded run
        then repeats exactly, whatever else uses the global RNG)."""

    def accept(self, num_accepted: torch.Tensor, next_token: torch.Tensor,
               target_hidden=None, path: torch.Tensor | None = None) -> None:
        """The verification outcome: accepted tokens [B] and the token emitted after them;
        target_hidden covers the verified chunk [pending, d_1..d_k]. path [B, k] (a tree step):
        the accepted tokens (the first num_accepted of each row), which may leave the draft's
        own chain (an alternative, an n-gram branch); target_hidden then covers
        [pending, path_1..path_k]. None: the accepted tokens are the draft's chain."""

    # Optional capabilities: every draft declares them, None where it lacks one.
    scores: torch.Tensor | None
    """[B, k, V] the unfiltered logits behind the last proposal, which rank the alternatives a
    tree adds at each position; None: the kind drafts chains in trees."""
    failures: torch.Tensor | None
    """[B] bool: rows whose draft produced non-finite logits and fell back to plain decoding;
    None: a kind that never falls back."""
    propose_tree: Callable | None
    """For dynamic trees (settings.tree_nodes): propose_tree(k, width, generator) -> candidates
    (tokens, parents, scores) [B, M] for decoding.tree.dynamic_tree, the draft's own cache
    left as before (accept then receives the accepted path). None: the default tree shape."""
    # Adaptive verification (settings.confidence_min > 0) asks two more of a draft (DSpark's):
    # confidence [B, k], each proposed token's estimated acceptance, and truncate(n), after
    # which the step verifies (and accept counts) the first n tokens of the proposal alone.


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device):
    """input_ids and attention_mask [B, L_max], each prompt right-aligned."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        input_ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
        attention_mask[row, width - len(p):] = 1
    return input_ids.to(device), attention_mask.to(device)



@dataclass
class RequestStats:
    """Counts for one request (row); tau = 1 + accepted / steps, the vLLM definition."""

    steps: int = 0
    """Target verification forwards while the request was active (prefill excluded)."""
    drafted: int = 0
    accepted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    accepted_per_step: list[int] = field(default_factory=list)
    """Draft tokens accepted at each step, in order (how another engine that trims drafts near
    max_new_tokens would have counted this request: serving.engines.llamacpp.budgeted)."""
    draft_failures: int = 0
    """1 when the draft produced non-finite logits and the request fell back to plain decoding."""
    accepted_alternative: int = 0
    """Tree steps: accepted tokens that were the draft's alternatives, not its chain."""
    accepted_ngram: int = 0
    """Hybrid steps: accepted tokens that only the n-gram branch proposed."""
    tree_fallbacks: int = 0
    """Tree steps: non-finite draft distributions tested as point masses instead (lossless)."""

    @property
    def tau(self) -> float:
        return 1.0 + self.accepted / self.steps if self.steps else 1.0


@dataclass
class Generation:
    tokens: list[list[int]]
    """Per row: the generated tokens, the stop token included when one was emitted."""
    stats: list[RequestStats]
    draft_seconds: float
    verify_seconds: float
    k_used: list[int]
    """k of each step (constant unless adaptive)."""


@torch.no_grad()
def generate(target, input_ids: torch.Tensor, attention_mask: torch.Tensor,
             settings: DecodeSettings, stop_token_ids: set[int], draft: Draft | None = None,
             generator: torch.Generator | None = None, decode=None,
             on_tokens=None) -> Generation:
    """Decode left-padded prompts [B, T] with the target, speculatively when a draft is given.

    decode (token ids -> text) is needed only for settings.stop_strings. on_tokens(row, tokens,
    finished, stats) -> bool, if given, receives each row's tokens as soon as a step emits them
    (the verified group, the stop token included), whether the row is finished and its
    RequestStats so far; returning False ends the row there (a client that went away, a stop
    the caller detects), its tokens so far kept."""
    check_fits(target, attention_mask, settings, draft)
    stopped = stop_rule(settings, stop_token_ids, decode)
    target_lm = CachedLM(target, keep_hidden_states=draft is not None and draft.uses_target_hidden)

    def probs(logits):  # [..., V] -> [..., V], the same filters for target and draft
        return sampling_probs(logits, settings.temperature, settings.top_p, settings.top_k)

    clock = Clock()
    with clock.verifying():
        first = draw(probs(target_lm.prefill(input_ids, attention_mask)), settings.temperature,
                     generator)  # [B]
    rows = Rows(input_ids, attention_mask, first, settings.k_max_used, stopped, on_tokens)
    if draft is not None:
        with clock.drafting():
            draft.start(input_ids, attention_mask, first, target_lm.hidden_states)
    step = make_step(settings, target_lm, draft, probs, generator)
    schedule = make_schedule(settings, draft is not None)
    pending, k, k_used = first, settings.k if draft is not None else 0, []
    while not rows.all_done():
        before, active = clock.snapshot(), rows.active()
        with clock.drafting():
            proposal = step.propose(pending, k, rows.histories)
        verified = k if proposal.k is None else proposal.k  # fewer: adaptive verification
        with clock.verifying():
            outcome = step.verify(pending, verified, proposal)
        with clock.drafting():
            step.accept(outcome)
        k_used.append(verified)
        rows.record(outcome, verified, draft)
        pending = outcome.next_token
        k = schedule.next_k(k, outcome.num_accepted.tolist(), active, rows.done,
                            clock.since(before))
    return Generation(rows.outputs, rows.stats, clock.draft_seconds, clock.verify_seconds,
                      k_used)


def check_fits(target, attention_mask: torch.Tensor, settings: DecodeSettings, draft) -> None:
    """Refuse prompts that with max_new_tokens and the draft's depth exceed the context."""
    context = getattr(getattr(target, "config", None), "max_position_embeddings", None)
    depth = 0 if draft is None else settings.k_max_used
    longest = int(attention_mask.sum(1).max())
    if context is not None and longest + settings.max_new_tokens + depth > context:
        raise ValueError(
            f"a prompt of {longest} tokens + max_new_tokens {settings.max_new_tokens} + "
            f"{depth} draft positions (a chain's or a tree's depth, k) exceed the target's "
            f"context of {context} positions: lower max_new_tokens or k, or shorten the prompt.")


def stop_rule(settings: DecodeSettings, stop_token_ids: set[int], decode):
    """tokens -> whether a row stops there (a stop token, max_new_tokens, a stop string)."""
    if settings.stop_strings and decode is None:
        raise ValueError("stop_strings need a decode function (the tokenizer's decode).")
    tail = max((len(s) for s in settings.stop_strings), default=0) + 2  # tokens to re-decode

    def stopped(tokens: list[int]) -> bool:
        if tokens[-1] in stop_token_ids or len(tokens) >= settings.max_new_tokens:
            return True
        return bool(settings.stop_strings) and any(
            s in decode(tokens[-tail:]) for s in settings.stop_strings)
    return stopped


class Clock:
    """Seconds spent drafting and verifying (prefill counts as verifying)."""

    def __init__(self):
        self.draft_seconds = self.verify_seconds = 0.0

    @contextmanager
    def drafting(self):
        start = time.perf_counter()
        with torch.profiler.record_function("draft"):  # the draft's share in a profile
            yield
        self.draft_seconds += time.perf_counter() - start

    @contextmanager
    def verifying(self):
        start = time.perf_counter()
        yield
        self.verify_seconds += time.perf_counter() - start

    def snapshot(self) -> tuple[float, float]:
        return self.draft_seconds, self.verify_seconds

    def since(self, before: tuple[float, float]) -> StepTimes:
        return StepTimes(time.perf_counter(), self.draft_seconds - before[0],
                         self.verify_seconds - before[1])


class Rows:
    """Each row's tokens, history, stop state and RequestStats, and the hand-off of newly
    emitted tokens to on_tokens."""

    def __init__(self, input_ids, attention_mask, first: torch.Tensor, k_max: int, stopped,
                 on_tokens):
        self.stopped, self.on_tokens = stopped, on_tokens
        self.histories = [row[mask.bool()].tolist() + [t] for row, mask, t in
                          zip(input_ids, attention_mask, first.tolist())]
        self.outputs = [[t] for t in first.tolist()]
        self.done = [stopped(o) for o in self.outputs]
        self.stats = [RequestStats(drafted_per_position=[0] * k_max,
                                   accepted_per_position=[0] * k_max) for _ in self.outputs]
        for row in range(len(self.outputs)):
            self.emit(row, self.outputs[row][:])

    def all_done(self) -> bool:
        return all(self.done)

    def active(self) -> list[int]:
        return [row for row, d in enumerate(self.done) if not d]

    def emit(self, row: int, tokens: list[int]) -> None:
        if self.on_tokens is not None and not self.on_tokens(row, tokens, self.done[row],
                                                             self.stats[row]):
            self.done[row] = True

    def record(self, outcome: Outcome, k: int, draft) -> None:
        """Count the step for every active row, then append its accepted tokens and the next
        token until the row stops."""
        accepted, following = outcome.num_accepted.tolist(), outcome.next_token.tolist()
        for row, (n, nxt) in enumerate(zip(accepted, following)):
            if self.done[row]:
                continue
            s = self.stats[row]
            s.steps += 1
            s.drafted += outcome.drafted[row]
            s.accepted += n
            s.accepted_per_step.append(n)
            for position in range(k):
                s.drafted_per_position[position] += 1
                s.accepted_per_position[position] += position < n
            if draft is not None and draft.failures is not None:
                s.draft_failures = int(draft.failures[row])
            if outcome.fallbacks is not None:  # a tree step
                s.accepted_alternative += outcome.alternative[row]
                s.accepted_ngram += outcome.ngram[row]
                s.tree_fallbacks += outcome.fallbacks[row]
            before = len(self.outputs[row])
            for token in outcome.path[row, :n].tolist() + [nxt]:
                self.outputs[row].append(token)
                self.histories[row].append(token)
                if self.stopped(self.outputs[row]):
                    self.done[row] = True
                    break
            self.emit(row, self.outputs[row][before:])


def decode_prompts(target, prompts: list[list[int]], settings: DecodeSettings,
                   stop_token_ids: set[int], pad_id: int, draft: Draft | None = None,
                   generator: torch.Generator | None = None, decode=None) -> Generation:
    """generate over token-id prompts in batches of settings.batch_size, left-padded, one
    generator across the batches (a seeded run repeats) -> one Generation, prompts in order."""
    device = next(target.parameters()).device
    whole = Generation([], [], 0.0, 0.0, [])
    for b in range(0, len(prompts), settings.batch_size):
        ids, mask = left_pad(prompts[b : b + settings.batch_size], pad_id, device)
        gen = generate(target, ids, mask, settings, stop_token_ids, draft, generator, decode)
        whole.tokens += gen.tokens
        whole.stats += gen.stats
        whole.draft_seconds += gen.draft_seconds
        whole.verify_seconds += gen.verify_seconds
        whole.k_used += gen.k_used
    return whole
