"""The speculative decoding loop: propose k with the draft, verify in one target forward, accept
with min(1, p/q), resample from max(p - q, 0) at a rejection, bonus token when all k pass.

With settings.tree (or ngram_branch) a step verifies a token tree instead: the draft's chain
with its ranked alternatives per position (or a static tree of ranks, settings.tree_paths, or
a dynamic EAGLE-2 tree the draft expands, settings.tree_nodes) and the n-gram match, in one
target forward with a tree mask, accepted by the lossless walk of decoding/tree.py
(tree_step).

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
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from decoding.kv import CachedLM
from decoding.ngram import ngram_continuation
from decoding.schedule import StepRecord, WindowScheduler, heuristic_k
from decoding.speculative import sampling_probs, verify
from decoding.tree import (
    ALTERNATIVE,
    NGRAM,
    Tree,
    ancestor_mask,
    build_tree,
    dynamic_tree,
    verify_tree,
)
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

    scores: torch.Tensor | None
    """Optional: [B, k, V] the unfiltered logits behind the last proposal, which rank the
    alternatives a tree adds at each position. A kind without it drafts chains in trees."""

    # Optional, for dynamic trees (settings.tree_nodes): propose_tree(k, width, generator) ->
    # candidates (tokens, parents, scores) [B, M] for decoding.tree.dynamic_tree, the draft's
    # own cache left as before (accept then receives the accepted path). Kinds without it use
    # the default tree shape.


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
    if settings.stop_strings and decode is None:
        raise ValueError("stop_strings need a decode function (the tokenizer's decode).")
    tail = max((len(s) for s in settings.stop_strings), default=0) + 2  # tokens to re-decode

    def stopped(tokens: list[int]) -> bool:
        if tokens[-1] in stop_token_ids or len(tokens) >= settings.max_new_tokens:
            return True
        return bool(settings.stop_strings) and any(
            s in decode(tokens[-tail:]) for s in settings.stop_strings)

    batch = input_ids.shape[0]
    context = getattr(getattr(target, "config", None), "max_position_embeddings", None)
    depth = 0 if draft is None else settings.k_max_used
    longest = int(attention_mask.sum(1).max())
    if context is not None and longest + settings.max_new_tokens + depth > context:
        raise ValueError(
            f"a prompt of {longest} tokens + max_new_tokens {settings.max_new_tokens} + "
            f"{depth} draft positions (a chain's or a tree's depth, k) exceed the target's "
            f"context of {context} positions: lower max_new_tokens or k, or shorten the prompt.")
    # head drafts (Medusa, EAGLE) read the target's hidden states of each verification
    uses_hidden = draft is not None and getattr(draft, "uses_target_hidden", False)
    target_lm = CachedLM(target, keep_hidden_states=uses_hidden)

    def probs(logits):  # [..., V] -> [..., V], the same filters for target and draft
        return sampling_probs(logits, settings.temperature, settings.top_p, settings.top_k)

    # what the draft samples at: the target's settings, or its own temperature (0: argmax)
    drafting = settings
    if settings.temperature > 0 and settings.draft_temperature == 0:
        drafting = replace(settings, temperature=0.0, top_p=1.0, top_k=0)
    elif settings.temperature > 0:
        own = {} if settings.draft_top_k is None else {"top_k": settings.draft_top_k}
        drafting = replace(settings, temperature=settings.draft_temperature
                           or settings.temperature, **own)

    start = time.perf_counter()
    first = torch.multinomial(probs(target_lm.prefill(input_ids, attention_mask)), 1,
                              generator=generator)[:, 0]  # [B]
    verify_seconds = time.perf_counter() - start
    draft_seconds = 0.0
    histories = [row[mask.bool()].tolist() + [t] for row, mask, t in
                 zip(input_ids, attention_mask, first.tolist())]
    outputs = [[t] for t in first.tolist()]
    done = [stopped(o) for o in outputs]
    k_max = settings.k_max_used
    stats = [RequestStats(drafted_per_position=[0] * k_max, accepted_per_position=[0] * k_max)
             for _ in range(batch)]

    def emit(row: int, tokens: list[int]) -> None:
        if on_tokens is not None and not on_tokens(row, tokens, done[row], stats[row]):
            done[row] = True

    for row in range(batch):
        emit(row, outputs[row][:])
    if draft is not None:
        start = time.perf_counter()
        draft.start(input_ids, attention_mask, first, target_lm.hidden_states)
        draft_seconds += time.perf_counter() - start

    pending, k, k_used = first, settings.k if draft is not None else 0, []
    tree_mode = draft is not None and (settings.tree or settings.ngram_branch)
    dynamic = tree_mode and settings.tree and settings.tree_nodes > 0 and hasattr(
        draft, "propose_tree")
    window = (WindowScheduler(settings.window_ms, settings.k_max)
              if settings.adaptive_k and settings.adaptive_policy == "window" else None)
    while not all(done):
        step_draft, step_verify = draft_seconds, verify_seconds
        active_rows = [row for row in range(batch) if not done[row]]
        start = time.perf_counter()
        ngrams = [ngram_continuation(h, k) for h in histories] if settings.ngram_branch else None
        if dynamic:
            tokens, parents, scores = draft.propose_tree(k, settings.tree_width, generator)
            # NaN candidates are dropped from the tree (counted as fallbacks), and so are theirs
            dropped = torch.isnan(scores).sum(1).tolist()  # [B]
            tree = dynamic_tree(pending, tokens, parents, scores.nan_to_num(nan=float("-inf")),
                                settings.tree_nodes, ngrams, k)
            draft_probs = None
        elif draft is not None:
            # [B, k], [B, k, V]
            draft_tokens, draft_probs = draft.propose(k, drafting, histories, generator)
            if tree_mode:
                tree = build_tree(pending, draft_tokens,
                                  alternatives(draft, draft_tokens, settings), ngrams,
                                  [tuple(p) for p in settings.tree_paths] or None)
        else:
            draft_tokens = pending.new_empty(batch, 0)
            draft_probs = None
        draft_seconds += time.perf_counter() - start

        start = time.perf_counter()
        if tree_mode:
            result = tree_step(target_lm, tree, k, draft_probs, probs, generator)
            hidden, path = result.hidden, result.path_tokens
        else:
            chunk = torch.cat([pending[:, None], draft_tokens], dim=1)  # [B, k+1]
            target_probs = probs(target_lm.extend(chunk, torch.ones_like(chunk, dtype=torch.bool)))
            if draft_probs is None:
                draft_probs = target_probs[:, :0]
            result = verify(draft_tokens, draft_probs, target_probs, generator)
            target_lm.reject_last(k - result.num_accepted)
            hidden, path = target_lm.hidden_states, draft_tokens
        verify_seconds += time.perf_counter() - start
        if draft is not None:
            start = time.perf_counter()
            # a path only when it may leave the draft's chain: kinds written for chains alone
            # keep their three-argument accept
            extra = {"path": path} if tree_mode else {}
            draft.accept(result.num_accepted, result.next_token, hidden, **extra)
            draft_seconds += time.perf_counter() - start

        k_used.append(k)
        accepted_rows = result.num_accepted.tolist()
        for row, (n, nxt) in enumerate(zip(accepted_rows, result.next_token.tolist())):
            if done[row]:
                continue
            s = stats[row]
            s.steps += 1
            s.drafted += int(tree.valid[row].sum()) - 1 if tree_mode else k
            s.accepted += n
            for position in range(k):
                s.drafted_per_position[position] += 1
                s.accepted_per_position[position] += position < n
            if draft is not None and getattr(draft, "failures", None) is not None:
                s.draft_failures = int(draft.failures[row])
            if tree_mode:
                sources = result.sources[row, :n]
                s.accepted_alternative += int((sources == ALTERNATIVE).sum())
                s.accepted_ngram += int((sources == NGRAM).sum())
                s.tree_fallbacks += int(result.fallbacks[row]) + (dropped[row] if dynamic else 0)
            before = len(outputs[row])
            for token in path[row, :n].tolist() + [nxt]:
                outputs[row].append(token)
                histories[row].append(token)
                if stopped(outputs[row]):
                    done[row] = True
                    break
            emit(row, outputs[row][before:])
        pending = result.next_token
        if window is not None and draft is not None:
            accepted = [accepted_rows[row] for row in active_rows]
            window.record(StepRecord(time.perf_counter(), len(active_rows),
                                     [sum(n > j for n in accepted) for j in range(k)],
                                     draft_seconds - step_draft, verify_seconds - step_verify))
            k = window.next_k(k)
        elif settings.adaptive_k and draft is not None:
            active = [n for n, d in zip(accepted_rows, done) if not d] or accepted_rows
            k = heuristic_k(k, active, settings.k_max)
    return Generation(outputs, stats, draft_seconds, verify_seconds, k_used)


def alternatives(draft, chain: torch.Tensor, settings: DecodeSettings) -> torch.Tensor | None:
    """The draft's settings.tree_width likeliest tokens at each position other than the chain's
    [B, k] -> [B, k, w], or None when the tree has no alternatives (settings.tree off, or a draft
    that ranks none)."""
    scores = getattr(draft, "scores", None)
    if not settings.tree or scores is None:
        return None
    width = settings.tree_width
    ranked = scores.float().nan_to_num(nan=float("-inf")).topk(width + 1, dim=-1).indices
    order = torch.argsort((ranked == chain[..., None]).long(), dim=-1, stable=True)
    return ranked.gather(-1, order)[..., :width]  # the chain's token, if ranked, moved out


@dataclass
class TreeStep:
    num_accepted: torch.Tensor  # [B]
    next_token: torch.Tensor  # [B]
    path_tokens: torch.Tensor
    """[B, k] the accepted tokens (first num_accepted of each row), zeros past them."""
    sources: torch.Tensor  # [B, k] decoding.tree source of each accepted node
    fallbacks: torch.Tensor  # [B]
    hidden: tuple | None
    """The target's hidden states along [root, path_1..path_k] (rows past the path: the
    root's), one [B, k+1, H] per layer; None unless the target keeps them."""


