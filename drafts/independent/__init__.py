"""The independent kind: a draft LM of its own (the target's first layers, a fresh or a pretrained
model). kind.py holds it: the DraftKind and what it drafts, trains and saves."""

from drafts.independent.kind import (
    DraftForTraining,
    Independent,
    LMHead,
    ModelDraft,
    VocabMismatchError,
    check_same_vocab,
    compiled_lm,
    draft_layer_types,
    draft_vocabulary,
    first_vocab_difference,
    fresh,
    layer_truncated,
    parse_spec,
    pretrained_draft,
    right_aligned,
    set_draft_vocabulary,
)

__all__ = ["DraftForTraining", "Independent", "LMHead", "ModelDraft", "VocabMismatchError",
           "check_same_vocab", "compiled_lm", "draft_layer_types", "draft_vocabulary",
           "first_vocab_difference", "fresh", "layer_truncated", "parse_spec", "pretrained_draft",
           "right_aligned", "set_draft_vocabulary"]
