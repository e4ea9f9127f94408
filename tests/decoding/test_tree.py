"""Speculation trees: the masks, the walk on hand-made trees, the cache after a tree step, and
greedy equality with trees (and hybrid n-gram branches) for every draft kind."""

import pytest
import torch

from decoding.engine import DecodeSettings, generate
from decoding.kv import CachedLM
from decoding.tree import (
    ALTERNATIVE,
    DRAFT,
    NGRAM,
    ROOT,
    Tree,
    ancestor_mask,
    build_tree,
    default_paths,
    dynamic_tree,
    verify_tree,
)
from tests.decoding.test_engine import EOS, _drafts, _prompts, _reference, _tiny


@pytest.fixture(scope="module")
def target():
    return _tiny(0)


@pytest.fixture(scope="module")
def drafts(target):
    """Built once: fitting the Medusa heads is the slow part. Each run starts its draft anew."""
    return _drafts(target)


def _hand_tree():
    """root 0 -> 1 -> 2 -> 3 (a chain), 0 -> 4, 1 -> 5, 5 -> 6; one padding node (7)."""
    parents = torch.tensor([[-1, 0, 1, 2, 0, 1, 5, -1]])
    tokens = torch.tensor([[9, 10, 11, 12, 20, 21, 22, 0]])
    depth = torch.tensor([[0, 1, 2, 3, 1, 2, 3, 0]])
    valid = torch.tensor([[True] * 7 + [False]])
    source = torch.tensor([[ROOT, DRAFT, DRAFT, DRAFT, ALTERNATIVE, ALTERNATIVE, NGRAM, ROOT]])
    proposal = torch.tensor([[-1, 0, 1, 2, -1, -1, -1, -1]])
    return Tree(tokens, parents, depth, valid, source, proposal)


def test_each_node_sees_exactly_its_ancestors():
    seen = ancestor_mask(_hand_tree().parents)[0]
    expected = {0: {0}, 1: {0, 1}, 2: {0, 1, 2}, 3: {0, 1, 2, 3}, 4: {0, 4}, 5: {0, 1, 5},
                6: {0, 1, 5, 6}, 7: {7}}
    for node, ancestors in expected.items():
        assert set(seen[node].nonzero()[:, 0].tolist()) == ancestors, node


def test_build_tree_merges_candidates_into_a_trie():
    chain = torch.tensor([[5, 6, 7]])
    alternatives = torch.tensor([[[8, 9], [6, 10], [11, 12]]])  # 6 below node 5: a new node
    tree = build_tree(torch.tensor([4]), chain, alternatives, ngrams=[[5, 6, 13]])
    nodes = {i: (int(tree.tokens[0, i]), int(tree.parents[0, i]), int(tree.source[0, i]))
             for i in range(tree.size) if tree.valid[0, i]}
    assert nodes[0] == (4, -1, ROOT)
    assert [nodes[i] for i in (1, 2, 3)] == [(5, 0, DRAFT), (6, 1, DRAFT), (7, 2, DRAFT)]
    assert (8, 0, ALTERNATIVE) in nodes.values() and (9, 0, ALTERNATIVE) in nodes.values()
    assert (10, 1, ALTERNATIVE) in nodes.values()
    # depth 2's alternative 6 is the chain's own node 2: merged, not repeated
    assert sum(1 for t, p, _ in nodes.values() if (t, p) == (6, 1)) == 1
    # the n-gram branch 5, 6 follows the chain, then leaves it with 13 below node 2
    assert (13, 2, NGRAM) in nodes.values()
    assert len(nodes) == 1 + 3 + 2 + 1 + 2 + 1
    assert tree.proposal[0, 1:4].tolist() == [0, 1, 2]
    assert all(int(tree.parents[0, i]) < i for i in range(1, len(nodes)))  # parents first


