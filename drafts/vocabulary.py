"""A draft's own vocabulary: the most frequent label tokens of the training conversations. A
draft that scores only these (EAGLE-3's d2t, train.draft_vocab_size for an independent draft)
spends its head's arithmetic on them alone; its distribution is zero on every other token,
which verification handles like any other q, so decoding stays lossless."""

from __future__ import annotations

import torch

from recipe import ConfigError

IGNORE = -100  # a label outside the draft vocabulary (F.cross_entropy's ignore_index)


def most_frequent_ids(counts: torch.Tensor, size: int) -> torch.Tensor:
    """counts [V] -> the `size` most frequent target ids (ties: the lower id), sorted: [Vd]."""
    vocab = counts.shape[0]
    if not 1 <= size <= vocab:
        raise ConfigError(f"train.draft_vocab_size={size} must be in [1, {vocab}] (the target's "
                          "vocabulary).")
    ids = torch.arange(vocab)
    order = torch.argsort(counts.double() * (vocab + 1) - ids.double(), descending=True,
                          stable=True)
    return order[:size].sort().values


def label_counts(examples, vocab_size: int) -> torch.Tensor:
    """How often each target token is a label (a loss position's token) -> [V] int64."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for e in examples:
        labels = torch.tensor(e.input_ids)[torch.tensor(e.loss_mask, dtype=torch.bool)]
        counts += torch.bincount(labels, minlength=vocab_size)
    return counts


def frequent_labels(examples, vocab_size: int, size: int) -> tuple[torch.Tensor, float]:
    """The `size` most frequent labels of the examples, sorted [Vd], and the share of all
    labels they cover."""
    if size > vocab_size:
        raise ConfigError(f"train.draft_vocab_size={size} is larger than the target's "
                          f"vocabulary ({vocab_size} tokens): set it to at most {vocab_size}.")
    counts = label_counts(examples, vocab_size)
    ids = most_frequent_ids(counts, size)
    return ids, _shares(counts, ids)[0]


def label_share(examples, ids: torch.Tensor, vocab_size: int) -> tuple[float, int]:
    """The share of the examples' labels that are among target ids [Vd] (a target token outside
    a draft vocabulary is never drafted, so this bounds alpha_1), and how many of the ids are
    labels there at all."""
    return _shares(label_counts(examples, vocab_size), ids.long().cpu())


def _shares(counts: torch.Tensor, ids: torch.Tensor) -> tuple[float, int]:
    """Label counts [V], target ids [Vd] -> (their share of all labels, how many have a label)."""
    return float(counts[ids].sum()) / max(1, int(counts.sum())), int((counts[ids] > 0).sum())


def vocabulary_line(train, held_out, ids: torch.Tensor, vocab_size: int) -> str:
    """What a draft vocabulary holds of the training and held-out labels, for the train log."""
    share, seen = label_share(train, ids, vocab_size)
    line = (f"the draft vocabulary ({len(ids)} tokens) holds {100 * share:.2f} % of the training "
            f"labels")
    if seen < len(ids):
        line += (f"; {len(ids) - seen} of its tokens are never a training label (ties, "
                 "filled by the lowest token id)")
    if held_out:
        line += (f"; {100 * label_share(held_out, ids, vocab_size)[0]:.2f} % of the held-out "
                 "labels (a token outside it is never drafted)")
    return line


def scatter(draft_values: torch.Tensor, ids: torch.Tensor, vocab_size: int,
            fill: float) -> torch.Tensor:
    """Values over a draft vocabulary [..., Vd] at target ids [Vd] -> [..., V], `fill` on the
    other tokens (-inf for logits, 0 for probabilities)."""
    full = draft_values.new_full((*draft_values.shape[:-1], vocab_size), fill)
    return full.index_copy(-1, ids, draft_values)


def logits_on_rows(head: torch.nn.Linear, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """An lm_head's logits on some of its rows alone: hidden [..., H], rows [Vd] -> [..., Vd]
    (Vd / V of the arithmetic of head(hidden)[..., rows])."""
    rows = rows.to(head.weight.device)
    return torch.nn.functional.linear(hidden, head.weight[rows],
                                      None if head.bias is None else head.bias[rows])


class DraftVocabulary:
    """Sorted target ids [Vd] a draft scores, out of the target's V: the maps between them."""

    def __init__(self, ids: torch.Tensor, vocab_size: int):
        ids = torch.as_tensor(ids, dtype=torch.long)
        if ids.ndim != 1 or not len(ids) or bool((ids[1:] <= ids[:-1]).any()) \
                or int(ids[0]) < 0 or int(ids[-1]) >= vocab_size:
            raise ConfigError(f"a draft vocabulary must be increasing target ids in [0, "
                              f"{vocab_size}); got {len(ids)} ids that are not: retrain the "
                              "draft or remove its draft_vocabulary from config.json.")
        self.ids, self.vocab_size = ids, vocab_size
        self.index = torch.full((vocab_size,), IGNORE, dtype=torch.long)
        self.index[ids] = torch.arange(len(ids))  # [V] the draft id of each target id

    def to(self, device) -> DraftVocabulary:
        self.ids, self.index = self.ids.to(device), self.index.to(device)
        return self

    def restrict(self, target_logits: torch.Tensor | None, labels: torch.Tensor):
        """The target's logits [N, V] on the draft's ids [N, Vd] (a softmax over them is the
        target renormalised there; logits already [N, Vd] are on them) and labels [N] as draft
        ids (IGNORE outside)."""
        restricted = target_logits
        if target_logits is not None and target_logits.shape[-1] != len(self.ids):
            restricted = target_logits[:, self.ids]
        return restricted, self.index[labels]

    def logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[..., Vd] -> [..., V], -inf on tokens outside the draft vocabulary."""
        return scatter(draft_logits, self.ids, self.vocab_size, float("-inf"))

    def probs(self, draft_probs: torch.Tensor) -> torch.Tensor:
        """[..., Vd] -> [..., V], zero outside the draft vocabulary."""
        return scatter(draft_probs, self.ids, self.vocab_size, 0.0)
