"""Batched generation with transformers' generate (left padding), each row optionally sampled
from its own seeded generator: how stage 1 runs the target on the HF backend and how on-policy
training samples the draft."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decoding.engine import left_pad
from decoding.speculative import sampling_probs
from recipe import GenerationConfig


@dataclass
class Reply:
    token_ids: list[int]
    """What the target wrote, end-of-turn token included when it emitted one."""
    finished: bool
    """True when the reply ended with an end-of-turn token, False when max_new_tokens cut it."""
    finish_reason: str = ""
    """A server's own finish reason ('none' when it gave none); "" from a local backend, whose
    reply is 'stop' when finished and 'length' otherwise."""


class RowSeededSampling:
    """A transformers logits processor that samples each row from its own generator (seeded per
    conversation): row r's t-th token is argmax(log p + Gumbel noise) with the noise drawn from
    seeds[r]'s stream, an exact sample of p (Gumbel-max), whatever other rows share the batch.
    Used with greedy decoding, which then takes that argmax."""

    def __init__(self, seeds: list[int], temperature: float, top_p: float):
        self.generators = [torch.Generator().manual_seed(s) for s in seeds]
        self.temperature, self.top_p = temperature, top_p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = sampling_probs(scores.float(), self.temperature, self.top_p)  # [B, V]
        uniform = torch.stack([torch.rand(scores.shape[-1], generator=g, dtype=torch.float64)
                               for g in self.generators]).to(scores.device)  # [B, V]
        gumbel = -torch.log(-torch.log(uniform.clamp(min=1e-300)))
        return torch.where(probs > 0, probs.double().log() + gumbel,
                           torch.tensor(float("-inf"), dtype=torch.float64,
                                        device=scores.device)).to(scores.dtype)


@torch.no_grad()
def generate_replies(model, prompts: list[list[int]], gen: GenerationConfig,
                     eos_ids: set[int], pad_id: int,
                     seeds: list[int] | None = None) -> list[Reply]:
    """One reply per prompt, generated together (greedy or temperature/top_p sampling). With
    seeds (one per prompt) each row samples from its own generator; without, from the global
    RNG."""
    from transformers import GenerationConfig as HFGenerationConfig

    device = next(model.parameters()).device
    input_ids, attention_mask = left_pad(prompts, pad_id, device)
    processors = []
    if gen.do_sample and seeds is not None:
        processors = [RowSeededSampling(seeds, gen.temperature, gen.top_p)]
        sampling = dict(do_sample=False)
    elif gen.do_sample:
        sampling = dict(do_sample=True, temperature=gen.temperature, top_p=gen.top_p, top_k=0)
    else:
        sampling = dict(do_sample=False)
    hf_config = HFGenerationConfig(max_new_tokens=gen.max_new_tokens, eos_token_id=sorted(eos_ids),
                                   pad_token_id=pad_id, **sampling)
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                         generation_config=hf_config, logits_processor=processors or None)
    new_tokens = out[:, input_ids.shape[1]:].tolist()  # [B, <= max_new_tokens]
    replies = []
    for row in new_tokens:
        end = next((i for i, t in enumerate(row) if t in eos_ids), None)
        if end is None:
            replies.append(Reply(row[: gen.max_new_tokens], False))
        else:
            replies.append(Reply(row[: end + 1], True))
    return replies
