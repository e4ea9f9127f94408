"""Stage 1: the target writes the distillation data."""

from distill.stage import DistillSummary, OutputMismatchError, run_distill
from runfolder import load_distilled

__all__ = ["DistillSummary", "OutputMismatchError", "load_distilled", "run_distill"]