def _nodes_by_path(tree: Tree, row: int = 0) -> dict[tuple[int, ...], tuple[int, int]]:
    """Each valid node as its token path from the root -> (node index, source)."""
    found = {}
    for node in range(1, tree.size):
        if tree.valid[row, node]:
            tokens, at = [], node
            while at > 0:
                tokens.append(int(tree.tokens[row, at]))
                at = int(tree.parents[row, at])
            found[tuple(reversed(tokens))] = (node, int(tree.source[row, node]))
    return found


def test_a_static_tree_places_ranks_by_path():
    chain = torch.tensor([[5, 6, 7]])
    alternatives = torch.tensor([[[8, 9], [10, 11], [12, 13]]])
    paths = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (1, 2), (0, 0, 0)]
    tree = build_tree(torch.tensor([4]), chain, alternatives, paths=paths)
    nodes = _nodes_by_path(tree)
    assert set(nodes) == {(5,), (8,), (9,), (5, 6), (5, 10), (8, 6), (8, 11), (5, 6, 7)}
    # the chain is sampled from q (DRAFT, its position); a rank-0 token off the chain is a fixed
    # candidate (its q was conditioned on the chain's prefix, not on 8)
    assert nodes[(5, 6, 7)][1] == DRAFT and nodes[(8, 6)][1] == ALTERNATIVE
    assert tree.proposal[0, nodes[(5, 6)][0]] == 1 and tree.proposal[0, nodes[(8, 6)][0]] == -1
    assert all(int(tree.parents[0, i]) < i for i in range(1, tree.size))
    # the chain comes first among siblings, then ranks in order: tested in that order
    assert nodes[(5,)][0] < nodes[(8,)][0] < nodes[(9,)][0]
    # paths deeper than k, or naming ranks the draft did not rank, are left out
    short = build_tree(torch.tensor([4]), chain[:, :2], alternatives[:, :2, :1], paths=paths)
    assert set(_nodes_by_path(short)) == {(5,), (8,), (5, 6), (5, 10), (8, 6)}
    chain_only = build_tree(torch.tensor([4]), chain, None, paths=paths)
    assert set(_nodes_by_path(chain_only)) == {(5,), (5, 6), (5, 6, 7)}


def test_the_default_shape_is_the_chain_with_its_alternatives():
    chain = torch.tensor([[5, 6, 7]])
    alternatives = torch.tensor([[[8, 9], [10, 11], [12, 13]]])
    default = build_tree(torch.tensor([4]), chain, alternatives)
    explicit = build_tree(torch.tensor([4]), chain, alternatives, paths=default_paths(3, 2))
    assert _nodes_by_path(default).keys() == _nodes_by_path(explicit).keys()
    assert {p: n[1] for p, n in _nodes_by_path(default).items()} == {
        p: n[1] for p, n in _nodes_by_path(explicit).items()}
    assert len(default_paths(3, 2)) == 3 + 3 * 2


def test_a_dynamic_tree_keeps_the_best_paths_by_cumulative_score():
    inf = float("-inf")
    # candidates: root -> 5 (-0.1), 6 (-1.0); 5 -> 7 (-0.3), 8 (-2.0); 6 -> 9 (-1.2); 7 -> 10
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    parents = torch.tensor([[-1, -1, 0, 0, 1, 2, 2]])
    scores = torch.tensor([[-0.1, -1.0, -0.3, -2.0, -1.2, -0.5, inf]])
    tree = dynamic_tree(torch.tensor([4]), tokens, parents, scores, size=4)
    nodes = _nodes_by_path(tree)
    assert set(nodes) == {(5,), (6,), (5, 7), (5, 7, 10)}  # 9 (-1.2) and 8 (-2.0) left out
    assert [nodes[p][1] for p in [(5,), (5, 7), (5, 7, 10), (6,)]] == [
        DRAFT, DRAFT, DRAFT, ALTERNATIVE]  # the draft's greedy path, then the rest
    assert (tree.proposal[0, 1:] == -1).all()  # fixed candidates: lossless at any temperature
    hybrid = dynamic_tree(torch.tensor([4]), tokens, parents, scores, size=4,
                          ngrams=[[5, 12, 13, 14]], max_depth=3)
    assert set(_nodes_by_path(hybrid)) - set(nodes) == {(5, 12), (5, 12, 13)}


