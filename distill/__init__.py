"""Stage 1: the target writes the distillation data."""

from distill.shards import load_distilled
from distill.stage import DistillSummary, OutputMismatchError, run_distill

__all__ = ["DistillSummary", "OutputMismatchError", "load_distilled", "run_distill"]
