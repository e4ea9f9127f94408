"""A batched KV cache for speculative decoding with per-row acceptance.

Rows of a batch accept different numbers of draft tokens. A rectangular cache cannot be cropped
to each row's own length, so every step appends its slots for all rows, the slots all rows
rejected are cropped, and the remaining rejected slots become holes: masked out of attention,
skipped by the position ids. Masked keys get exactly zero attention weight, so a row's
computation is that of its valid tokens alone.
"""

from __future__ import annotations

import torch
from torch import nn

from decoding.quantise import QUANTISED


def head_rows(head: nn.Module, rows: torch.Tensor) -> nn.Module:
    """An output head (nn.Linear, or a decoding.quantise layer for a draft on quantised
    weights) restricted to the output rows [Vd] (a draft vocabulary's ids, on the head's
    device), weights copied."""
    if isinstance(head, QUANTISED):
        return head.rows(rows)
    out = nn.Linear(head.weight.shape[1], len(rows), head.bias is not None, head.weight.device,
                    head.weight.dtype).requires_grad_(False)
    with torch.no_grad():
        out.weight.copy_(head.weight[rows])
        if head.bias is not None:
            out.bias.copy_(head.bias[rows])
    return out


class CachedLM:
    """A causal LM with its cache, its slot mask [B, L] and each row's next position [B].

    vocabulary: sorted target ids [Vd]: the head scores these alone (its weight's rows, taken
    once) and every logits tensor returned is over them, [..., Vd]; None: the whole vocabulary.
    """

    def __init__(self, model, keep_hidden_states: bool = False,
                 vocabulary: torch.Tensor | None = None):
        self.model = model
        self.keep_hidden_states = keep_hidden_states
        self.head = None  # [..., H] -> [..., Vd] logits: the head's rows of the vocabulary
        if vocabulary is not None:
            self.head = head_rows(model.get_output_embeddings(), vocabulary.to(self.device))
        self.hidden_states: tuple[torch.Tensor, ...] | None = None
        """With keep_hidden_states: the last forward's hidden states, one [B, t, H] per layer
        (HF output_hidden_states: embeddings first, the post-norm last hidden state last)."""
        self.cache = None
        self.mask: torch.Tensor | None = None  # [B, L] 1 = a real token, 0 = pad or hole
        self.next_position: torch.Tensor | None = None  # [B] valid tokens so far

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Left-padded prompts [B, T] -> logits of the last position [B, V]."""
        from transformers import DynamicCache

        self.cache = DynamicCache()
        self.mask = attention_mask.clone()
        positions = (attention_mask.cumsum(1) - 1).clamp(min=0)  # [B, T]
        logits = self._forward(input_ids, self.mask, positions, last_only=True)
        self.next_position = attention_mask.sum(1)
        return logits[:, -1]

    def _forward(self, input_ids, attention_mask, positions, last_only: bool = False):
        """One forward through the cache -> logits [B, t (1 if last_only), V or Vd]."""
        kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                      past_key_values=self.cache, use_cache=True,
                      output_hidden_states=self.keep_hidden_states)
        if self.head is None:
            out = self.model(**kwargs, logits_to_keep=1 if last_only else 0)
            self.hidden_states = out.hidden_states
            return out.logits
        out = self.model.get_decoder()(**kwargs)
        self.hidden_states = out.hidden_states
        hidden = out.last_hidden_state[:, -1:] if last_only else out.last_hidden_state
        if isinstance(self.head, nn.Linear):  # quantised layers take any dtype
            hidden = hidden.to(self.head.weight.dtype)
        return self.head(hidden)

    @torch.no_grad()
    def extend(self, tokens: torch.Tensor, valid: torch.Tensor,
               last_only: bool = False) -> torch.Tensor:
        """Append slots: tokens [B, t], valid bool [B, t] (False = a hole) -> logits
        [B, t (1 if last_only), V] (or Vd with a vocabulary)."""
        valid = valid.long()
        positions = self.next_position[:, None] + (valid.cumsum(1) - valid)  # [B, t]
        self.mask = torch.cat([self.mask, valid], dim=1)
        logits = self._forward(tokens, self.mask, positions, last_only)
        self.next_position = self.next_position + valid.sum(1)
        return logits

    def reject_last(self, num_rejected: torch.Tensor) -> None:
        """Drop each row's last num_rejected [B] slots: the slots every row rejects are cut from
        the cache (all of them at batch 1), the rest become holes."""
        self.next_position = self.next_position - num_rejected
        common = int(num_rejected.min())
        if common:
            self.cache.crop(-common)
            self.mask = self.mask[:, :-common]
            num_rejected = num_rejected - common
        width = int(num_rejected.max())
        if width == 0:
            return
        tail = torch.arange(width, 0, -1, device=num_rejected.device)  # [w]: w, ..., 1
        drop = tail[None, :] <= num_rejected[:, None]  # [B, w] True for the last n slots
        self.mask[:, -width:] = self.mask[:, -width:] * (~drop)

    @torch.no_grad()
    def extend_tree(self, tokens: torch.Tensor, depth: torch.Tensor,
                    seen: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Append a token tree: tokens, depth [B, N], seen [B, N, N] (decoding.tree.ancestor_mask:
        node i attends to node j), valid [B, N] -> logits [B, N, V]. Node i sits at position
        next_position + depth[i] and attends to the cache's real tokens and its own ancestors.
        Until keep_nodes, the tree's slots are in the cache but not counted as positions."""
        batch, size = tokens.shape
        positions = self.next_position[:, None] + depth  # [B, N]
        seen = seen & valid[:, None, :]
        seen = seen | torch.eye(size, dtype=torch.bool, device=tokens.device)  # padding sees itself
        old = self.mask.bool()[:, None, :].expand(batch, size, -1)  # [B, N, L]
        attend = torch.cat([old, seen], dim=2)[:, None]  # [B, 1, N, L + N]
        self.mask = torch.cat([self.mask, valid.long()], dim=1)
        return self._forward(tokens, attend, positions)

    def drop_tree(self, size: int) -> None:
        """After extend_tree: remove the tree's `size` slots (a draft's expansion, kept nowhere)."""
        self.cache.crop(-size)
        self.mask = self.mask[:, :-size]

    def keep_nodes(self, keep: torch.Tensor) -> None:
        """After extend_tree: keep [B, N] bool, the nodes of each row's accepted path (its root
        included), which must be in depth order. They move to the front of the tree's slots and
        count as positions; the rest become holes, and the slots no row kept are cut."""
        size = keep.shape[1]
        order = torch.argsort((~keep).long(), dim=1, stable=True)  # [B, N] kept slots first
        width = int(keep.sum(1).max())
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                tail = getattr(layer, name)[:, :, -size:]  # [B, H, N, D]
                index = order[:, None, :, None].expand(-1, tail.shape[1], -1, tail.shape[3])
                setattr(layer, name, torch.cat([getattr(layer, name)[:, :, :-size],
                                                tail.gather(2, index)[:, :, :width]], dim=2))
        kept = keep.gather(1, order)[:, :width].long()  # [B, width]
        self.mask = torch.cat([self.mask[:, :-size], kept], dim=1)
        self.next_position = self.next_position + kept.sum(1)