def candidate_path(tokens: torch.Tensor, parents: torch.Tensor, row: int, m: int) -> list[int]:
    """A dynamic tree candidate's tokens from the root's child down to candidate m."""
    path = []
    while m >= 0:
        path.append(int(tokens[row, m]))
        m = int(parents[row, m])
    return path[::-1]


def _one_hot_targets(tree: Tree, argmax: dict[int, int], vocab: int = 32):
    p = torch.zeros(1, tree.size, vocab)
    for node in range(tree.size):
        p[0, node, argmax.get(node, 0)] = 1.0
    return p


def test_greedy_walk_follows_the_targets_argmax_through_an_alternative():
    tree = _hand_tree()
    draft_probs = torch.nn.functional.one_hot(torch.tensor([[10, 11, 12]]), 32).float()
    # the target wants 10 (node 1), then 21 (alternative node 5), then 22 (n-gram node 6), then 3
    p = _one_hot_targets(tree, {0: 10, 1: 21, 5: 22, 6: 3})
    result = verify_tree(tree, draft_probs, p)
    assert result.num_accepted.tolist() == [3]
    assert result.path[0].tolist() == [1, 5, 6]
    assert result.next_token.tolist() == [3]
    # the target wants 15 at the root: nothing accepted, 15 emitted
    result = verify_tree(tree, draft_probs, _one_hot_targets(tree, {0: 15}))
    assert result.num_accepted.tolist() == [0] and result.next_token.tolist() == [15]
    # the whole chain: the bonus token comes from the leaf
    result = verify_tree(tree, draft_probs, _one_hot_targets(tree, {0: 10, 1: 11, 2: 12, 3: 7}))
    assert result.path[0].tolist() == [1, 2, 3] and result.next_token.tolist() == [7]


def test_non_finite_draft_probabilities_fall_back_and_are_counted():
    tree = _hand_tree()
    draft_probs = torch.full((1, 3, 32), float("nan"))
    result = verify_tree(tree, draft_probs, _one_hot_targets(tree, {0: 10, 1: 11, 2: 5}))
    assert result.path[0, :2].tolist() == [1, 2] and result.next_token.tolist() == [5]
    assert result.fallbacks.tolist() == [3]  # nodes 1, 2, 3 were tested as point masses


def _first_token_p_value(rows: int = 6000) -> float:
    """Many copies of one node with a child sampled from q, a fixed alternative and an n-gram
    child: the chi-square p-value of the emitted first token against p."""
    vocab = 6
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.05, 0.4, 0.1, 0.2, 0.15, 0.1])
    q = torch.tensor([0.5, 0.1, 0.1, 0.1, 0.1, 0.1])
    chain = torch.multinomial(q.expand(rows, -1), 1, generator=g)  # [rows, 1] sampled from q
    tree = build_tree(torch.zeros(rows, dtype=torch.long), chain,
                      torch.tensor([[[3]]]).expand(rows, 1, 1), ngrams=[[4]] * rows)
    result = verify_tree(tree, q.expand(rows, 1, -1), p.expand(rows, tree.size, -1),
                         generator=g)
    first = torch.where(result.num_accepted > 0,
                        tree.tokens.gather(1, result.path[:, :1].clamp(min=0))[:, 0],
                        result.next_token)
    observed = torch.bincount(first, minlength=vocab).double()
    expected = p.double() * rows
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    return float(torch.special.gammaincc(torch.tensor((vocab - 1) / 2.0), torch.tensor(chi2 / 2)))


def test_the_walk_samples_the_targets_distribution_at_a_node(monkeypatch):
    assert _first_token_p_value() > 1e-3
    # a wrong rule fails the same test: not removing a rejected candidate's mass
    import decoding.tree

    monkeypatch.setattr(decoding.tree, "residual_distribution", lambda r, q: r)
    assert _first_token_p_value() < 1e-6


