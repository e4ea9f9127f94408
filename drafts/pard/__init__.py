"""The PARD kind: train.draft='pard:<independent spec>', a draft LM trained to fill mask tokens
after its context. kind.py holds it: the DraftKind and what it drafts, trains and saves."""

from drafts.pard.kind import (
    PREFIX,
    ParallelModelDraft,
    Pard,
    PardForTraining,
)

__all__ = ["PREFIX", "ParallelModelDraft", "Pard", "PardForTraining"]