def tree_step(target_lm: CachedLM, tree: Tree, k: int, draft_probs, probs,
              generator) -> TreeStep:
    """Verify one tree per row (depth <= k) in one target forward (tree attention); the target's
    cache keeps exactly the root and the accepted path. draft_probs [B, k, V] or None (every
    node a fixed candidate)."""
    target_probs = probs(target_lm.extend_tree(tree.tokens, tree.depth,
                                               ancestor_mask(tree.parents), tree.valid))
    result = verify_tree(tree, draft_probs, target_probs, generator)
    batch, depth = result.path.shape
    path = torch.zeros(batch, k, dtype=torch.long, device=tree.tokens.device)
    path[:, :depth] = result.path.clamp(min=0)  # node 0 (the root) past the path
    on_path = torch.arange(k, device=path.device)[None] < result.num_accepted[:, None]
    nodes = torch.cat([torch.zeros_like(path[:, :1]), path], dim=1)  # [B, k+1]
    keep = torch.zeros_like(tree.valid)
    keep.scatter_(1, nodes, True)
    hidden = None
    if target_lm.hidden_states is not None:
        index = nodes[:, :, None]
        hidden = tuple(h.gather(1, index.expand(-1, -1, h.shape[-1]))
                       for h in target_lm.hidden_states)
    target_lm.keep_nodes(keep)
    return TreeStep(result.num_accepted, result.next_token,
                    torch.where(on_path, tree.tokens.gather(1, path), 0),
                    torch.where(on_path, tree.source.gather(1, path), 0), result.fallbacks,
                    hidden)
