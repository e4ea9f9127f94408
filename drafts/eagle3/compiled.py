"""The EAGLE-3 head's drafting and settling as static-shape functions for torch.compile
(eval.draft_compile).

Eager, a drafted token costs some hundred small operator calls (norms, rotary, views, casts,
cache writes, masks) around five matrix products; on a CPU that dispatch and the Python
between the calls take about half of an int8 head's step at k=4 (docs/scaling-and-hardware.md).
Compiled with inductor's C++ wrapper, the calls between the products fuse into a few kernels
run from C++. To compile once and run every step, the functions see the head's cache as its
whole buffers (HeadCache's SlotKV: keys, values [B, kv, capacity, d] per layer, slot mask
[B, capacity])
and the slots in use as a tensor, so their shapes do not change from one token to the next;
the capacity, which doubles as a generation grows, is a dynamic dimension. Drafted tokens write
their slots in place; slots at or past the end of the cache are masked out, whatever stale
values they hold.

A chain of k is one compiled call (one per k: k is a constant of its code, and each k runs
a copy of the chain's code of its own, guarded on its arguments only: drafts/fused.py):
`token` drafts one greedy token and runs it through the layer, k - 1 times, then `last` gives
the k-th token's logits; `settle` is HeadCache.run for the verified chunk (accept). The arithmetic
is FusedLayer's; inductor may fuse and round differently from eager, so the drafted tokens
can differ from the eager head's in a near tie: verification reads the draft's own logits as
they are, so decoding stays lossless either way.
"""

from __future__ import annotations

import torch
from torch import nn

from drafts.eagle3.head import attend
from drafts.fused import CompiledSteps, mark_capacity_dynamic


