"""Chat-template rendering and the assistant-token loss mask.

The mask comes from the chat template itself, never from tokenizer-specific offsets: the tokens
of assistant turn i are those that rendering messages[:i+1] adds after rendering messages[:i]
with the generation prompt. Within that span the mask keeps the reply up to and including the
end-of-turn token the target emitted; formatting the template adds after it (a newline) and an
end-of-turn token the target never wrote (its reply hit max_new_tokens) stay out of the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

Message = dict[str, str]  # {"role": ..., "content": ...}


class ChatTemplateError(ValueError):
    """The target's chat template does not render conversations as a growing prefix."""


def render(tokenizer, messages: list[Message], add_generation_prompt: bool) -> list[int]:
    """Token ids of `messages` in the target's chat template (no extra special tokens)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


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
    input_ids = render(tokenizer, messages, add_generation_prompt=False)
    loss_mask = [0] * len(input_ids)
    assistant_indices = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if len(assistant_indices) != len(finished):
        raise ValueError(f"{len(assistant_indices)} assistant turns but {len(finished)} flags")
    for i, done in zip(assistant_indices, finished):
        prefix = render(tokenizer, messages[:i], add_generation_prompt=True)
        upto = render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if upto[: len(prefix)] != prefix or input_ids[: len(upto)] != upto:
            raise ChatTemplateError(
                "the target's chat template does not render a conversation as a growing prefix "
                f"(assistant turn {i} changes earlier tokens), so assistant tokens cannot be "
                "located from it; use data.max_turns=1 or a target whose template keeps earlier "
                "turns unchanged.")
        span = range(len(prefix), len(upto))
        end = next((t for t in span if input_ids[t] in end_of_turn_ids), None)
        if end is None:  # template without an end-of-turn token: the whole span is the reply
            stop = span.stop
        else:
            stop = end + 1 if done else end
        for t in range(span.start, stop):
            loss_mask[t] = 1
    return TokenizedConversation(input_ids, loss_mask)
