"""Lossless under sampling, end to end: for every draft kind, our engine's sampled outputs follow
the target's own (temperature, top-p, top-k filtered) distribution over many consecutive steps,
in a left-padded batch; a deliberately wrong acceptance or resampling rule fails the same test.

The test statistic is the randomized probability integral transform: for each emitted token x_t,
u_t = F_t(x_t - 1) + U * p_t(x_t) with p_t the target's filtered distribution given the row's
actual prefix and F_t its CDF. Whatever path a row took, u_t is Uniform(0, 1) and independent
of u_1..u_{t-1} exactly when x_t ~ p_t, so the pooled u's of all positions and rows must pass a
chi-square test of uniformity.
"""

from __future__ import annotations

import pytest
import torch

from decoding import speculative
from decoding.engine import DecodeSettings, generate
from decoding.speculative import sampling_probs
from drafts.dflash import DFlash, DFlashDraft, DFlashHead, DFlashModel
from drafts.eagle3 import Eagle3Draft, Eagle3Head
from drafts.independent import Independent, ModelDraft
from drafts.kind import LoadedDraft
from drafts.medusa import MedusaDraft, MedusaHeads
from drafts.pard import ParallelModelDraft, Pard
from drafts.prompt_lookup import PromptLookupDraft
from tests.helpers import tiny_llama

VOCAB, NEW_TOKENS, K, ROWS, BINS = 8, 12, 3, 2000, 20
PROMPTS = [[3, 1, 4, 1, 5], [2, 6, 5, 3, 5, 0, 7, 2, 6]]  # two lengths: left padding and holes


def _tiny(seed: int, layers: int = 2):
    return tiny_llama(VOCAB, seed=seed, layers=layers, hidden=32, heads=2, kv_heads=1,
                      context=64, init=0.15, pad_token_id=0)


@pytest.fixture(scope="module")
def target():
    return _tiny(0)


def _draft(kind: str, target):
    torch.manual_seed(11)
    kind, _, weights = kind.partition(", weights ")
    weights = weights or "model"
    if weights != "model" and not kind.startswith("eagle3"):  # the same draft, quantised by
        draft = _draft(kind, target)  # its kind's quantise
        if kind == "dflash":
            draft.head = DFlash().quantise(LoadedDraft("", DFlash(), DFlashModel(
                draft.head, draft.embed)), weights).model.head
        elif kind.startswith("pard"):
            draft = ParallelModelDraft(Pard().quantise(LoadedDraft("", Pard(), draft.model),
                                                       weights).model, mask_id=7)
        else:
            draft = ModelDraft(Independent().quantise(LoadedDraft("", Independent(),
                                                                  draft.lm.model), weights).model)
        return draft
    if kind == "independent":
        return ModelDraft(_tiny(5, layers=1))
    if kind == "independent, draft vocabulary":  # its head scores 6 of 8 tokens: q is 0 on 4, 7
        model = _tiny(5, layers=1)
        model.config.draft_vocabulary = [0, 1, 2, 3, 5, 6]
        return ModelDraft(model)
    if kind == "medusa":
        return MedusaDraft(MedusaHeads(32, VOCAB, num_heads=K, num_layers=1).eval())
    if kind.startswith("eagle3"):  # a draft vocabulary without 4 and 7: the target adds them
        head = Eagle3Head.from_target(target, [0, 1, 1], torch.tensor([0, 1, 2, 3, 5, 6]))
        with torch.no_grad():
            head.lm_head.weight.normal_(0, 0.5)
        return Eagle3Draft(head.eval(), target.get_input_embeddings(), weights=weights)
    if kind == "dflash":  # one block of K masks per step, from the target's context; its
        # start (the target's layer 1 and lm_head) made noisier so that both accept and reject
        head = DFlashHead.from_target(target, [1], 1, mask_token_id=7, block_size=K)
        with torch.no_grad():
            head.lm_head.weight.add_(torch.randn_like(head.lm_head.weight), alpha=0.3)
        return DFlashDraft(head.eval(), target.get_input_embeddings())
    if kind == "pard":  # another tiny LM, K tokens per forward with K-1 masks (token 7)
        return ParallelModelDraft(_tiny(5, layers=1), mask_id=7)
    if kind == "pard, draft vocabulary":  # q is 0 on tokens 4 and 7
        model = _tiny(5, layers=1)
        model.config.draft_vocabulary = [0, 1, 2, 3, 5, 6]
        return ParallelModelDraft(model, mask_id=7)
    return PromptLookupDraft(VOCAB, max_ngram=3, min_ngram=1)


def _batch(rows: int = ROWS):
    prompts = [PROMPTS[row % 2] for row in range(rows)]
    width = max(map(len, PROMPTS))
    ids = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return prompts, ids, mask


