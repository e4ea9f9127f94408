"""One speculative step, three ways: a chain (or plain decoding without a draft), a static tree
(the draft's chain with its ranked alternatives, a fixed shape of ranks, the n-gram branch),
or a dynamic EAGLE-2 tree the draft expands. decoding.engine.generate picks one before its loop
(make_step) and calls propose -> verify -> accept on it every step.

A step leaves the target's cache holding exactly the accepted tokens, and tells the draft
what was accepted (accept), the path when it may leave the draft's own chain.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from decoding.kv import CachedLM
from decoding.ngram import ngram_continuation
from decoding.speculative import verify
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


@dataclass
class Proposal:
    """What a step will verify."""

    chain: torch.Tensor
    """[B, k] the draft's tokens ([B, 0] without a draft)."""
    probs: torch.Tensor | None
    """[B, k, V] the q each chain token was sampled from; None: fixed candidates."""
    tree: Tree | None = None
    dropped: list[int] | None = None
    """Per row: candidates a dynamic tree dropped as non-finite (counted as fallbacks)."""
    k: int | None = None
    """The draft tokens this step verifies when fewer than drafted (adaptive verification);
    None: the k drafted."""


@dataclass
class Outcome:
    """What a step's verification accepted."""

    num_accepted: torch.Tensor  # [B]
    next_token: torch.Tensor  # [B] the replacement at the first rejection, or the bonus token
    path: torch.Tensor
    """[B, k] the accepted tokens (first num_accepted of each row)."""
    hidden: tuple | None
    """The target's hidden states over [pending, path_1..path_k] when it keeps them."""
    drafted: list[int]
    """Per row: the draft tokens verified (k for a chain, the tree's nodes for a tree)."""
    alternative: list[int] | None = None
    """Per row: accepted tokens that were the draft's alternatives, not its chain (trees)."""
    ngram: list[int] | None = None
    """Per row: accepted tokens that only the n-gram branch proposed (trees)."""
    fallbacks: list[int] | None = None
    """Per row: non-finite draft distributions tested as point masses instead (tree steps)."""


class ChainStep:
    """Propose k with the draft (none without one), verify [pending, d_1..d_k] in one target
    forward, accept with min(1, p/q), resample from max(p - q, 0), bonus token when all pass."""

    def __init__(self, target_lm: CachedLM, draft, probs, drafting: DecodeSettings, generator):
        self.target_lm, self.draft, self.probs = target_lm, draft, probs
        self.drafting, self.generator = drafting, generator

    def propose(self, pending: torch.Tensor, k: int, histories: list[list[int]]) -> Proposal:
        if self.draft is None:
            return Proposal(pending.new_empty(len(pending), 0), None)
        chain, probs = self.draft.propose(k, self.drafting, histories, self.generator)
        if self.drafting.confidence_min > 0:  # adaptive verification (make_step checked it)
            n = confident_prefix(self.draft.confidence, self.drafting.confidence_min)
            if n < k:
                self.draft.truncate(n)
                return Proposal(chain[:, :n], probs[:, :n], k=n)
        return Proposal(chain, probs)

    def verify(self, pending: torch.Tensor, k: int, proposal: Proposal) -> Outcome:
        chunk = torch.cat([pending[:, None], proposal.chain], dim=1)  # [B, k+1]
        target_probs = self.probs(self.target_lm.extend(chunk, torch.ones_like(chunk,
                                                                               dtype=torch.bool)))
        draft_probs = target_probs[:, :0] if proposal.probs is None else proposal.probs
        result = verify(proposal.chain, draft_probs, target_probs, self.generator)
        self.target_lm.reject_last(k - result.num_accepted)
        return Outcome(result.num_accepted, result.next_token, proposal.chain,
                       self.target_lm.hidden_states, [k] * len(pending))

    def accept(self, outcome: Outcome) -> None:
        if self.draft is not None:  # kinds written for chains alone take three arguments
            self.draft.accept(outcome.num_accepted, outcome.next_token, outcome.hidden)


