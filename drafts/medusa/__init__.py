"""The Medusa kind: train.draft='medusa:<heads>[x<layers>]'. kind.py holds it: the DraftKind and
what it drafts, trains and saves."""

from drafts.medusa.kind import (
    Medusa,
    MedusaDraft,
    MedusaForTraining,
    MedusaHeads,
    ResidualBlock,
    check_fits_target,
)

__all__ = ["Medusa", "MedusaDraft", "MedusaForTraining", "MedusaHeads", "ResidualBlock",
           "check_fits_target"]