def pit_p_value(target, prompts, outputs, settings: DecodeSettings, seed: int = 0) -> float:
    """The chi-square p-value of the pooled randomized PIT values of every emitted token."""
    g = torch.Generator().manual_seed(seed)
    values = []
    for prompt in PROMPTS:
        rows = [o for p, o in zip(prompts, outputs) if p == prompt]
        seqs = torch.tensor([prompt + o for o in rows])  # [n, P + NEW_TOKENS]
        with torch.no_grad():
            logits = target(seqs).logits[:, len(prompt) - 1:-1]  # [n, NEW_TOKENS, V]
        p = sampling_probs(logits.double(), settings.temperature, settings.top_p, settings.top_k)
        x = seqs[:, len(prompt):, None]  # [n, NEW_TOKENS, 1]
        below = (p.cumsum(-1) - p).gather(-1, x)[..., 0]  # F(x - 1)
        values.append(below + torch.rand(below.shape, generator=g, dtype=torch.float64)
                      * p.gather(-1, x)[..., 0])
    u = torch.cat(values).flatten()
    observed = torch.bincount((u * BINS).long().clamp(max=BINS - 1), minlength=BINS).double()
    expected = len(u) / BINS
    chi2 = ((observed - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((BINS - 1) / 2.0), chi2 / 2))


def _sample(target, kind: str, temperature: float, seed: int = 3, global_seed: int = 0,
            tree: bool = False, ngram_branch: bool = False, tree_nodes: int = 0,
            rows: int = ROWS):
    prompts, ids, mask = _batch(rows)
    settings = DecodeSettings(max_new_tokens=NEW_TOKENS, k=K, temperature=temperature,
                              top_p=0.9, top_k=6, tree=tree, tree_width=2,
                              ngram_branch=ngram_branch, tree_nodes=tree_nodes)
    draft = _draft(kind, target)
    torch.manual_seed(global_seed)  # the engine's generator alone must decide the samples
    out = generate(target, ids, mask, settings, {VOCAB + 1}, draft,
                   generator=torch.Generator().manual_seed(seed))
    assert all(len(t) == NEW_TOKENS for t in out.tokens)
    return prompts, out, settings


KINDS = ["independent", "independent, draft vocabulary", "medusa", "eagle3", "dflash", "pard",
         "pard, draft vocabulary", "prompt lookup"]
BROKEN = {  # wrong rules that a bias check must catch
    "accept with q/p": ("acceptance_mask", lambda p, q, u: u * p < q),
    "resample from p": ("residual_distribution", lambda p, q: p),
}


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("kind", KINDS)
def test_every_draft_kind_samples_the_targets_distribution(target, kind, temperature):
    prompts, out, settings = _sample(target, kind, temperature)
    assert min(s.steps for s in out.stats) >= 3  # several verification steps per row
    accepted = sum(s.accepted for s in out.stats) / sum(s.drafted for s in out.stats)
    assert 0.02 < accepted < 0.98  # both acceptance and rejection were exercised
    assert pit_p_value(target, prompts, out.tokens, settings) > 1e-3


@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("kind", ["eagle3", "dflash", "pard", "independent, draft vocabulary"])
def test_drafts_on_quantised_weights_sample_the_targets_distribution(target, kind, weights):
    """A draft on int8 or int4 weights proposes from its own quantised q, which verification
    reads: the output follows the target's distribution as before (and trees rank with its
    scores)."""
    prompts, out, settings = _sample(target, f"{kind}, weights {weights}", 1.0,
                                     tree=kind == "eagle3", tree_nodes=8 if kind == "eagle3" else 0)
    accepted = sum(s.accepted for s in out.stats) / sum(s.drafted for s in out.stats)
    assert 0.02 < accepted < 0.98
    assert pit_p_value(target, prompts, out.tokens, settings) > 1e-3


@pytest.mark.slow  # the test's power, not the code: 12 runs of 2,000 rows
@pytest.mark.parametrize("broken", list(BROKEN))
@pytest.mark.parametrize("kind", KINDS)
def test_a_wrong_rule_fails_the_same_test(target, kind, broken, monkeypatch):
    name, rule = BROKEN[broken]
    monkeypatch.setattr(speculative, name, rule)
    prompts, out, settings = _sample(target, kind, 1.0)
    assert pit_p_value(target, prompts, out.tokens, settings) < 1e-6


TREES = [("independent", False, 0), ("medusa", False, 0), ("dflash", False, 0),
         ("eagle3", True, 8), ("independent, draft vocabulary", False, 4)]


@pytest.mark.parametrize("kind,ngram_branch,tree_nodes", TREES)
def test_trees_sample_the_targets_distribution(target, kind, ngram_branch, tree_nodes):
    """Tree steps (the draft's chain plus 2 alternatives per position, or for EAGLE-3 a dynamic
    tree of 8 nodes; with ngram_branch also the n-gram match) keep the target's distribution."""
    prompts, out, settings = _sample(target, kind, 1.0, tree=True, ngram_branch=ngram_branch,
                                     tree_nodes=tree_nodes)
    assert sum(s.accepted_alternative for s in out.stats) > 0  # the alternatives were used
    if ngram_branch:
        assert sum(s.accepted_ngram for s in out.stats) > 0
    accepted = sum(s.accepted for s in out.stats) / sum(s.drafted for s in out.stats)
    assert 0.02 < accepted < 0.98
    assert pit_p_value(target, prompts, out.tokens, settings) > 1e-3


