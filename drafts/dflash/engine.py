"""The DFlash drafter in our engine: one draft forward per step proposes the whole block of k,
from the context the target's verified tokens left in the drafter's cache."""

from __future__ import annotations

import torch
from torch import nn

from decoding.speculative import draw, sampling_probs
from drafts.dflash.head import DFlashHead
from drafts.kind import aux_features
from drafts.slots import SlotKV


class DFlashDraft:
    """Per layer a cache of context keys/values made from the target's hidden states of every
    verified token, with a slot mask [B, L] (drafts.slots.SlotKV: preallocated, holes for
    rejected slots, as decoding/kv.py) and each row's next position [B]. The block itself is
    never cached: it is recomputed from [pending, mask x k] at every step, as vLLM does."""

    uses_target_hidden = True
    scores, failures, propose_tree = None, None, None  # scores: set by propose

    def __init__(self, head: DFlashHead, embedding: nn.Module, name: str = "dflash"):
        self.head, self.embed, self.name = head, embedding, name

    def start(self, input_ids, attention_mask, first_token, target_hidden=None):
        batch, device = input_ids.shape[0], input_ids.device
        attn = self.head.layers[0].self_attn
        self.context = SlotKV(batch, len(self.head.layers), attn.num_kv_heads, attn.head_dim,
                              self.head.fc.weight.dtype, device,
                              capacity=max(256, 2 * input_ids.shape[1]))
        self.next_position = torch.zeros(batch, dtype=torch.long, device=device)
        self._add_context(target_hidden, attention_mask.bool())
        self.pending = first_token

    def _add_context(self, target_hidden, valid: torch.Tensor) -> None:
        """The target's hidden states of t new slots [B, t] (valid: real tokens) -> context."""
        steps = valid.long()
        positions = self.next_position[:, None] + steps.cumsum(1) - steps  # [B, t]
        aux = aux_features(target_hidden, self.head.aux_layers).to(self.head.fc.weight.dtype)
        self.context.append(self.head.contexts(aux, positions), valid)
        self.next_position = self.next_position + steps.sum(1)

    def block_outputs(self, k: int) -> torch.Tensor:
        """The block [pending, mask x k] through the drafter over its context -> the outputs
        at the k masks [B, k, H] (mask j fills draft position j)."""
        head, batch = self.head, self.pending.shape[0]
        dtype = head.fc.weight.dtype
        block = torch.cat([self.embed(self.pending)[:, None].to(dtype),
                           head.mask_embedding.expand(batch, k, -1)], 1)[:, None]  # [B,1,k+1,H]
        positions = (self.next_position[:, None] + torch.arange(k + 1, device=block.device))
        context = [(self.context.keys(i), self.context.values(i))
                   for i in range(len(head.layers))]
        return head.blocks(block, positions[:, None], context,
                           self.context.mask[:, None])[:, 0, 1:]

    def propose(self, k, sampling, history, generator=None):
        logits = self.head.lm_head(self.block_outputs(k))  # [B, k, V]
        q = sampling_probs(logits, sampling.temperature, sampling.top_p, sampling.top_k)
        self.tokens = draw(q, sampling.temperature, generator)  # [B, k]
        self.scores = logits  # [B, k, V]
        return self.tokens, q  # [B, k], [B, k, V]

    def accept(self, num_accepted, next_token, target_hidden=None, path=None):
        """The verified chunk [pending, d_1..d_k]: its first n+1 slots become context (the
        target's hidden states of the tokens it kept), the rest holes; next_token is pending."""
        k = self.tokens.shape[1]
        valid = torch.arange(k + 1, device=next_token.device)[None] <= num_accepted[:, None]
        self._add_context(target_hidden, valid)
        self.context.crop(k - int(num_accepted.max()))  # trailing slots no row kept
        self.pending = next_token