class CompiledHead:
    """A FusedLayer's chains and settling, compiled (one per FusedLayer: Eagle3Draft keeps them
    with the layer, so every engine run of a loaded head reuses the compiled code)."""

    def __init__(self, layer, embedding: nn.Module, fc: nn.Module, dtype: torch.dtype,
                 device: torch.device):
        self.layer, self.embedding, self.fc, self.dtype = layer, embedding, fc, dtype
        self.steps = CompiledSteps(device, "the EAGLE-3 head's")
        # fixed: the layer, embedding and fc never change under a CompiledHead (Eagle3Draft
        # makes a new one when the head's weights do), so only the arguments are guarded
        self.steps.add("settle", self._settle, fixed=True)  # and "chain <k>" once used

    def propose(self, cache, hidden: torch.Tensor, draft_ids: torch.Tensor, k: int):
        """A greedy chain of k from hidden [B, H] (Eagle3Draft.propose at temperature 0): its
        first k - 1 tokens enter cache (a HeadCache) -> tokens [B, k] (target ids), logits
        [B, k, Vd]."""
        slots = cache.slots
        slots.reserve(k - 1)
        positions = cache.next_position[:, None] + torch.arange(k - 1, device=hidden.device)
        cos, sin = self.layer.cos_sin(self.fc.weight, positions, slots.length + k)
        name = f"chain {k}"  # one compiled call a chain, its code its own: k is its constant
        if name not in self.steps:
            self.steps.add(name, self._chain, fixed=True)
        out = self.steps(name, hidden, draft_ids, *self._buffers(slots),
                         self._slot(slots.length, hidden), cos, sin)
        slots.length += k - 1
        cache.next_position = cache.next_position + k - 1
        return out

    def _chain(self, hidden, draft_ids, keys, values, mask, length, cos, sin):
        """The chain of k as one function, k - 1 the rotary's positions (cos, sin [B, 1, k - 1,
        d]: a static shape, so each k compiles its own unrolled code): k - 1 tokens through
        the layers, then the last token's logits -> tokens [B, k], logits [B, k, Vd]."""
        tokens, logits = [], []
        for i in range(cos.shape[2]):
            token, scores, hidden = self._token(hidden, draft_ids, keys, values, mask,
                                                length + i, cos[:, :, i:i + 1],
                                                sin[:, :, i:i + 1])
            tokens.append(token)
            logits.append(scores)
        token, scores = self._last(hidden, draft_ids)
        return torch.stack(tokens + [token], 1), torch.stack(logits + [scores], 1)

    def run(self, cache, tokens: torch.Tensor, target_features: torch.Tensor,
            valid: torch.Tensor) -> torch.Tensor:
        """HeadCache.run for tokens [B, t] with the target's aux features [B, t, 3H] (the
        head's fc inside), valid [B, t] bool -> pre-norm outputs [B, t, H]."""
        slots, t = cache.slots, tokens.shape[1]
        slots.reserve(t)
        steps = valid.long()
        positions = cache.next_position[:, None] + steps.cumsum(1) - steps  # [B, t]
        cos, sin = self.layer.cos_sin(self.fc.weight, positions, slots.length + t)
        out = self.steps("settle", tokens, target_features, valid, *self._buffers(slots),
                         self._slot(slots.length, tokens), cos, sin)
        slots.length += t
        cache.next_position = cache.next_position + steps.sum(1)
        return out

    @staticmethod
    def _buffers(slots):
        """The cache's whole buffers (keys, values: a list over the head's layers), their
        capacity a dynamic dimension."""
        keys, values = ([slots.buffers(i)[j] for i in range(slots.layers)] for j in (0, 1))
        mask = slots.buffers()[2]
        mark_capacity_dynamic(keys, values, mask)
        return keys, values, mask

    @staticmethod
    def _slot(index: int, like: torch.Tensor) -> torch.Tensor:
        return torch.tensor(index, dtype=torch.long, device=like.device)

    def _layers(self, embeds, hidden, keys, values, slots, allowed, cos, sin):
        """New slots [t] (their mask already written) through every layer: embeds, hidden
        [B, t, H], allowed [B, t, C]; layer i's k, v enter its buffers at the slots, in place,
        before its queries read them -> the last layer's pre-norm outputs [B, t, H]."""
        for i in range(self.layer.num_layers):
            q, k, v = self.layer.project_rotated(embeds, hidden, cos, sin, i)
            keys[i].index_copy_(2, slots, k)
            values[i].index_copy_(2, slots, v)
            hidden = self.layer.finish(attend(q, keys[i], values[i], allowed, self.layer.groups),
                                       hidden, i)
        return hidden

    def _last(self, hidden, draft_ids):
        """hidden [B, H] -> the greedy token [B] (target ids) and its logits [B, Vd]."""
        logits = self.layer.logits(hidden)
        return draft_ids[logits.argmax(-1)], logits

    def _token(self, hidden, draft_ids, keys, values, mask, length, cos, sin):
        """One drafted token: hidden [B, H] proposes it greedily; it enters the cache at slot
        length ([] long; buffers as HeadCache's, written in place) with rotary cos, sin
        [B, 1, 1, d] at its position, seeing every kept slot and itself -> token [B], logits
        [B, Vd], the layer's pre-norm output for it [B, H]."""
        token, logits = self._last(hidden, draft_ids)
        embeds = self.embedding(token[:, None]).to(self.dtype)  # [B, 1, H]
        slot = length[None]
        live = torch.arange(mask.shape[1], device=mask.device) <= length  # [C]
        mask.index_copy_(1, slot, mask.new_ones(len(token), 1))
        allowed = (mask & live)[:, None]  # [B, 1, C]
        out = self._layers(embeds, self.layer.feedback(hidden)[:, None], keys, values, slot,
                           allowed, cos, sin)
        return token, logits, out[:, 0]

    def _settle(self, tokens, features, valid, keys, values, mask, length, cos, sin):
        """HeadCache.run's static form: tokens [B, t] enter slots length .. length + t - 1 with
        the target's aux features [B, t, 3H] (fc inside), valid [B, t], rotary cos, sin
        [B, 1, t, d] at their positions; a slot sees the kept slots before it and itself ->
        pre-norm outputs [B, t, H]."""
        hidden = self.layer.features(features.to(self.dtype))
        embeds = self.embedding(tokens).to(self.dtype)
        t = tokens.shape[1]
        slots = length + torch.arange(t, device=tokens.device)  # [t]
        every = torch.arange(mask.shape[1], device=mask.device)  # [C]
        before = every[None, :] <= slots[:, None]  # [t, C]: a slot's past and itself
        mask.index_copy_(1, slots, valid)
        allowed = (before[None] & mask[:, None, :]) | (every[None, :] == slots[:, None])[None]
        return self._layers(embeds, hidden, keys, values, slots, allowed, cos, sin)
