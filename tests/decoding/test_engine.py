"""The engine on tiny random models: greedy output equals the target's own, for every draft."""

import pytest
import torch

from decoding.engine import DecodeSettings, generate
from drafts.independent import ModelDraft
from drafts.medusa import MedusaDraft, MedusaHeads
from drafts.prompt_lookup import PromptLookupDraft
from tests.helpers import (
    fit_medusa_heads,
    greedy_chain_counts,
    greedy_lm_proposer,
    tiny_llama,
)

VOCAB, EOS = 256, 2


def _tiny(seed, layers=2):
    # peaked logits (init 0.2): no near-ties in greedy argmax
    return tiny_llama(VOCAB, seed=seed, layers=layers, eos_token_id=EOS, pad_token_id=0)


@pytest.fixture(scope="module")
def target():
    return _tiny(0)


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]
    width = max(lengths)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return prompts, ids, mask


def _reference(target, prompt, max_new_tokens):
    """HF generate, greedy, one prompt without padding, stopping at EOS."""
    out = target.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                          dtype=torch.long), max_new_tokens=max_new_tokens, do_sample=False,
                          eos_token_id=EOS, pad_token_id=0)
    return out[0, len(prompt):].tolist()



def _noisy_copy(target, std=0.02):
    """The target with noise on its weights: a draft that is right often and wrong sometimes."""
    import copy

    torch.manual_seed(9)
    draft = copy.deepcopy(target)
    with torch.no_grad():
        for p in draft.model.layers.parameters():
            p.add_(torch.randn_like(p) * std)
    return draft


def _fitted_medusa(target, num_heads=4, steps=20):
    prompts, _, _ = _prompts([5, 17, 9])
    return fit_medusa_heads(target, [p + _reference(target, p, 40) for p in prompts], num_heads,
                            steps)


def _drafts(target):
    nan_model = _tiny(5)
    nan_model.lm_head.weight.data[0, 0] = float("nan")
    torch.manual_seed(7)
    random_heads = MedusaHeads(64, VOCAB, num_heads=4, num_layers=2).eval()
    return {"self": ModelDraft(target), "other": ModelDraft(_tiny(3)),
            "noisy copy": ModelDraft(_noisy_copy(target)),
            "noisy copy, draft vocabulary": ModelDraft(_with_vocabulary(target,
                                                                        _noisy_copy(target))),
            "prompt lookup": PromptLookupDraft(VOCAB), "nan": ModelDraft(nan_model),
            "medusa": MedusaDraft(MedusaHeads.from_target(target, num_heads=4).eval()),
            "fitted medusa": MedusaDraft(_fitted_medusa(target)),
            "random medusa": MedusaDraft(random_heads)}


def _with_vocabulary(target, model):
    """The model's head restricted to the tokens of the target's answers but their largest (as
    training picks the most frequent labels; that one the draft can never propose): its q is
    zero on every other token."""
    prompts, _, _ = _prompts([5, 17, 9])
    answered = sorted({t for p in prompts for t in _reference(target, p, 40)})
    model.config.draft_vocabulary = answered[:-1]
    return model


# drafts meant to be right often: a test with them proves something only if they were
ACCEPTING = {"self", "noisy copy", "noisy copy, draft vocabulary", "fitted medusa"}


@pytest.mark.parametrize("draft_name", ["none", "self", "other", "noisy copy",
                                        "noisy copy, draft vocabulary", "prompt lookup", "nan",
                                        "medusa", "fitted medusa", "random medusa"])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_speculation_equals_target_greedy_batched(target, draft_name, k):
    prompts, ids, mask = _prompts([5, 17, 9])
    draft = None if draft_name == "none" else _drafts(target)[draft_name]
    out = generate(target, ids, mask, DecodeSettings(max_new_tokens=40, k=k), {EOS}, draft)
    for row, prompt in enumerate(prompts):
        assert out.tokens[row] == _reference(target, prompt, 40), f"row {row}"
    taus = [s.tau for s in out.stats]
    accepted, drafted = sum(s.accepted for s in out.stats), sum(s.drafted for s in out.stats)
    if draft_name in ACCEPTING:
        assert accepted > drafted / 10, (accepted, drafted)  # not a vacuous pass
    if draft_name in ACCEPTING - {"self"}:
        assert accepted < drafted  # rejections too: the rollback and the cache holes ran
    if draft_name == "self":
        assert all(t == k + 1 for t in taus)  # the sanity bound: everything accepted
    if draft_name == "nan":
        assert all(s.draft_failures == 1 for s in out.stats)


