"""The speculative decoding loop: propose k with the draft, verify in one target forward, accept
with min(1, p/q), resample from max(p - q, 0) at a rejection, bonus token when all k pass.

Without a draft the same loop is plain target decoding (k = 0: every step emits the bonus token).
Batches of any size: rows accept different numbers of tokens, their caches keep holes instead
of being cropped (decoding/kv.py). The settings are recipe.DecodeSettings; the draft is anything
that implements Draft (drafts/ holds every kind).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from decoding.kv import CachedLM
from decoding.speculative import sampling_probs, verify
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
               target_hidden=None) -> None:
        """The verification outcome: accepted draft tokens [B] and the token emitted after them;
        target_hidden covers the verified chunk [pending, d_1..d_k]."""


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
    draft_failures: int = 0
    """1 when the draft produced non-finite logits and the request fell back to plain decoding."""

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
             generator: torch.Generator | None = None, decode=None) -> Generation:
    """Decode left-padded prompts [B, T] with the target, speculatively when a draft is given.

    decode (token ids -> text) is needed only for settings.stop_strings."""
    if settings.stop_strings and decode is None:
        raise ValueError("stop_strings need a decode function (the tokenizer's decode).")
    tail = max((len(s) for s in settings.stop_strings), default=0) + 2  # tokens to re-decode

    def stopped(tokens: list[int]) -> bool:
        if tokens[-1] in stop_token_ids or len(tokens) >= settings.max_new_tokens:
            return True
        return bool(settings.stop_strings) and any(
            s in decode(tokens[-tail:]) for s in settings.stop_strings)

    batch = input_ids.shape[0]
    # head drafts (Medusa, EAGLE) read the target's hidden states of each verification
    uses_hidden = draft is not None and getattr(draft, "uses_target_hidden", False)
    target_lm = CachedLM(target, keep_hidden_states=uses_hidden)

    def probs(logits):  # [..., V] -> [..., V], the same filters for target and draft
        return sampling_probs(logits, settings.temperature, settings.top_p, settings.top_k)

    start = time.perf_counter()
    first = torch.multinomial(probs(target_lm.prefill(input_ids, attention_mask)), 1,
                              generator=generator)[:, 0]  # [B]
    verify_seconds = time.perf_counter() - start
    draft_seconds = 0.0
    histories = [row[mask.bool()].tolist() + [t] for row, mask, t in
                 zip(input_ids, attention_mask, first.tolist())]
    outputs = [[t] for t in first.tolist()]
    done = [stopped(o) for o in outputs]
    k_max = settings.k_max if settings.adaptive_k else settings.k
    stats = [RequestStats(drafted_per_position=[0] * k_max, accepted_per_position=[0] * k_max)
             for _ in range(batch)]
    if draft is not None:
        start = time.perf_counter()
        draft.start(input_ids, attention_mask, first, target_lm.hidden_states)
        draft_seconds += time.perf_counter() - start

    pending, k, k_used = first, settings.k if draft is not None else 0, []
    while not all(done):
        start = time.perf_counter()
        if draft is not None:
            draft_tokens, draft_probs = draft.propose(k, settings, histories, generator)  # [B,k], [B,k,V]
        else:
            draft_tokens = pending.new_empty(batch, 0)
            draft_probs = None
        draft_seconds += time.perf_counter() - start

        start = time.perf_counter()
        chunk = torch.cat([pending[:, None], draft_tokens], dim=1)  # [B, k+1]
        target_probs = probs(target_lm.extend(chunk, torch.ones_like(chunk, dtype=torch.bool)))
        if draft_probs is None:
            draft_probs = target_probs[:, :0]
        result = verify(draft_tokens, draft_probs, target_probs, generator)
        target_lm.reject_last(k - result.num_accepted)
        verify_seconds += time.perf_counter() - start
        if draft is not None:
            start = time.perf_counter()
            draft.accept(result.num_accepted, result.next_token, target_lm.hidden_states)
            draft_seconds += time.perf_counter() - start

        k_used.append(k)
        accepted_rows = result.num_accepted.tolist()
        for row, (n, nxt) in enumerate(zip(accepted_rows, result.next_token.tolist())):
            if done[row]:
                continue
            s = stats[row]
            s.steps += 1
            s.drafted += k
            s.accepted += n
            for position in range(k):
                s.drafted_per_position[position] += 1
                s.accepted_per_position[position] += position < n
            if draft is not None and getattr(draft, "failures", None) is not None:
                s.draft_failures = int(draft.failures[row])
            for token in draft_tokens[row, :n].tolist() + [nxt]:
                outputs[row].append(token)
                histories[row].append(token)
                if stopped(outputs[row]):
                    done[row] = True
                    break
        pending = result.next_token
        if settings.adaptive_k and draft is not None:
            active = [n for n, d in zip(accepted_rows, done) if not d] or accepted_rows
            k = min(k + 2, settings.k_max) if min(active) == k else max(k - 1, 1)
    return Generation(outputs, stats, draft_seconds, verify_seconds, k_used)
