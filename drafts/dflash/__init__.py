"""The DFlash kind: train.draft='dflash' or 'dflash:<layers>'; a folder whose architecture is
DFlashDraftModel. head.py holds the drafter and its training forward, engine.py the drafter in
our engine; kind.py is what the rest of draftsmith asks of the kind."""

from __future__ import annotations

from drafts.dflash.engine import (
    DFlashDraft,
)
from drafts.dflash.head import (
    DFlashForTraining,
    DFlashHead,
)
from drafts.dflash.kind import (
    DFlash,
    DFlashModel,
    parse_layers,
)

__all__ = ["DFlash", "DFlashDraft", "DFlashForTraining", "DFlashHead", "DFlashModel",
           "parse_layers"]
