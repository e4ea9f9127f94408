"""What the loop trains: an independent draft LM, or Medusa / EAGLE-3 heads on the frozen
target's features.

Both are nn.Modules whose forward returns draft logits [M, V] only where a loss applies (DDP,
FSDP and DeepSpeed wrap that forward), and both say, with `slots(pred_mask)`, which of the batch's
N loss positions those M rows are scored against and which draft position they serve. The loop
then needs no branch per draft kind: target logits [N, V] and labels [N] are indexed by the
slots, the loss is weighted per slot, and predicted acceptance fills a [B, T, k] grid from them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from serving.eagle3 import Eagle3Head, draft_index, unroll
from serving.medusa import MedusaHeads


@dataclass
class TargetHidden:
    """What the frozen target computed for a batch, as the draft kinds need it."""

    last: torch.Tensor
    """[B, T, H] the post-norm last hidden state (the target's logits are its lm_head of it)."""
    aux: torch.Tensor | None = None
    """[B, T, 3H] EAGLE-3's aux layers, concatenated in layer order."""
    embeds: torch.Tensor | None = None
    """[B, T, H] the target's embedding of each input token (EAGLE-3)."""


class SameVocabulary:
    """Drafts that predict over the target's own vocabulary: nothing to map."""

    def restrict(self, target_logits, labels):
        """Target logits [N, V] and labels [N] -> what the draft's [M, Vd] rows are scored against."""
        return target_logits, labels

    def expand(self, draft_logits):
        """Draft logits [M, Vd] -> [M, V] over the target's vocabulary (for acceptance)."""
        return draft_logits


@dataclass
class Slot:
    """A run of draft logits scored against some of the batch's N loss positions."""

    count: int
    """Rows of the draft's output [M, V] that belong to this slot (consecutive, in order)."""
    rows: torch.Tensor | None
    """[count] indices into the N loss positions (row-major over pred_mask): the target's
    distribution and the label each row is scored against. None: all N, in order."""
    starts: torch.Tensor | None
    """[count, 2] (row b, position s) of the chain start each row serves: the position whose
    hidden state the draft read. None: an autoregressive draft, which serves every position."""
    position: int | None
    """Draft position j (1-based) in a chain of k; None: every position."""
    weight: float = 1.0

    def pick(self, per_loss_position: torch.Tensor | None) -> torch.Tensor | None:
        """The rows of a tensor over the N loss positions ([N, ...]: target logits, labels)
        that this slot's draft rows are scored against -> [count, ...]."""
        if per_loss_position is None or self.rows is None:
            return per_loss_position
        return per_loss_position[self.rows]


class DraftForTraining(SameVocabulary, nn.Module):
    """An independent draft LM: logits only at the N loss positions, [B, T] in, [N, V] out. Over a
    49k vocabulary the head is the largest matmul, and most positions of a conversation (the
    prompts) carry no loss."""

    needs_target_hidden = False

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        self._no_split_modules = getattr(lm, "_no_split_modules", None)  # FSDP auto-wrap units

    def slots(self, pred_mask: torch.Tensor) -> list[Slot]:
        return [Slot(int(pred_mask.sum()), None, None, None)]

    def forward(self, input_ids, attention_mask, pred_mask, target_hidden=None):
        hidden = self.lm.get_decoder()(input_ids=input_ids,
                                       attention_mask=attention_mask).last_hidden_state
        return self.lm.get_output_embeddings()(hidden[pred_mask])  # [N, V]


def medusa_slots(pred_mask: torch.Tensor, num_heads: int, decay: float) -> list[Slot]:
    """Head j (1-based) reads the target's hidden state h_s and predicts x_{s+1+j}: it is scored
    against the target's distribution at s + j, which must be a loss position. pred_mask [B, T]
    -> one slot per head, weighted decay**(j-1)."""
    loss_positions = pred_mask.nonzero()  # [N, 2] (b, t), row-major like boolean indexing
    slots = []
    for j in range(1, num_heads + 1):
        keep = loss_positions[:, 1] >= j  # the start s = t - j must exist
        rows = keep.nonzero()[:, 0]  # [n_j]
        starts = loss_positions[rows] - torch.tensor([0, j], device=pred_mask.device)  # [n_j, 2]
        slots.append(Slot(len(rows), rows, starts, j, decay ** (j - 1)))
    return slots


class MedusaForTraining(SameVocabulary, nn.Module):
    """Medusa heads on the frozen target's post-norm last hidden state [B, T, H]: for each head
    its logits at the starts medusa_slots gives, concatenated -> [M, V]."""

    needs_target_hidden = True

    def __init__(self, heads: MedusaHeads, decay: float):
        super().__init__()
        self.lm, self.decay = heads, decay  # `lm`: the trained module, as for DraftForTraining

    def slots(self, pred_mask: torch.Tensor) -> list[Slot]:
        return medusa_slots(pred_mask, self.lm.num_heads, self.decay)

    def forward(self, input_ids, attention_mask, pred_mask, target_hidden=None):
        dtype = self.lm.lm_heads[0].weight.dtype
        logits = [self.lm.head_logits(slot.position - 1,
                                      target_hidden.last[slot.starts[:, 0],
                                                         slot.starts[:, 1]].to(dtype))
                  for slot in self.slots(pred_mask)]
        return torch.cat(logits)  # [M, V]


class Eagle3ForTraining(nn.Module):
    """An EAGLE-3 head under the training-time test: `steps` unrolled draft steps, step j's
    output at start s scored as draft position j+1 against the target at s + j + 1 (the slots of
    medusa_slots), over the draft vocabulary.

    The loss compares the draft with the target's distribution restricted to the draft
    vocabulary and renormalised there (softmax of the target's logits at those Vd ids), and CE
    labels outside the draft vocabulary are ignored; predicted acceptance compares the draft,
    placed in the target's vocabulary, with the target's full distribution, as serving does."""

    needs_target_hidden = True

    def __init__(self, head: Eagle3Head, steps: int, decay: float):
        super().__init__()
        self.lm, self.steps, self.decay = head, steps, decay

    def slots(self, pred_mask: torch.Tensor) -> list[Slot]:
        return medusa_slots(pred_mask, self.steps, self.decay)

    def forward(self, input_ids, attention_mask, pred_mask, target_hidden=None):
        dtype = self.lm.fc.weight.dtype
        outputs = unroll(self.lm, target_hidden.embeds.to(dtype), target_hidden.aux.to(dtype),
                         attention_mask, self.steps)  # steps x [B, T, H]
        return torch.cat([self.lm.logits(outputs[s.position - 1][s.starts[:, 0], s.starts[:, 1]])
                          for s in self.slots(pred_mask)])  # [M, Vd]

    def restrict(self, target_logits, labels):
        ids = self.lm.draft_to_target
        index = draft_index(self.lm.d2t, self.lm.vocab_size)
        restricted = None if target_logits is None else target_logits[:, ids]  # [N, Vd]
        return restricted, index[labels]  # labels outside the draft vocabulary -> IGNORE

    def expand(self, draft_logits):
        return self.lm.full_vocab_logits(draft_logits)



def split(draft_logits: torch.Tensor, slots: list[Slot]) -> list[torch.Tensor]:
    """[M, V] -> one [count, V] per slot."""
    return list(draft_logits.split([s.count for s in slots]))


def acceptance_grid(values: list[torch.Tensor], slots: list[Slot], pred_mask: torch.Tensor,
                    k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row acceptance probabilities (one [count] per slot) -> a [B, T, k] grid and its valid
    mask: grid[b, s, j-1] = acceptance of draft position j in a chain that starts after position
    s, scored against the target at s + j. An autoregressive draft's value at loss position t
    serves every j (as position j of the chain starting at t - j)."""
    batch, length = pred_mask.shape
    grid = torch.zeros(batch, length, k, dtype=torch.float64, device=pred_mask.device)
    valid = torch.zeros(batch, length, k, dtype=torch.bool, device=pred_mask.device)
    for a, slot in zip(values, slots):
        if slot.position is None:
            per_position = torch.zeros(batch, length, dtype=torch.float64, device=a.device)
            per_position[pred_mask] = a.double()
            for j in range(1, min(k, length - 1) + 1):
                grid[:, : length - j, j - 1] = per_position[:, j:]
                valid[:, : length - j, j - 1] = pred_mask[:, j:]
        elif slot.position <= k:
            grid[slot.starts[:, 0], slot.starts[:, 1], slot.position - 1] = a.double()
            valid[slot.starts[:, 0], slot.starts[:, 1], slot.position - 1] = True
    return grid, valid
