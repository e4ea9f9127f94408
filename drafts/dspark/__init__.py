"""The DSpark kind: train.draft='dspark' or 'dspark:<layers>'; a folder whose architecture is
Qwen3DSparkModel. head.py holds the drafter (DFlash's plus the Markov and confidence heads) and
its training forward, engine.py the drafter in our engine; kind.py is what the rest of
draftsmith asks of the kind."""

from __future__ import annotations

from drafts.dspark.engine import DSparkDraft
from drafts.dspark.head import DSparkForTraining, DSparkHead
from drafts.dspark.kind import DSpark

__all__ = ["DSpark", "DSparkDraft", "DSparkForTraining", "DSparkHead"]