class TreeStep(ChainStep):
    """A static tree per row: the draft's chain, its settings.tree_width likeliest alternatives
    per position (or the ranks of settings.tree_paths) and the n-gram branch, verified in one
    target forward with a tree mask, accepted by the lossless walk of decoding/tree.py."""

    def __init__(self, target_lm: CachedLM, draft, probs, drafting: DecodeSettings, generator,
                 settings: DecodeSettings):
        super().__init__(target_lm, draft, probs, drafting, generator)
        self.settings = settings

    def ngrams(self, histories: list[list[int]], k: int) -> list[list[int]] | None:
        if not self.settings.ngram_branch:
            return None
        return [ngram_continuation(h, k) for h in histories]

    def propose(self, pending: torch.Tensor, k: int, histories: list[list[int]]) -> Proposal:
        ngrams = self.ngrams(histories, k)
        chain, probs = self.draft.propose(k, self.drafting, histories, self.generator)
        tree = build_tree(pending, chain, alternatives(self.draft, chain, self.settings), ngrams,
                          [tuple(p) for p in self.settings.tree_paths] or None)
        return Proposal(chain, probs, tree)

    def verify(self, pending: torch.Tensor, k: int, proposal: Proposal) -> Outcome:
        tree, lm = proposal.tree, self.target_lm
        target_probs = self.probs(lm.extend_tree(tree.tokens, tree.depth,
                                                 ancestor_mask(tree.parents), tree.valid))
        result = verify_tree(tree, proposal.probs, target_probs, self.generator)
        batch, depth = result.path.shape
        path = torch.zeros(batch, k, dtype=torch.long, device=tree.tokens.device)
        path[:, :depth] = result.path.clamp(min=0)  # node 0 (the root) past the path
        on_path = torch.arange(k, device=path.device)[None] < result.num_accepted[:, None]
        nodes = torch.cat([torch.zeros_like(path[:, :1]), path], dim=1)  # [B, k+1]
        keep = torch.zeros_like(tree.valid)
        keep.scatter_(1, nodes, True)
        hidden = None
        if lm.hidden_states is not None:  # along [root, path_1..path_k], one [B, k+1, H] each
            index = nodes[:, :, None]
            hidden = tuple(h.gather(1, index.expand(-1, -1, h.shape[-1]))
                           for h in lm.hidden_states)
        lm.keep_nodes(keep)
        dropped = proposal.dropped or [0] * batch
        sources = torch.where(on_path, tree.source.gather(1, path), -1)  # [B, k]
        return Outcome(result.num_accepted, result.next_token,
                       torch.where(on_path, tree.tokens.gather(1, path), 0), hidden,
                       (tree.valid.sum(1) - 1).tolist(), (sources == ALTERNATIVE).sum(1).tolist(),
                       (sources == NGRAM).sum(1).tolist(),
                       [int(f) + d for f, d in zip(result.fallbacks.tolist(), dropped)])

    def accept(self, outcome: Outcome) -> None:
        # the path: the accepted tokens may leave the draft's chain (an alternative, n-grams)
        self.draft.accept(outcome.num_accepted, outcome.next_token, outcome.hidden,
                          path=outcome.path)


class DynamicTreeStep(TreeStep):
    """EAGLE-2's tree: the draft expands settings.tree_width candidates per node to depth k and
    the settings.tree_nodes likeliest (cumulative log-probability) are verified, every node a
    fixed candidate (tested as a point mass)."""

    def propose(self, pending: torch.Tensor, k: int, histories: list[list[int]]) -> Proposal:
        ngrams = self.ngrams(histories, k)
        tokens, parents, scores = self.draft.propose_tree(k, self.settings.tree_width,
                                                          self.generator)
        # NaN candidates are dropped from the tree (counted as fallbacks), and so are theirs
        dropped = torch.isnan(scores).sum(1).tolist()  # [B]
        tree = dynamic_tree(pending, tokens, parents, scores.nan_to_num(nan=float("-inf")),
                            self.settings.tree_nodes, ngrams, k)
        return Proposal(pending.new_empty(len(pending), 0), None, tree, dropped)


def confident_prefix(confidence: torch.Tensor, minimum: float) -> int:
    """Adaptive verification: each row's drafted tokens up to the first whose estimated
    acceptance is below minimum; confidence [B, k] -> the longest such run of any row (a batch
    verifies one chunk length; the rows wanting fewer verify the extra tokens losslessly)."""
    below = confidence < minimum  # [B, k]
    first_below = torch.where(below.any(1), below.int().argmax(1), below.shape[1])  # [B]
    return int(first_below.max()) if len(first_below) else 0


def make_step(settings: DecodeSettings, target_lm: CachedLM, draft, probs,
              generator) -> ChainStep:
    """The step settings ask for, given what the draft can do (a kind without propose_tree
    grows the default tree shape instead of a dynamic one)."""
    drafting = drafting_settings(settings)
    if settings.confidence_min > 0 and draft is not None:
        if not hasattr(draft, "truncate"):
            raise ValueError(f"confidence_min={settings.confidence_min}: the draft {draft.name!r} "
                             "has no confidence head to verify by; set confidence_min=0, or "
                             "draft with a DSpark drafter.")
        if settings.tree or settings.ngram_branch:
            raise ValueError("confidence_min verifies a prefix of a chain: set it to 0 for "
                             "tree and hybrid steps.")
    if draft is None or not (settings.tree or settings.ngram_branch):
        return ChainStep(target_lm, draft, probs, drafting, generator)
    if settings.tree and settings.tree_nodes > 0 and draft.propose_tree is not None:
        return DynamicTreeStep(target_lm, draft, probs, drafting, generator, settings)
    return TreeStep(target_lm, draft, probs, drafting, generator, settings)


def drafting_settings(settings: DecodeSettings) -> DecodeSettings:
    """What the draft samples at: the target's settings, or its own temperature (0: argmax,
    a one-hot q) and top_k."""
    if settings.temperature > 0 and settings.draft_temperature == 0:
        return replace(settings, temperature=0.0, top_p=1.0, top_k=0)
    if settings.temperature > 0:
        own = {} if settings.draft_top_k is None else {"top_k": settings.draft_top_k}
        return replace(settings, temperature=settings.draft_temperature
                       or settings.temperature, **own)
    return settings


def alternatives(draft, chain: torch.Tensor, settings: DecodeSettings) -> torch.Tensor | None:
    """The draft's settings.tree_width likeliest tokens at each position other than the chain's
    [B, k] -> [B, k, w], or None when the tree has no alternatives (settings.tree off, or a draft
    that ranks none)."""
    if not settings.tree:
        return None
    scores = draft.scores
    if scores is None:
        return None
    width = settings.tree_width
    ranked = scores.float().nan_to_num(nan=float("-inf")).topk(width + 1, dim=-1).indices
    order = torch.argsort((ranked == chain[..., None]).long(), dim=-1, stable=True)
    return ranked.gather(-1, order)[..., :width]  # the chain's token, if ranked, moved out
