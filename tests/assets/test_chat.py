"""Loss masks from the chat template, checked on each embedded target's real tokenizer and
template (SmolLM2-135M-Instruct, Qwen2.5-Coder-0.5B-Instruct)."""

import pytest

from assets.chat import ChatTemplateError, render, render_text, tokenize_conversation


def im_end(tok) -> int:
    """The end-of-turn token of both targets' ChatML templates."""
    return tok.convert_tokens_to_ids("<|im_end|>")


def _conversation():
    return [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a prime."},
            {"role": "assistant", "content": "Seven."},
            {"role": "user", "content": "Another, with a newline\nplease."},
            {"role": "assistant", "content": "Eleven,\nand thirteen."}]


def _masked_runs(ids, mask):
    runs, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def test_mask_covers_exactly_each_reply_and_its_end_of_turn(chat_tokenizer):
    tok = chat_tokenizer
    conv = _conversation()
    out = tokenize_conversation(tok, conv, [True, True], {im_end(tok)})
    assert tok.decode(out.input_ids) == render_text(tok, conv, add_generation_prompt=False)
    runs = [tok.decode(run) for run in _masked_runs(out.input_ids, out.loss_mask)]
    assert runs == ["Seven.<|im_end|>", "Eleven,\nand thirteen.<|im_end|>"]
    # everything else, system and user turns and the template's own markup, is unmasked
    unmasked = tok.decode([t for t, m in zip(out.input_ids, out.loss_mask) if not m])
    assert "Name a prime." in unmasked and "<|im_start|>assistant\n" in unmasked
    assert "Seven" not in unmasked


def test_reply_cut_by_max_new_tokens_keeps_its_end_of_turn_out(chat_tokenizer):
    tok = chat_tokenizer
    out = tokenize_conversation(tok, _conversation(), [False, True], {im_end(tok)})
    runs = [tok.decode(run) for run in _masked_runs(out.input_ids, out.loss_mask)]
    assert runs == ["Seven.", "Eleven,\nand thirteen.<|im_end|>"]


def test_mask_positions_follow_the_generation_prompt(chat_tokenizer):
    tok = chat_tokenizer
    conv = _conversation()[:3]
    out = tokenize_conversation(tok, conv, [True], {im_end(tok)})
    prompt = render(tok, conv[:2], add_generation_prompt=True)
    assert out.input_ids[: len(prompt)] == prompt
    assert out.loss_mask.index(1) == len(prompt)


def test_reply_starting_with_a_newline_stays_its_own_segment(chat_tokenizer):
    tok = chat_tokenizer
    conv = _conversation()[:2] + [{"role": "assistant", "content": "\n\nSeven."}]
    out = tokenize_conversation(tok, conv, [True], {im_end(tok)})
    prompt = render(tok, conv[:2], add_generation_prompt=True)
    assert out.input_ids[: len(prompt)] == prompt  # what the target saw before replying
    runs = [tok.decode(run) for run in _masked_runs(out.input_ids, out.loss_mask)]
    assert runs == ["\n\nSeven.<|im_end|>"]


def test_template_that_rewrites_history_is_refused(smollm2_tokenizer):
    tok = smollm2_tokenizer
    original = tok.chat_template
    # like templates that drop earlier assistant turns' reasoning: history != prefix
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last"
                         " %}<|im_start|>assistant\n(hidden)<|im_end|>\n{% else %}<|im_start|>"
                         "{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    try:
        with pytest.raises(ChatTemplateError, match="growing prefix"):
            tokenize_conversation(tok, _conversation(), [True, True], {im_end(tok)})
    finally:
        tok.chat_template = original
