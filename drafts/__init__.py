"""The draft kinds (an independent LM, Medusa heads, an EAGLE-3 head, a DFlash block drafter, a
PARD parallel draft LM, prompt lookup): one module
each behind drafts.kind.DraftKind, listed in drafts/registry.py. Training, eval, the engine's
drafts and export all go through these."""

from drafts.kind import DraftKind, LoadedDraft, TargetHidden
from drafts.registry import (
    KINDS,
    check_target_config,
    check_train_config,
    engine_draft,
    kind_of,
    load_draft,
)

__all__ = ["KINDS", "DraftKind", "LoadedDraft", "TargetHidden", "check_target_config",
           "check_train_config",
           "engine_draft", "kind_of", "load_draft"]