@pytest.mark.parametrize("draft_name", ["noisy copy", "fitted medusa"])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_counts_equal_a_cache_free_reference(target, draft_name, k):
    """steps and accepted tokens per row, batched and left-padded, equal what decoding each
    prompt alone with full recomputation counts (tests.helpers.greedy_chain_counts): a draft
    cache or a count that goes wrong while the output stays lossless changes them."""
    prompts, ids, mask = _prompts([5, 17, 9])
    draft = _drafts(target)[draft_name]
    out = generate(target, ids, mask, DecodeSettings(max_new_tokens=40, k=k), {EOS}, draft)
    if draft_name == "fitted medusa":
        heads = draft.heads

        @torch.no_grad()
        def propose(tokens, k):  # head j reads the hidden state that chose the last token
            hidden = target(torch.tensor([tokens]), output_hidden_states=True).hidden_states
            return heads(hidden[-1][0, -2:-1])[:k, 0].argmax(-1).tolist()  # [k]
    else:
        propose = greedy_lm_proposer(draft.lm.model)
    for row, prompt in enumerate(prompts):
        want = greedy_chain_counts(target, propose, prompt, k, 40, {EOS})
        assert (out.stats[row].steps, out.stats[row].accepted) == want, f"row {row}"
    assert sum(s.accepted for s in out.stats) > 0


def test_adaptive_k_grows_with_a_perfect_draft_and_stays_lossless(target):
    prompts, ids, mask = _prompts([6, 11])
    settings = DecodeSettings(max_new_tokens=60, k=1, adaptive_k=True, k_max=7)
    out = generate(target, ids, mask, settings, {EOS}, ModelDraft(target))
    assert out.k_used[0] == 1 and max(out.k_used) == 7
    for row, prompt in enumerate(prompts):
        assert out.tokens[row] == _reference(target, prompt, 60)


def test_stop_strings_end_a_request_after_the_completing_token(target):
    prompts, ids, mask = _prompts([7])
    reference = _reference(target, prompts[0], 40)
    decode = lambda tokens: "".join(f"<{t}>" for t in tokens)  # noqa: E731
    stop = f"<{reference[9]}><{reference[10]}>"
    first = next(i for i in range(1, len(reference)) if stop in decode(reference[: i + 1]))
    settings = DecodeSettings(max_new_tokens=40, k=3, stop_strings=(stop,))
    out = generate(target, ids, mask, settings, {EOS}, ModelDraft(target), decode=decode)
    assert out.tokens[0] == reference[: first + 1]


def test_stats_count_positions(target):
    prompts, ids, mask = _prompts([8])
    out = generate(target, ids, mask, DecodeSettings(max_new_tokens=30, k=3), {EOS},
                   ModelDraft(_tiny(3)))
    s = out.stats[0]
    assert s.drafted == 3 * s.steps and s.drafted_per_position == [s.steps] * 3
    assert s.accepted == sum(s.accepted_per_position)
    assert s.accepted_per_position == sorted(s.accepted_per_position, reverse=True)
    assert len(out.tokens[0]) <= 1 + s.steps * 4


def test_prompt_lookup_finds_the_latest_occurrence():
    draft = PromptLookupDraft(VOCAB, max_ngram=3, min_ngram=1)
    assert draft.lookup([5, 6, 7, 8, 1, 5, 6, 9, 2, 5, 6], 2) == [9, 2]
    assert draft.lookup([1, 2, 3], 2) == []


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="k=0"):
        DecodeSettings(k=0)
    with pytest.raises(ValueError, match="temperature"):
        DecodeSettings(temperature=-0.1)


