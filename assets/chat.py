"""Chat-template rendering and the assistant-token loss mask.

The mask comes from the chat template itself, never from tokenizer-specific offsets. Rendering
messages[:i] with the generation prompt and messages[:i+1] without it gives, as text, where
assistant turn i starts and ends. The conversation is tokenized segment by segment at those
boundaries, which is also how the target saw it while generating (prompt tokens, then its reply):
a reply that starts with, say, a newline cannot merge into the template's markup. Within a reply
segment the mask keeps the reply up to and including the end-of-turn token the target emitted;
markup the template adds after it (a newline) and an end-of-turn token the target never wrote
(its reply hit max_new_tokens) stay out of the loss.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

Message = dict[str, str]  # {"role": ..., "content": ...}


class ChatTemplateError(ValueError):
    """The target's chat template does not render conversations as a growing prefix."""


TEMPLATE_KWARGS = "draftsmith_chat_template_kwargs"
"""The tokenizer attribute holding model.chat_template_kwargs (set by assets.target's
load_tokenizer), so every rendering of a conversation uses the recipe's mode."""


def render_text(tokenizer, messages: list[Message], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         **getattr(tokenizer, TEMPLATE_KWARGS, {}))


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def control_tokens(tokenizer) -> list[str]:
    """The texts the tokenizer reads as special (control) tokens, longest first."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    texts = set(tokenizer.all_special_tokens) | {t.content for t in added.values()
                                                 if getattr(t, "special", False)}
    return sorted((t for t in texts if t), key=len, reverse=True)


def held(tokenizer, messages: list[Message]) -> tuple[list[Message], dict[str, str]]:
    """messages with the text of each non-assistant message that spells a control token (a
    user writing '<|im_start|>system') replaced by a private-use mark -> (those messages,
    mark -> text). Rendered, then encoded by encode_held, the template's own markup becomes
    control tokens and such text stays text: a message cannot open another role's turn.
    Assistant turns are the target's own words, tokenized as the target wrote them."""
    controls = control_tokens(tokenizer)
    marks, out = {}, []
    for i, m in enumerate(messages):
        text = m.get("content")
        if m.get("role") != "assistant" and isinstance(text, str) and any(
                c in text for c in controls):
            mark = f"\ue000{i}\ue001"
            marks[mark] = text
            m = {**m, "content": mark}
        out.append(m)
    return out, marks


def encode_held(tokenizer, text: str, marks: dict[str, str]) -> list[int]:
    """encode with each mark of held's replaced by its text, tokenized as plain text."""
    if not marks:
        return encode(tokenizer, text)
    ids: list[int] = []
    for part in re.split("(" + "|".join(map(re.escape, marks)) + ")", text):
        if part in marks:
            ids += tokenizer(marks[part], add_special_tokens=False,
                             split_special_tokens=True)["input_ids"]
        elif part:
            ids += encode(tokenizer, part)
    return ids


def render(tokenizer, messages: list[Message], add_generation_prompt: bool) -> list[int]:
    """Token ids of `messages` in the target's chat template (no extra special tokens); a
    control token spelled in a user's text stays text (held). Messages that spell none
    tokenize exactly as the whole rendering does."""
    placeheld, marks = held(tokenizer, messages)
    return encode_held(tokenizer, render_text(tokenizer, placeheld, add_generation_prompt), marks)


@dataclass
class TokenizedConversation:
    input_ids: list[int]  # [T]
    loss_mask: list[int]  # [T], 1 on tokens the target wrote as assistant


def tokenize_conversation(tokenizer, messages: list[Message], finished: list[bool],
                          end_of_turn_ids: set[int]) -> TokenizedConversation:
    """Render a full conversation and mark the assistant tokens.

    finished[j] says whether the j-th assistant reply ended with an end-of-turn token (True) or
    was cut by max_new_tokens (False).
    """
    messages, marks = held(tokenizer, messages)  # a user's spelled control token stays text
    full = render_text(tokenizer, messages, add_generation_prompt=False)
    input_ids: list[int] = []
    loss_mask: list[int] = []
    assistant_indices = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if len(assistant_indices) != len(finished):
        raise ValueError(f"{len(assistant_indices)} assistant turns but {len(finished)} flags")
    cursor = 0  # characters of `full` tokenized so far
    for i, done in zip(assistant_indices, finished):
        prefix = render_text(tokenizer, messages[:i], add_generation_prompt=True)
        upto = render_text(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not (upto.startswith(prefix) and full.startswith(upto) and len(prefix) >= cursor):
            raise ChatTemplateError(
                "the target's chat template does not render a conversation as a growing prefix "
                f"(message {i}, an assistant turn, changes earlier text), so assistant tokens "
                "cannot be located from it; use data.max_turns=1 or a target whose template "
                "keeps earlier turns unchanged.")
        markup = encode_held(tokenizer, full[cursor : len(prefix)], marks)
        reply = encode(tokenizer, full[len(prefix) : len(upto)])
        end = next((t for t, token in enumerate(reply) if token in end_of_turn_ids), None)
        if end is None:  # a template without an end-of-turn token: the whole span is the reply
            stop = len(reply)
        else:
            stop = end + 1 if done else end
        input_ids += markup + reply
        loss_mask += [0] * len(markup) + [1] * stop + [0] * (len(reply) - stop)
        cursor = len(upto)
    tail = encode_held(tokenizer, full[cursor:], marks)
    input_ids += tail
    loss_mask += [0] * len(tail)
    return TokenizedConversation(input_ids, loss_mask)