TREE_BROKEN = {  # wrong tree rules that the same bias check must catch
    "residual not updated": ("residual_distribution", lambda r, q: r),
    "sampled child kept with probability r(x)": ("accept_child", lambda u, r_x, q_x: bool(u < r_x)),
    "fixed candidate always kept": (
        "accept_child", lambda u, r_x, q_x: q_x is None or bool(u * q_x < r_x)),
}


@pytest.mark.slow
@pytest.mark.parametrize("broken", list(TREE_BROKEN))
def test_a_wrong_tree_rule_fails_the_same_test(target, monkeypatch, broken):
    import decoding.tree

    monkeypatch.setattr(decoding.tree, *TREE_BROKEN[broken])
    prompts, out, settings = _sample(target, "independent", 1.0, tree=True)
    assert pit_p_value(target, prompts, out.tokens, settings) < 1e-6


@pytest.mark.parametrize("kind", KINDS)
def test_a_seeded_run_repeats_exactly_whatever_the_global_rng_does(target, kind):
    runs = [_sample(target, kind, 1.0, seed=5, global_seed=g, rows=64)[1].tokens for g in (0, 1)]
    assert runs[0] == runs[1]
    assert _sample(target, kind, 1.0, seed=6, rows=64)[1].tokens != runs[0]


if __name__ == "__main__":  # the figures: python -m tests.decoding.test_sampling
    model = _tiny(0)
    print("| kind | T | acceptance | p | p, accept with q/p | p, resample from p |")
    print("|---|---|---|---|---|---|")
    for kind in KINDS:
        broken = []
        for name, (attr, rule) in BROKEN.items():
            correct = getattr(speculative, attr)
            setattr(speculative, attr, rule)
            prompts, out, settings = _sample(model, kind, 1.0)
            broken.append(pit_p_value(model, prompts, out.tokens, settings))
            setattr(speculative, attr, correct)
        for temperature in (0.7, 1.0):
            prompts, out, settings = _sample(model, kind, temperature)
            rate = sum(s.accepted for s in out.stats) / sum(s.drafted for s in out.stats)
            p = pit_p_value(model, prompts, out.tokens, settings)
            print(f"| {kind} | {temperature} | {rate:.2f} | {p:.3g} | "
                  + " | ".join(f"{b:.2g}" for b in broken) + " |")
    print("\n| tree (2 alternatives per position) | T | acceptance per node | accepted "
          "alternatives / n-gram | p |")
    print("|---|---|---|---|---|")
    for kind, ngram_branch in TREES:
        prompts, out, settings = _sample(model, kind, 1.0, tree=True, ngram_branch=ngram_branch)
        rate = sum(s.accepted for s in out.stats) / sum(s.drafted for s in out.stats)
        p = pit_p_value(model, prompts, out.tokens, settings)
        print(f"| {kind}{' + n-gram' if ngram_branch else ''} | 1.0 | {rate:.2f} | "
              f"{sum(s.accepted_alternative for s in out.stats)} / "
              f"{sum(s.accepted_ngram for s in out.stats)} | {p:.3g} |")


@pytest.mark.parametrize(("draft_temperature", "draft_top_k"), [(0.0, None), (2.0, None),
                                                                 (None, 2)])
@pytest.mark.parametrize("kind", ["independent", "eagle3"])
def test_a_draft_at_its_own_temperature_keeps_the_targets_distribution(target, kind,
                                                                       draft_temperature,
                                                                       draft_top_k):
    """draft_temperature 0 (argmax drafting, one-hot q: vLLM's and llama.cpp's default), another
    temperature than the target's, or another top-k filter (llama.cpp's probabilistic drafting
    keeps 10) change only acceptance, never the output distribution."""
    prompts, ids, mask = _batch()
    settings = DecodeSettings(max_new_tokens=NEW_TOKENS, k=K, temperature=1.0, top_p=0.9,
                              top_k=6, draft_temperature=draft_temperature,
                              draft_top_k=draft_top_k)
    draft = _draft(kind, target)
    seen = []
    propose = draft.propose

    def spy(k, sampling, history, generator=None):
        tokens, q = propose(k, sampling, history, generator)
        seen.append((sampling.temperature, q))
        return tokens, q

    draft.propose = spy
    out = generate(target, ids, mask, settings, {VOCAB + 1}, draft,
                   generator=torch.Generator().manual_seed(3))
    assert {t for t, _ in seen} == {1.0 if draft_temperature is None else draft_temperature}
    if draft_temperature == 0:  # one-hot q: each proposal is the draft's argmax
        assert all(bool(((q == 0) | (q == 1)).all()) for _, q in seen)
    if draft_top_k is not None:  # the draft's own filter, not the target's top_k=6
        assert max(int((q > 0).sum(-1).max()) for _, q in seen) <= draft_top_k
    accepted = sum(s.accepted for s in out.stats) / sum(s.drafted for s in out.stats)
    assert 0.02 < accepted < 0.98
    assert pit_p_value(target, prompts, out.tokens, settings) > 1e-3
