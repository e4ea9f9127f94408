"""The EAGLE-3 kind: train.draft='eagle3'; a folder whose architecture is LlamaForCausalLMEagle3.

head.py holds the head and its vocabulary maps, training.py the training-time test, engine.py
the head in our engine; kind.py is what the rest of draftsmith asks of the kind.
"""

from __future__ import annotations

from drafts.eagle3.engine import (
    Eagle3Draft,
    Eagle3Model,
    FusedLayer,
    HeadCache,
)
from drafts.eagle3.head import (
    IGNORE,
    Eagle3Head,
    check_aux_layers,
    check_vocab_maps,
    default_aux_layers,
    draft_index,
    most_frequent_ids,
    target_ids,
    vocab_maps,
)
from drafts.eagle3.kind import (
    Eagle3,
)
from drafts.eagle3.training import (
    Eagle3ForTraining,
    unroll,
)

__all__ = ["Eagle3", "Eagle3Draft", "Eagle3ForTraining", "Eagle3Head", "Eagle3Model", "FusedLayer",
           "HeadCache", "IGNORE", "check_aux_layers", "check_vocab_maps", "default_aux_layers",
           "draft_index", "most_frequent_ids", "target_ids", "unroll", "vocab_maps"]
