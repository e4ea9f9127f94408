"""The engine on tiny random models: greedy output equals the target's own, for every draft."""

import pytest
import torch

from serving.drafts import ModelDraft, PromptLookupDraft
from serving.engine import DecodeSettings, generate

VOCAB, EOS = 256, 2


def _tiny(seed, layers=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, eos_token_id=EOS, pad_token_id=0,
                         initializer_range=0.2)  # peaked logits: no near-ties in greedy argmax
    return LlamaForCausalLM(config).eval()


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



def _drafts(target):
    nan_model = _tiny(5)
    nan_model.lm_head.weight.data[0, 0] = float("nan")
    return {"self": ModelDraft(target), "other": ModelDraft(_tiny(3)),
            "prompt lookup": PromptLookupDraft(VOCAB), "nan": ModelDraft(nan_model)}


@pytest.mark.parametrize("draft_name", ["none", "self", "other", "prompt lookup", "nan"])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_speculation_equals_target_greedy_batched(target, draft_name, k):
    prompts, ids, mask = _prompts([5, 17, 9])
    draft = None if draft_name == "none" else _drafts(target)[draft_name]
    out = generate(target, ids, mask, DecodeSettings(max_new_tokens=40, k=k), {EOS}, draft)
    for row, prompt in enumerate(prompts):
        assert out.tokens[row] == _reference(target, prompt, 40), f"row {row}"
    taus = [s.tau for s in out.stats]
    if draft_name == "self":
        assert all(t == k + 1 for t in taus)  # the sanity bound: everything accepted
    if draft_name == "nan":
        assert all(s.draft_failures == 1 for s in out.stats)


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
