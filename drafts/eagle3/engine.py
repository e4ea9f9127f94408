"""The EAGLE-3 head in the engine: it proposes a chain of k from the target's features of the
last verification and keeps its own KV cache of the verified tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from decoding.speculative import draw, sampling_probs
from decoding.tree import grow_tree
from drafts.eagle3.head import Eagle3Head, repeat_kv
from drafts.kind import aux_features


class HeadCache:
    """The head's own KV cache with a slot mask [B, L] (holes for rejected slots, as in
    serving/kv.py) and each row's next position [B]."""

    def __init__(self, batch: int, head: Eagle3Head, device):
        attn = head.midlayer.self_attn
        shape = (batch, attn.num_kv_heads, 0, attn.head_dim)
        dtype = head.fc.weight.dtype
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.mask = torch.zeros(batch, 0, dtype=torch.bool, device=device)
        self.next_position = torch.zeros(batch, dtype=torch.long, device=device)

    def run(self, head: Eagle3Head, embeds, hidden, valid) -> torch.Tensor:
        """Append slots: embeds, hidden [B, t, H], valid [B, t] bool -> pre-norm outputs
        [B, t, H]."""
        t = valid.shape[1]
        steps = valid.long()
        positions = self.next_position[:, None] + steps.cumsum(1) - steps  # [B, t]
        q, k, v, residual = head.project(embeds, hidden, positions)
        self.keys = torch.cat([self.keys, k], dim=2)
        self.values = torch.cat([self.values, v], dim=2)
        self.mask = torch.cat([self.mask, valid], dim=1)
        length = self.mask.shape[1]
        slot = torch.arange(length, device=valid.device)
        query_slot = torch.arange(length - t, length, device=valid.device)
        allowed = (slot[None, :] <= query_slot[:, None])[None] & self.mask[:, None, :]  # [B,t,L]
        allowed = allowed | (slot[None, :] == query_slot[:, None])[None]  # a hole sees itself
        attended = F.scaled_dot_product_attention(
            q, repeat_kv(self.keys, head.groups), repeat_kv(self.values, head.groups),
            attn_mask=allowed[:, None])
        self.next_position = self.next_position + steps.sum(1)
        return head.finish(attended, residual)

    def run_tree(self, head: Eagle3Head, embeds, hidden, depth, sees) -> torch.Tensor:
        """Append m draft-tree slots: embeds, hidden [B, m, H], depth [B, m] (1: a child of the
        pending token), sees [B, m, S] bool: which of the S tree slots appended since the last
        crop (these m the last ones) each attends, its ancestors and itself; every committed
        slot is seen. Positions are next_position + depth - 1, and next_position stays: the
        tree's slots are dropped with crop(S, valid=False) -> pre-norm outputs [B, m, H]."""
        m, tree_slots = depth.shape[1], sees.shape[2]
        q, k, v, residual = head.project(embeds, hidden, self.next_position[:, None] + depth - 1)
        self.keys = torch.cat([self.keys, k], dim=2)
        self.values = torch.cat([self.values, v], dim=2)
        self.mask = torch.cat([self.mask, torch.ones_like(depth, dtype=torch.bool)], dim=1)
        committed = self.mask[:, None, :-tree_slots].expand(-1, m, -1)  # [B, m, L - S]
        allowed = torch.cat([committed, sees], dim=2)  # [B, m, L]
        attended = F.scaled_dot_product_attention(
            q, repeat_kv(self.keys, head.groups), repeat_kv(self.values, head.groups),
            attn_mask=allowed[:, None])
        return head.finish(attended, residual)

    def crop(self, n: int, valid: bool = True) -> None:
        """Drop the last n slots of every row (valid: they counted as positions)."""
        if n <= 0:
            return
        if valid:
            self.next_position = self.next_position - self.mask[:, -n:].sum(1)
        self.keys, self.values = self.keys[:, :, :-n], self.values[:, :, :-n]
        self.mask = self.mask[:, :-n]


@dataclass
class Eagle3Model:
    """A loaded head with the target embedding it reads tokens through."""

    head: Eagle3Head
    embedding: nn.Module


