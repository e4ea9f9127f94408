"""Speculation trees as pure functions: build a token tree per row, its attention mask, and the
lossless walk that accepts the longest verified path.

A tree holds the pending token as its root (node 0) and draft candidates below it; each node's
parent comes before it (topological order). One target forward over all nodes, each node seeing
exactly its ancestors, gives the target's distribution p after every node.

Verification walks from the root (recursive rejection sampling, SpecInfer / SpecTr): at a node
with target distribution r = p(node), its children are tested in order; child x proposed from q
is accepted with probability min(1, r(x) / q(x)); if rejected, r <- normalize(max(r - q, 0)) and
the next child is tested. A child that is a fixed candidate (an alternative of the draft's, an
n-gram match) has q = a point mass on it: accepted with probability r(x), else r loses x. When no
child is accepted the replacement is sampled from r; at a leaf the bonus token from p(leaf). Each
test is a valid rejection step of r given what was rejected before, so the emitted token is
distributed exactly as r's start, the target's p: the output distribution is the target's. At
temperature 0 every distribution is one-hot and the walk accepts the child equal to the target's
argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decoding.speculative import residual_distribution

ROOT, DRAFT, ALTERNATIVE, NGRAM = 0, 1, 2, 3
"""Where a node came from (Tree.source)."""


@dataclass
class Tree:
    """B token trees padded to N nodes; node 0 of each row is the root (the pending token)."""

    tokens: torch.Tensor  # [B, N] long
    parents: torch.Tensor  # [B, N] long: -1 for the root and for padding
    depth: torch.Tensor  # [B, N] long: 0 for the root
    valid: torch.Tensor  # [B, N] bool: False for padding
    source: torch.Tensor  # [B, N] long: ROOT, DRAFT, ALTERNATIVE or NGRAM
    proposal: torch.Tensor
    """[B, N] long: j >= 0: the token was sampled from the draft's q at draft position j
    (0-based); -1: a fixed candidate (q is a point mass on it)."""

    @property
    def size(self) -> int:
        return self.tokens.shape[1]


def default_paths(k: int, width: int) -> list[tuple[int, ...]]:
    """The tree shape used without a static one: the chain (rank 0 at every depth) and, below
    each chain node and the root, the next position's width alternatives (ranks 1..width)."""
    chain = [(0,) * depth for depth in range(1, k + 1)]
    return chain + [(0,) * depth + (rank,) for depth in range(k) for rank in range(1, width + 1)]


def build_tree(pending: torch.Tensor, chain: torch.Tensor, alternatives: torch.Tensor | None,
               ngrams: list[list[int]] | None = None,
               paths: list[tuple[int, ...]] | None = None) -> Tree:
    """One tree per row from the draft's chain and its alternatives, merged as a trie.

    pending [B], chain [B, k] (the draft's proposal, sampled from its q), alternatives
    [B, k, m] or None (the draft's m likeliest tokens at each position besides the chain's, its
    own order). paths (a static tree, recipe.DecodeSettings.tree_paths; default:
    default_paths(k, m)) place them: the node of path (r_1..r_d) holds the depth-d candidate of
    rank r_d (rank 0: chain[d-1], sampled from q; rank r: alternatives[d-1, r-1], a fixed
    candidate) below the node of (r_1..r_{d-1}). Paths deeper than k or with ranks the draft
    did not rank are left out; a node is tested before its later siblings in (depth, ranks)
    order, the chain first. ngrams: per row up to k tokens continuing the pending token (an
    n-gram match), inserted as one more branch from the root. A candidate equal to an existing
    child is that child.
    """
    batch, k = chain.shape
    width = 0 if alternatives is None else alternatives.shape[-1]
    shape = default_paths(k, width) if paths is None else sorted(
        (tuple(p) for p in paths if len(p) <= k and max(p) <= width), key=lambda p: (len(p), p))
    tries = []
    for b in range(batch):
        trie, nodes = _Trie(int(pending[b])), {(): 0}
        row_chain = chain[b].tolist()
        row_alternatives = alternatives[b].tolist() if alternatives is not None else None
        for path in shape:  # sorted by depth: a path's parent is placed before it
            j, rank = len(path) - 1, path[-1]
            if not any(path):  # the chain: sampled from q at position j
                nodes[path] = trie.add(nodes[path[:-1]], row_chain[j], DRAFT, j)
            else:  # a rank-0 token off the chain is fixed too: its q saw the chain's prefix
                nodes[path] = trie.add(nodes[path[:-1]], row_chain[j] if rank == 0 else
                                       row_alternatives[j][rank - 1], ALTERNATIVE, -1)
        trie.add_branch((ngrams[b] if ngrams else [])[:k])
        tries.append(trie)
    return _stack(tries, chain.device)