class _RecordingMedusa(MedusaDraft):
    """Records, at each proposal, the rows' histories and the hidden states the heads read."""

    def __init__(self, heads):
        super().__init__(heads)
        self.seen = []

    def propose(self, k, sampling, history, generator=None):
        self.seen.append(([list(h) for h in history], self.hidden.clone()))
        return super().propose(k, sampling, history, generator)


def test_medusa_reads_the_hidden_state_of_the_position_that_chose_the_last_token(target):
    """The heads must see h_t with x_{t+1} the newest token: the target's post-norm last hidden
    state at the second-to-last position of the history (checked against a plain forward)."""
    prompts, ids, mask = _prompts([6, 11])
    draft = _RecordingMedusa(MedusaHeads.from_target(target, num_heads=3).eval())
    out = generate(target, ids, mask, DecodeSettings(max_new_tokens=20, k=3), {EOS}, draft)
    checked = 0
    for histories, hidden in draft.seen:
        for row, history in enumerate(histories):
            if len(history) == len(prompts[row]) + len(out.tokens[row]):
                continue  # the row has finished; its history no longer grows
            full = target(torch.tensor([history]), output_hidden_states=True).hidden_states[-1]
            torch.testing.assert_close(hidden[row], full[0, -2], atol=1e-4, rtol=1e-4)
            checked += 1
    assert checked > 5


def test_medusa_accept_picks_the_slot_of_the_last_accepted_token():
    """Verified chunk [pending, d_1..d_k]: with n accepted, slot n chose next_token."""
    draft = MedusaDraft(MedusaHeads(4, 10, num_heads=2))
    hidden = torch.arange(3 * 4 * 4, dtype=torch.float).view(3, 4, 4)  # [B, k+1, H], k = 3
    draft.accept(torch.tensor([0, 3, 1]), torch.tensor([5, 6, 7]), (hidden * 0, hidden))
    torch.testing.assert_close(draft.hidden, torch.stack([hidden[0, 0], hidden[1, 3],
                                                          hidden[2, 1]]))


def test_medusa_refuses_more_draft_tokens_than_heads(target):
    _, ids, mask = _prompts([5])
    draft = MedusaDraft(MedusaHeads.from_target(target, num_heads=2).eval())
    with pytest.raises(ValueError, match="k=3 draft tokens need 3 Medusa heads"):
        generate(target, ids, mask, DecodeSettings(max_new_tokens=8, k=3), {EOS}, draft)


def test_medusa_sampling_keeps_the_target_distribution():
    """Lossless at temperature 1: with random heads proposing, the second emitted token (the
    first one a head drafts) follows the target's exact marginal sum_x1 p(x1) p(x2 | x1)."""
    vocab, n = 12, 4000
    target = tiny_llama(vocab, seed=0, layers=1, hidden=32, heads=2, kv_heads=1,
                        context=2048, init=0.1)
    prompt = torch.tensor([[3, 5, 7]])
    with torch.no_grad():
        p1 = target(prompt).logits[0, -1].softmax(-1)  # [V]
        both = torch.cat([prompt.expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)
        p2 = (p1[:, None] * target(both).logits[:, -1].softmax(-1)).sum(0)  # [V]
    heads = MedusaHeads(32, vocab, num_heads=2, num_layers=1).eval()
    out = generate(target, prompt.expand(n, -1), torch.ones(n, 3, dtype=torch.long),
                   DecodeSettings(max_new_tokens=2, k=2, temperature=1.0), {vocab + 1},
                   MedusaDraft(heads), generator=torch.Generator().manual_seed(3))
    assert sum(s.accepted for s in out.stats) > n / 20  # the heads' tokens are really used
    second = torch.tensor([t[1] for t in out.tokens])
    empirical = torch.bincount(second, minlength=vocab).float() / n
    assert 0.5 * (empirical - p2).abs().sum() < 0.05
