"""Stage 2: train a draft of any kind (drafts/) against the target on stage 1's data."""

from train.loop import Dist, TrainingDiverged, TrainSummary, accelerator_kwargs, train_draft
from train.watch import Stopped

__all__ = ["Dist", "Stopped", "TrainSummary", "TrainingDiverged", "accelerator_kwargs", "train_draft"]
