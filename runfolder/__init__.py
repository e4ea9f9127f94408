"""The run folder: the contract between the stages (its paths, stage 1's shard schema and
manifest, the identity check, the prompts a run is measured on, the eval report). It sits below
every stage: distill writes it, train, eval and serving read it, and no stage imports another."""

from runfolder.manifest import identity_differences, read_manifest, write_manifest
from runfolder.paths import (
    TRAIN_RECORD,
    RunFolder,
    run_folder,
    run_name_of,
    train_record,
    write_train_record,
)
from runfolder.prompts import load_eval_prompts
from runfolder.reports import eval_report_of, speed_text, stage1_counts
from runfolder.shards import (
    SPLITS,
    ShardWriter,
    first_conversations,
    load_distilled,
    read_columns,
    shard_files,
)

__all__ = [
    "SPLITS",
    "TRAIN_RECORD",
    "RunFolder",
    "ShardWriter",
    "eval_report_of",
    "first_conversations",
    "identity_differences",
    "load_distilled",
    "load_eval_prompts",
    "read_columns",
    "read_manifest",
    "run_folder",
    "run_name_of",
    "train_record",
    "write_train_record",
    "shard_files",
    "speed_text",
    "stage1_counts",
    "write_manifest",
]
