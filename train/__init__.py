"""Stage 2: train a draft against the target (independent draft LM by distillation)."""

from train.loop import TrainingDiverged, TrainSummary, accelerator_kwargs, train_draft

__all__ = ["TrainSummary", "TrainingDiverged", "accelerator_kwargs", "train_draft"]
