"""Where each stage reads and writes inside a run folder (run.output_dir/run.name): the one
place that spells the layout.

    <run>/manifest.json, config.yaml, data/*.parquet    stage 1 (distill)
    <run>/features/                                     the target's features cache (train)
    <run>/train/draft/, train/checkpoints/, log.jsonl,
        curve.png, wandb-run-id                         stage 2 (train)
    <run>/eval/results.json                             stage 3 (eval)
    <run>/export/<name>/                                serving.export
    <run>/validate/results*.json                        serving.validate
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

TRAIN_RECORD = "draftsmith_train.json"
"""In every trained draft folder: its optimizer_steps, held-out figures before and after, tokens
and seconds, and (train.keep=best) which step it was kept from."""


@dataclass(frozen=True)
class RunFolder:
    root: Path

    @property
    def data(self) -> Path:
        """Stage 1's Parquet shards (runfolder.shards)."""
        return self.root / "data"

    @property
    def manifest(self) -> Path:
        return self.root / "manifest.json"

    @property
    def features(self) -> Path:
        return self.root / "features"

    @property
    def features_manifest(self) -> Path:
        """The features cache's identity and shard list (train.features)."""
        return self.root / "features" / "manifest.json"

    @property
    def train(self) -> Path:
        """The train stage's folder: log.jsonl, checkpoints/, draft/."""
        return self.root / "train"

    @property
    def draft(self) -> Path:
        """The trained draft, the folder every later stage reads."""
        return self.root / "train" / "draft"

    @property
    def best(self) -> Path:
        """The best draft so far by held-out acceptance (train.keep=best), while training."""
        return self.root / "train" / "best"

    @property
    def last(self) -> Path:
        """The last step's draft, where train/draft holds an earlier, better one."""
        return self.root / "train" / "last"

    @property
    def checkpoints(self) -> Path:
        return self.root / "train" / "checkpoints"

    @property
    def train_log(self) -> Path:
        """One JSON line per optimizer step and per held-out evaluation."""
        return self.root / "train" / "log.jsonl"

    @property
    def train_curve(self) -> Path:
        """The training curve (loss, held-out acceptance), redrawn at each held-out eval."""
        return self.root / "train" / "curve.png"

    @property
    def wandb_run_id(self) -> Path:
        """The W&B run id, so a resumed run logs into the same W&B run."""
        return self.root / "train" / "wandb-run-id"

    @property
    def eval_results(self) -> Path:
        return self.root / "eval" / "results.json"

    @property
    def export(self) -> Path:
        return self.root / "export"

    @property
    def validate(self) -> Path:
        return self.root / "validate"


def run_folder(cfg) -> RunFolder:
    """The run folder of a resolved recipe.Config."""
    return RunFolder(Path(cfg.run.output_path))


def run_name_of(draft_folder: str | Path) -> str | None:
    """The run name when a folder is some run's trained draft (<run>/train/draft), else None."""
    parts = Path(draft_folder).parts
    return parts[-3] if len(parts) >= 3 and parts[-2:] == ("train", "draft") else None


def train_record(draft_folder: str | Path) -> dict | None:
    """What a trained draft folder's TRAIN_RECORD says; None: not a finished draft."""
    path = Path(draft_folder) / TRAIN_RECORD
    return json.loads(path.read_text()) if path.is_file() else None


def write_train_record(draft_folder: Path, record: dict) -> None:
    (draft_folder / TRAIN_RECORD).write_text(json.dumps(record, indent=2) + "\n")