def test_the_cache_keeps_exactly_the_accepted_path_at_batch_2(target):
    """After a tree step the cache equals the cache of the accepted tokens alone: the next
    forward's logits match a fresh prefill of prompt + path, per row."""
    prompts, ids, mask = _prompts([5, 9])
    lm = CachedLM(target)
    lm.prefill(ids, mask)
    tree = _hand_tree()
    tree = Tree(*(x.expand(2, -1).clone() for x in (tree.tokens, tree.parents, tree.depth,
                                                     tree.valid, tree.source, tree.proposal)))
    tree.tokens[1, 0] = 30  # row 1 has another root
    lm.extend_tree(tree.tokens, tree.depth, ancestor_mask(tree.parents), tree.valid)
    keep = torch.zeros(2, tree.size, dtype=torch.bool)
    keep[0, [0, 1, 5, 6]] = True  # row 0 accepted 10, 21, 22 (through an alternative)
    keep[1, [0, 4]] = True  # row 1 accepted 20
    lm.keep_nodes(keep)
    paths = [[9, 10, 21, 22], [30, 20]]
    assert lm.mask.shape[1] == ids.shape[1] + 4  # the slots no row kept are cut
    nxt = torch.tensor([[7], [8]])
    logits = lm.extend(nxt, torch.ones_like(nxt, dtype=torch.bool))[:, -1]
    for row in range(2):
        seq = torch.tensor([prompts[row] + paths[row] + [int(nxt[row])]])
        expected = target(seq).logits[0, -1]
        torch.testing.assert_close(logits[row], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("draft_name,mode", [
    ("other", "tree"), ("noisy copy", "tree"), ("nan", "tree"), ("fitted medusa", "tree"),
    ("random medusa", "tree"), ("noisy copy", "hybrid"), ("prompt lookup", "hybrid")])
def test_greedy_tree_speculation_equals_target_greedy_batched(target, drafts, draft_name, mode):
    prompts, ids, mask = _prompts([5, 17, 9])
    settings = DecodeSettings(max_new_tokens=40, k=4, tree=True, tree_width=3,
                              ngram_branch=mode == "hybrid")
    out = generate(target, ids, mask, settings, {EOS}, drafts[draft_name])
    for row, prompt in enumerate(prompts):
        assert out.tokens[row] == _reference(target, prompt, 40), f"row {row}"
    if draft_name in {"noisy copy", "fitted medusa", "other", "random medusa"}:
        assert sum(s.accepted_alternative for s in out.stats) > 0  # the tree was used
    if draft_name == "nan":
        assert all(s.draft_failures == 1 for s in out.stats)


@pytest.mark.parametrize("draft_name", ["fitted medusa", "noisy copy"])
def test_greedy_static_tree_speculation_equals_target_greedy(target, drafts, draft_name):
    prompts, ids, mask = _prompts([5, 17, 9])
    paths = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [2, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0],
             [0, 0, 0, 0]]
    settings = DecodeSettings(max_new_tokens=40, k=4, tree=True, tree_width=2, tree_paths=paths)
    out = generate(target, ids, mask, settings, {EOS}, drafts[draft_name])
    for row, prompt in enumerate(prompts):
        assert out.tokens[row] == _reference(target, prompt, 40), f"row {row}"
    assert sum(s.accepted_alternative for s in out.stats) > 0
    assert all(s.drafted == s.steps * len(paths) for s in out.stats)  # every node, every step


