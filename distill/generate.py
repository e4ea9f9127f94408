"""Batched target generation with left padding, and the target's top-k log-probabilities."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recipe import GenerationConfig


@dataclass
class Reply:
    token_ids: list[int]
    """What the target wrote, end-of-turn token included when it emitted one."""
    finished: bool
    """True when the reply ended with an end-of-turn token, False when max_new_tokens cut it."""


def end_of_turn_ids(model, tokenizer) -> set[int]:
    """Every token id that ends an assistant turn for this target."""
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device):
    """input_ids and attention_mask [B, L_max], each prompt right-aligned."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        input_ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
        attention_mask[row, width - len(p):] = 1
    return input_ids.to(device), attention_mask.to(device)


@torch.no_grad()
def generate_replies(model, prompts: list[list[int]], gen: GenerationConfig,
                     eos_ids: set[int], pad_id: int) -> list[Reply]:
    """One reply per prompt, generated together (greedy or temperature/top_p sampling)."""
    from transformers import GenerationConfig as HFGenerationConfig

    device = next(model.parameters()).device
    input_ids, attention_mask = left_pad(prompts, pad_id, device)
    sampling = dict(do_sample=True, temperature=gen.temperature, top_p=gen.top_p, top_k=0) \
        if gen.do_sample else dict(do_sample=False)
    hf_config = HFGenerationConfig(max_new_tokens=gen.max_new_tokens, eos_token_id=sorted(eos_ids),
                                   pad_token_id=pad_id, **sampling)
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                         generation_config=hf_config)
    new_tokens = out[:, input_ids.shape[1]:].tolist()  # [B, <= max_new_tokens]
    replies = []
    for row in new_tokens:
        end = next((i for i, t in enumerate(row) if t in eos_ids), None)
        if end is None:
            replies.append(Reply(row[: gen.max_new_tokens], False))
        else:
            replies.append(Reply(row[: end + 1], True))
    return replies


@torch.no_grad()
def topk_logprobs(model, input_ids: list[int], loss_mask: list[int], k: int):
    """The target's top-k log-probs predicting each masked token.

    Returns (ids [N, k] int32, logprobs [N, k] float32) where N = sum(loss_mask) and row j is the
    distribution at position t-1 for the j-th masked position t (untempered: log_softmax of the
    raw logits).
    """
    device = next(model.parameters()).device
    ids = torch.tensor([input_ids], device=device)
    positions = torch.tensor([t - 1 for t, m in enumerate(loss_mask) if m], device=device)
    logits = model(input_ids=ids, logits_to_keep=positions).logits[0]  # [N, V]
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    values, indices = logprobs.topk(k, dim=-1)
    return indices.to(torch.int32).cpu(), values.cpu()