def grow_tree(root_logp: torch.Tensor, k: int, width: int, expand):
    """EAGLE-2's expansion, for any draft: the root's `width` likeliest tokens, then at each
    depth up to k the `width` best new nodes by cumulative log-probability are expanded (one
    draft forward over them) into their `width` likeliest tokens.

    root_logp [B, V] the draft's log-probabilities after the pending token; expand(frontier
    [B, w], tokens [B, M], parents [B, M]) -> [B, w, V] the log-probabilities after each
    frontier candidate (the draft attends to its ancestors). -> candidates (tokens, parents,
    scores) [B, M], M = width + (k - 1) * width^2, in expansion order, for dynamic_tree
    (parents index M, -1: the root; scores the cumulative log-probabilities)."""
    batch = root_logp.shape[0]
    scores, tokens = root_logp.float().topk(width, dim=-1)  # [B, w]
    parents = torch.full_like(tokens, -1)
    frontier = torch.arange(width, device=tokens.device).expand(batch, -1)  # [B, w]
    for _ in range(2, k + 1):
        logp, children = expand(frontier, tokens, parents).float().topk(width, dim=-1)  # [B,w,w]
        child_scores = (scores.gather(1, frontier)[..., None] + logp).flatten(1)  # [B, w^2]
        base = tokens.shape[1]
        tokens = torch.cat([tokens, children.flatten(1)], dim=1)
        parents = torch.cat([parents, frontier.repeat_interleave(width, dim=1)], dim=1)
        scores = torch.cat([scores, child_scores], dim=1)
        frontier = base + child_scores.topk(width, dim=-1).indices  # [B, w]
    return tokens, parents, scores


def dynamic_tree(pending: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                 scores: torch.Tensor, size: int, ngrams: list[list[int]] | None = None,
                 max_depth: int | None = None) -> Tree:
    """EAGLE-2's tree: of the draft's expanded candidates, the `size` with the highest
    cumulative log-probability, every node a fixed candidate (tested as a point mass).

    pending [B]; tokens, parents, scores [B, M]: candidate m is token tokens[m] below candidate
    parents[m] (-1: the root), its score the draft's log-probability of the whole path to it
    (-inf: no candidate); parents come before their children, siblings in the draft's rank
    order. A path's score never exceeds its parent's, so the best `size` (ties: the earlier)
    keep their ancestors. The first child of the root, of that child, and so on (the draft's
    greedy chain) counts as DRAFT, the others as ALTERNATIVE. ngrams: as in build_tree (up to
    max_depth tokens).
    """
    batch, _ = tokens.shape
    order = torch.argsort(-scores.float(), dim=1, stable=True)[:, :size]  # [B, size]
    tries = []
    for b in range(batch):
        keep = sorted(m for m in order[b].tolist() if scores[b, m] > float("-inf"))
        trie, nodes, greedy, parents_seen = _Trie(int(pending[b])), {-1: 0}, {0}, set()
        row_tokens, row_parents = tokens[b].tolist(), parents[b].tolist()
        for m in keep:
            parent = nodes.get(row_parents[m])
            if parent is None:  # its parent fell out of the tree (only after equal scores)
                continue
            first = parent in greedy and parent not in parents_seen
            parents_seen.add(parent)
            nodes[m] = trie.add(parent, row_tokens[m], DRAFT if first else ALTERNATIVE, -1)
            if first:
                greedy.add(nodes[m])
        trie.add_branch((ngrams[b] if ngrams else [])[:max_depth])
        tries.append(trie)
    return _stack(tries, tokens.device)


class _Trie:
    """One row's tree under construction, root first; a token added twice below the same
    parent is one node."""

    def __init__(self, root: int):
        self.tokens, self.parents, self.depth = [root], [-1], [0]
        self.source, self.proposal = [ROOT], [-1]
        self.children: dict[tuple[int, int], int] = {}

    def add(self, parent: int, token: int, kind: int, j: int) -> int:
        node = self.children.get((parent, token))
        if node is None:
            node = self.children[(parent, token)] = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(parent)
            self.depth.append(self.depth[parent] + 1)
            self.source.append(kind)
            self.proposal.append(j)
        return node

    def add_branch(self, tokens: list[int]) -> None:
        """An n-gram match as a branch from the root (merged where it follows existing nodes)."""
        node = 0
        for token in tokens:
            node = self.add(node, token, NGRAM, -1)