class Eagle3Draft:
    """The engine's draft: the head proposes a chain of k from the target's features of the
    last verification, keeping its own KV cache of the verified tokens."""

    uses_target_hidden = True
    scores, failures = None, None  # scores: set by propose

    def __init__(self, head: Eagle3Head, embedding: nn.Module, name: str = "eagle3"):
        self.head, self.embed, self.name = head, embedding, name

    def _features(self, target_hidden) -> torch.Tensor:
        return self.head.fc(aux_features(target_hidden, self.head.aux_layers).to(
            self.head.fc.weight.dtype))

    def _embeds(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens).to(self.head.fc.weight.dtype)

    def start(self, input_ids, attention_mask, first_token, target_hidden=None):
        batch = input_ids.shape[0]
        self.cache = HeadCache(batch, self.head, input_ids.device)
        following = torch.cat([input_ids[:, 1:], first_token[:, None]], dim=1)  # x_{t+1}
        out = self.cache.run(self.head, self._embeds(following), self._features(target_hidden),
                             attention_mask.bool())
        self.hidden = out[:, -1]  # [B, H] left padding: the last slot is every row's last token
        self.chain = 0

    def propose(self, k, sampling, history, generator=None):
        tokens, probs, scores, hidden = [], [], [], self.hidden
        for i in range(k):
            logits = self.head.full_vocab_logits(self.head.logits(hidden))  # [B, V]
            q = sampling_probs(logits, sampling.temperature, sampling.top_p, sampling.top_k)
            token = draw(q, sampling.temperature, generator)  # [B] target ids
            tokens.append(token)
            probs.append(q)
            scores.append(logits)
            if i < k - 1:
                hidden = self.cache.run(self.head, self._embeds(token[:, None]), hidden[:, None],
                                        torch.ones_like(token[:, None], dtype=torch.bool))[:, 0]
        self.chain = k - 1  # slots to drop once the target has verified
        self.tokens = torch.stack(tokens, 1)  # [B, k]
        self.scores = torch.stack(scores, 1)  # [B, k, V]
        return self.tokens, torch.stack(probs, 1)  # [B, k], [B, k, V]

    def propose_tree(self, k: int, width: int, generator=None):
        """EAGLE-2's expansion (decoding.tree.grow_tree) with tree attention inside the head's
        cache: a frontier node enters the head with the output that proposed it, at position
        next + depth - 1, seeing the committed slots, its expanded ancestors and itself. The
        tree's slots are dropped before returning. Deterministic: every candidate is verified
        as a fixed one, so sampling stays lossless."""
        (batch, hidden_size), device = self.hidden.shape, self.hidden.device
        committed = self.cache.mask.shape[1]
        state = {"slot": torch.zeros(batch, 0, dtype=torch.long, device=device),  # [B, M]
                 "ancestors": torch.zeros(batch, 0, 0, dtype=torch.bool, device=device),
                 "out": torch.zeros(batch, 0, hidden_size, dtype=self.hidden.dtype,
                                    device=device)}  # each expanded slot's output [B, S, H]

        def logp(prenorm):  # [B, n, H] -> [B, n, V]
            return torch.log_softmax(self.head.full_vocab_logits(
                self.head.logits(prenorm)).float(), dim=-1)

        def expand(frontier, tokens, parents):
            s, w = state["ancestors"].shape[1], frontier.shape[1]
            slot = torch.cat([state["slot"], state["slot"].new_full(
                (batch, tokens.shape[1] - state["slot"].shape[1]), -1)], dim=1)  # [B, M]
            parent = parents.gather(1, frontier)  # [B, w]
            parent_slot = slot.gather(1, parent.clamp(min=0)).clamp(min=0)  # [B, w]
            has_parent = (parent >= 0)[..., None]
            inherited = state["ancestors"].gather(1, parent_slot[..., None].expand(-1, -1, s))
            sees = torch.cat([inherited & has_parent, torch.eye(w, dtype=torch.bool, device=device)
                              .expand(batch, -1, -1)], dim=2)  # [B, w, S + w]
            root = self.hidden[:, None].expand(-1, w, -1)  # what proposed the root's children
            made_by = root if s == 0 else torch.where(has_parent, state["out"].gather(
                1, parent_slot[..., None].expand(-1, -1, hidden_size)), root)
            depth = torch.full_like(frontier, s // w + 1)  # w slots per earlier expansion
            prenorm = self.cache.run_tree(self.head, self._embeds(tokens.gather(1, frontier)),
                                          made_by, depth, sees)  # [B, w, H]
            state["ancestors"] = torch.cat([torch.cat(
                [state["ancestors"], state["ancestors"].new_zeros(batch, s, w)], 2), sees], 1)
            state["slot"] = slot.scatter(1, frontier, s + torch.arange(w, device=device)
                                         .expand(batch, -1))
            state["out"] = torch.cat([state["out"], prenorm], dim=1)
            return logp(prenorm)

        candidates = grow_tree(logp(self.hidden), k, width, expand)
        self.cache.crop(self.cache.mask.shape[1] - committed, valid=False)
        self.chain = 0  # nothing of the tree stays in the cache
        self.tokens = torch.zeros(batch, k, dtype=torch.long, device=device)  # accept's shape
        return candidates

    def accept(self, num_accepted, next_token, target_hidden=None, path=None):
        """Replace the chain's slots by the verified tokens' slots, made from the target's
        features: slot i of the chunk [pending, d_1..d_k] reads d_{i+1} (i < n) or next_token
        (i = n); slots past n are holes. A tree's path replaces d."""
        self.cache.crop(self.chain)
        batch, k = self.tokens.shape
        rows = torch.arange(batch, device=next_token.device)
        accepted = self.tokens if path is None else path  # [B, k]
        following = torch.cat([accepted, next_token[:, None]], dim=1)  # [B, k+1]
        following[rows, num_accepted] = next_token
        valid = torch.arange(k + 1, device=next_token.device)[None] <= num_accepted[:, None]
        out = self.cache.run(self.head, self._embeds(following), self._features(target_hidden),
                             valid)
        self.hidden = out[rows, num_accepted]  # [B, H]
        self.cache.crop(k - int(num_accepted.max()), valid=False)  # holes every row has
