"""Training an EAGLE-3 head: the training-time test (the head fed its own outputs for
train.eagle3.ttt_steps steps, with the attention it has in serving) and the module the loop
trains."""

from __future__ import annotations

import torch
from torch import nn

from drafts.eagle3.head import Eagle3Head, draft_index, repeat_kv
from drafts.kind import LossRows, TargetHidden, chain_loss_rows


def shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """[B, T, ...] -> x[:, n:] padded with zeros at the end to length T."""
    out = torch.zeros_like(x)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                  mask: torch.Tensor, groups: int) -> torch.Tensor:
    """Attention of training-time-test step j = len(keys) - 1.

    Query t of step j (draft token j+1 of the chain that starts after position t) sees what the
    head's cache holds in serving at that point: step 0's entries at positions <= t (made from
    the target's features) and its own earlier steps' entries for the same chain, i.e. step i's
    entry at the same index t, i = 1..j. q [B, n, T, d]; keys, values: j+1 of [B, kv, T, d];
    mask [B, 1, T, T] bool (causal and padding) -> [B, n, T, d]."""
    scale = q.shape[-1] ** -0.5
    k0, v0 = repeat_kv(keys[0], groups), repeat_kv(values[0], groups)
    scores = [(q @ k0.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))]  # [B,n,T,T]
    for k in keys[1:]:
        scores.append((q * repeat_kv(k, groups)).sum(-1, keepdim=True) * scale)  # [B, n, T, 1]
    probs = torch.softmax(torch.cat(scores, -1).float(), dim=-1).to(q.dtype)
    length = k0.shape[2]
    out = probs[..., :length] @ v0
    for i, v in enumerate(values[1:]):
        out = out + probs[..., length + i : length + i + 1] * repeat_kv(v, groups)
    return out


def unroll(head: Eagle3Head, embeds: torch.Tensor, aux: torch.Tensor,
           attention_mask: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The training-time test: `steps` draft steps over a right-padded batch.

    embeds [B, T, H] (the target's embedding of each token), aux [B, T, 3H] (the target's aux
    features), attention_mask [B, T] -> one pre-norm output [B, T, H] per step. Step j at index t
    reads the embedding of x_{t+1+j} and step j-1's output at t (head.feedback of it; step 0:
    head.features(aux_t)), sits at
    position t + j, and predicts x_{t+2+j}. Each of the head's layers keeps its own keys and
    values per step, attended with the same masks."""
    batch, length, _ = embeds.shape
    positions = torch.arange(length, device=embeds.device).expand(batch, length)
    causal = torch.ones(length, length, dtype=torch.bool, device=embeds.device).tril()
    mask = causal[None, None] & attention_mask.bool()[:, None, None, :]  # [B, 1, T, T]
    hidden = head.features(aux)
    keys, values = [[] for _ in range(head.num_layers)], [[] for _ in range(head.num_layers)]
    outputs = []
    for j in range(steps):
        embeds_j = shift_left(embeds, 1 + j)
        for i in range(head.num_layers):
            q, k, v, residual = head.project(embeds_j, hidden, positions + j, index=i)
            keys[i].append(k)
            values[i].append(v)
            hidden = head.finish(ttt_attention(q, keys[i], values[i], mask, head.groups),
                                 residual, index=i)
        outputs.append(hidden)
        hidden = head.feedback(hidden)  # what step j + 1 reads
    return outputs


class Eagle3ForTraining(nn.Module):
    """An EAGLE-3 head under the training-time test: `steps` unrolled draft steps, step j's
    output at start s scored as draft position j+1 against the target at s + j + 1 (the rows of
    chain_loss_rows), over the draft vocabulary.

    The loss compares the draft with the target's distribution restricted to the draft
    vocabulary and renormalised there (softmax of the target's logits at those Vd ids), and CE
    labels outside the draft vocabulary are ignored; predicted acceptance compares the draft,
    placed in the target's vocabulary, with the target's full distribution, as serving does."""

    needs_target_hidden = True

    def __init__(self, head: Eagle3Head, steps: int, decay: float):
        super().__init__()
        self.lm, self.steps, self.decay = head, steps, decay
        self.aux_layers = head.aux_layers

    def loss_rows(self, pred_mask: torch.Tensor) -> list[LossRows]:
        return chain_loss_rows(pred_mask, self.steps, self.decay)

    def forward(self, input_ids, attention_mask, pred_mask,
                target_hidden: TargetHidden | None = None):
        dtype = self.lm.fc.weight.dtype
        outputs = unroll(self.lm, target_hidden.embeds.to(dtype), target_hidden.aux.to(dtype),
                         attention_mask, self.steps)  # steps x [B, T, H]
        return torch.cat([self.lm.logits(outputs[s.position - 1][s.starts[:, 0], s.starts[:, 1]])
                          for s in self.loss_rows(pred_mask)])  # [M, Vd]

    @property
    def target_rows(self) -> torch.Tensor:
        return self.lm.draft_to_target  # [Vd]

    def restrict(self, target_logits, labels):
        index = draft_index(self.lm.d2t, self.lm.vocab_size)
        restricted = target_logits  # [N, Vd], or [N, V] to restrict here
        if target_logits is not None and target_logits.shape[-1] != self.lm.draft_vocab_size:
            restricted = target_logits[:, self.lm.draft_to_target]
        return restricted, index[labels]  # labels outside the draft vocabulary -> IGNORE

    def expand(self, draft_logits):
        return self.lm.full_vocab_logits(draft_logits)