def _stack(tries: list[_Trie], device) -> Tree:
    """Rows padded to the largest tree."""
    size = max(len(t.tokens) for t in tries)

    def padded(name: str, fill: int) -> torch.Tensor:
        return torch.tensor([getattr(t, name) + [fill] * (size - len(t.tokens)) for t in tries],
                            dtype=torch.long, device=device)

    valid = torch.tensor([[i < len(t.tokens) for i in range(size)] for t in tries], device=device)
    return Tree(padded("tokens", 0), padded("parents", -1), padded("depth", 0), valid,
                padded("source", ROOT), padded("proposal", -1))


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """parents [B, N] (-1: none) -> [B, N, N] bool: node i sees node j iff j is i or one of its
    ancestors (the tree attention mask of the new nodes among themselves)."""
    batch, size = parents.shape
    seen = torch.eye(size, dtype=torch.bool, device=parents.device).repeat(batch, 1, 1)
    rows = torch.arange(batch, device=parents.device)[:, None]
    nodes = torch.arange(size, device=parents.device)[None, :].expand(batch, -1)
    current = parents  # [B, N] the ancestor reached so far, per node
    for _ in range(size - 1):
        has = current >= 0
        if not has.any():
            break
        seen[rows.expand(-1, size)[has], nodes[has], current[has]] = True
        current = torch.where(has, parents[rows, current.clamp(min=0)], current)
    return seen


@dataclass
class TreeVerification:
    num_accepted: torch.Tensor
    """[B] nodes accepted below the root (the accepted path's length)."""
    path: torch.Tensor
    """[B, D] node indices of the accepted path, in depth order; -1 past num_accepted
    (D: the tree's depth)."""
    next_token: torch.Tensor
    """[B] the token emitted after the path: the replacement at the first node whose children
    were all rejected, or the bonus token at a leaf."""
    fallbacks: torch.Tensor
    """[B] draft distributions that were not finite and were tested as point masses instead."""


def accept_child(u: torch.Tensor, r_x: torch.Tensor, q_x: torch.Tensor | None) -> bool:
    """Recursive rejection sampling's test for one child x, u ~ U(0, 1), r the residual target
    distribution at its parent: a token the draft sampled from q is kept with probability
    min(1, r(x) / q(x)); a fixed candidate (q a point mass at x) with probability r(x)."""
    return bool(u < r_x) if q_x is None else bool(u * q_x < r_x)


def verify_tree(tree: Tree, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                generator: torch.Generator | None = None) -> TreeVerification:
    """Walk each row's tree from the root (see the module docstring).

    draft_probs [B, k, V] (the q of each draft position, for nodes with proposal >= 0) or None;
    target_probs [B, N, V] (p after each node).
    """
    batch, size = tree.tokens.shape
    device = tree.tokens.device
    max_depth = int(tree.depth.max())
    path = torch.full((batch, max_depth), -1, dtype=torch.long, device=device)
    num_accepted = torch.zeros(batch, dtype=torch.long, device=device)
    next_token = torch.zeros(batch, dtype=torch.long, device=device)
    fallbacks = torch.zeros(batch, dtype=torch.long, device=device)
    parents, valid = tree.parents.tolist(), tree.valid.tolist()
    tokens, proposal = tree.tokens.tolist(), tree.proposal.tolist()
    for b in range(batch):
        children = [[] for _ in range(size)]
        for node in range(1, size):
            if valid[b][node]:
                children[parents[b][node]].append(node)
        node, accepted = 0, 0
        while True:
            r = target_probs[b, node]
            chosen = None
            for child in children[node]:
                x, j = tokens[b][child], proposal[b][child]
                u = torch.rand((), device=device, generator=generator)
                q = draft_probs[b, j] if j >= 0 else None
                if q is not None and not bool(torch.isfinite(q).all()):
                    q, fallbacks[b] = None, fallbacks[b] + 1
                if accept_child(u, r[x], None if q is None else q[x]):
                    chosen = child
                    break
                if q is None:
                    q = torch.zeros_like(r)
                    q[x] = 1.0  # a fixed candidate is a point mass
                r = residual_distribution(r, q)
            if chosen is None:
                next_token[b] = torch.multinomial(r, 1, generator=generator)[0]
                break
            path[b, accepted] = chosen
            accepted += 1
            node = chosen
        num_accepted[b] = accepted
    return TreeVerification(num_accepted, path, next_token, fallbacks)