@pytest.mark.parametrize("paths,message", [
    ([[0], [0, 3]], "rank outside"),
    ([[0], [1, 0]], "has no parent"),
    ([[0], [0]], "twice"),
    ([[]], "empty path"),
    ([[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]], "depth 5 but k=4"),
])
def test_bad_static_trees_are_refused(paths, message):
    from recipe import ConfigError

    with pytest.raises(ConfigError, match=message):
        DecodeSettings(k=4, tree=True, tree_width=2, tree_paths=paths)
    with pytest.raises(ConfigError, match="no step verifies a tree"):
        DecodeSettings(k=4, tree_paths=[[0]])
    with pytest.raises(ConfigError, match="contradict"):
        DecodeSettings(k=4, tree=True, tree_nodes=8, tree_paths=[[0]])
    with pytest.raises(ConfigError, match="tree_nodes=300 must be in"):
        DecodeSettings(k=4, tree=True, tree_nodes=300)


@torch.no_grad()
def test_a_model_drafts_dynamic_tree_scores_every_path_as_its_own_forward(target, drafts):
    """Each candidate's cumulative log-probability equals the draft LM's on prompt + first
    token + the candidate's path, computed by one plain forward per row (the tree attention,
    positions and left padding of the expansion are right); the draft's cache is as before."""
    prompts, ids, mask = _prompts([5, 9])
    draft = drafts["noisy copy"]
    first = torch.tensor([7, 11])
    draft.start(ids, mask, first)
    tokens, parents, scores = draft.propose_tree(3, 3)
    cache_length = draft.lm.mask.shape[1]
    assert tokens.shape == (2, 3 + 2 * 9) and cache_length == ids.shape[1] + 2
    model = draft.lm.model
    for row in range(2):
        for m in range(tokens.shape[1]):
            path = candidate_path(tokens, parents, row, m)
            seq = torch.tensor([prompts[row] + [int(first[row])] + path])
            logp = torch.log_softmax(model(seq).logits[0].float(), -1)
            n = len(prompts[row])
            expected = sum(float(logp[n + i, t]) for i, t in enumerate(path))
            assert abs(expected - float(scores[row, m])) < 1e-4, (row, m, path)


@pytest.mark.parametrize("draft_name,hybrid", [("noisy copy", False), ("other", True)])
def test_greedy_dynamic_tree_with_a_model_draft_equals_target_greedy(target, drafts, draft_name,
                                                                     hybrid):
    prompts, ids, mask = _prompts([5, 17, 9])
    settings = DecodeSettings(max_new_tokens=40, k=4, tree=True, tree_width=3, tree_nodes=10,
                              ngram_branch=hybrid)
    out = generate(target, ids, mask, settings, {EOS}, drafts[draft_name])
    for row, prompt in enumerate(prompts):
        assert out.tokens[row] == _reference(target, prompt, 40), f"row {row}"
    assert sum(s.accepted for s in out.stats) > 0
    if draft_name == "noisy copy":
        assert sum(s.accepted_alternative for s in out.stats) > 0  # off the greedy path too


def test_a_tree_accepts_more_than_its_chain(target, drafts):
    _, ids, mask = _prompts([5, 17, 9])
    chain = generate(target, ids, mask, DecodeSettings(max_new_tokens=40, k=4), {EOS},
                     drafts["noisy copy"])
    tree = generate(target, ids, mask, DecodeSettings(max_new_tokens=40, k=4, tree=True),
                    {EOS}, drafts["noisy copy"])
    tau = lambda out: sum(s.accepted for s in out.stats) / sum(s.steps for s in out.stats)
    assert tau(tree) > tau(chain)


def test_a_tree_deeper_than_the_context_holds_is_refused_before_decoding(target, drafts):
    _, ids, mask = _prompts([5, 17])
    settings = DecodeSettings(max_new_tokens=1024 - 17 - 3, k=4, tree=True)  # 1 position over
    with pytest.raises(ValueError, match="exceed the target's context of 1024"):
        generate(target, ids, mask, settings, {EOS}, drafts["noisy copy"])
    out = generate(target, ids[:, -5:][:1], mask[:, -5:][:1], DecodeSettings(max_new_tokens=3),
                   {EOS}, drafts["noisy copy"])  # the check lets fitting requests through
    assert len(out.tokens[0]) == 3
