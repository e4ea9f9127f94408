"""Stage 2: train a draft of any kind (drafts/) against the target on stage 1's data."""

from train.loop import Dist, TrainingDiverged, TrainSummary, accelerator_kwargs, train_draft

__all__ = ["Dist", "TrainSummary", "TrainingDiverged", "accelerator_kwargs", "train_draft"]
