"""Stage 1's sharded Parquet output: the data contract every later stage reads, and what makes
stage 1 resumable (with the manifest, runfolder.manifest).

Layout of an output folder:
    manifest.json             identity (target, settings), status, counts
    config.yaml               the resolved config of the run
    data/train-r0-00000.parquet, data/held_out-r0-00000.parquet, ...

A shard appears only complete (written to a temporary name, then renamed), and shards are
written at batch boundaries, so a kill at any moment leaves whole shards of whole batches (but
for the instant between two splits' renames); a re-run skips every conversation id already in
one and regenerates a batch that is not all written whole, so it computes what it would have.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from runfolder.paths import RunFolder

SPLITS = ("train", "held_out")
_SHARD = re.compile(r"^(train|held_out)-r(\d+)-(\d{5})\.parquet$")


def schema(top_k: int) -> pa.Schema:
    fields = [
        ("id", pa.string()),
        ("source", pa.string()),
        ("split", pa.string()),
        ("messages", pa.string()),  # JSON list of {"role", "content"}, replies included
        ("input_ids", pa.list_(pa.int32())),  # [T] the conversation in the chat template
        ("loss_mask", pa.list_(pa.int8())),  # [T] 1 on tokens the target wrote
        ("num_turns", pa.int32()),
        ("generated_tokens", pa.int32()),
        # replies whose decoded text re-encodes to other ids than the target generated (a reply
        # cut inside a multi-byte character, a non-canonical merge); input_ids hold the re-encoding
        ("retokenized_replies", pa.int32()),
        ("finish_reasons", pa.list_(pa.string())),  # per turn: stop, length, or a server's own
        ("backend", pa.string()),  # who ran the target: hf | vllm (the manifest counts them)
    ]
    if top_k:
        fields += [("topk_ids", pa.list_(pa.list_(pa.int32()))),  # [N, k], N = sum(loss_mask)
                   ("topk_logprobs", pa.list_(pa.list_(pa.float32())))]
    return pa.schema(fields)


def shard_files(data_dir: Path, split: str | None = None) -> list[Path]:
    if not data_dir.is_dir():
        return []
    files = [p for p in data_dir.iterdir() if (m := _SHARD.match(p.name))
             and (split is None or m.group(1) == split)]
    return sorted(files)


def read_columns(data_dir: Path, columns: list[str]) -> list[dict[str, Any]]:
    rows = []
    for path in shard_files(data_dir):
        rows.extend(pq.read_table(path, columns=columns).to_pylist())
    return rows


def backend_counts(data_dir: Path) -> dict[str, int]:
    """Conversations per stage-1 backend ('unrecorded': shards from before rows recorded it)."""
    counts: Counter[str] = Counter()
    for path in shard_files(data_dir):
        if "backend" in pq.read_schema(path).names:
            counts.update(pq.read_table(path, columns=["backend"]).column("backend").to_pylist())
        else:
            counts["unrecorded"] += pq.read_metadata(path).num_rows
    return dict(sorted(counts.items()))


class ShardWriter:
    """Buffers rows per split and, at the end of a batch once `shard_size` rows are buffered,
    writes every split's shard (each atomically): shards hold whole batches."""

    def __init__(self, data_dir: Path, rank: int, shard_size: int, top_k: int):
        self.data_dir, self.rank, self.shard_size = data_dir, rank, shard_size
        self.schema = schema(top_k)
        self.buffers: dict[str, list[dict]] = {s: [] for s in SPLITS}
        data_dir.mkdir(parents=True, exist_ok=True)
        self.next_index = {s: 0 for s in SPLITS}
        for path in shard_files(data_dir):
            split, r, index = _SHARD.match(path.name).groups()
            if int(r) == rank:
                self.next_index[split] = max(self.next_index[split], int(index) + 1)

    def add(self, row: dict[str, Any]) -> None:
        self.buffers[row["split"]].append(row)

    def end_batch(self) -> None:
        if sum(map(len, self.buffers.values())) >= self.shard_size:
            self.close()

    def flush(self, split: str) -> None:
        rows = self.buffers[split]
        if not rows:
            return
        name = f"{split}-r{self.rank}-{self.next_index[split]:05d}.parquet"
        tmp = self.data_dir / f".{name}.tmp"
        pq.write_table(pa.Table.from_pylist(rows, schema=self.schema), tmp)
        os.replace(tmp, self.data_dir / name)
        self.next_index[split] += 1
        self.buffers[split] = []

    def close(self) -> None:
        for split in SPLITS:
            self.flush(split)


def first_conversations(items: list, n: int | None, key) -> list:
    """train.max_conversations: the first n by conversation id (all when n is None); the
    training set and the tau-vs-data report both take their subset here."""
    return sorted(items, key=key)[:n]


def load_distilled(out: str | Path):
    """The stage-1 output as a `datasets.DatasetDict` with 'train' and 'held_out' splits."""
    import datasets

    data_dir = RunFolder(Path(out)).data
    files = {s: [str(p) for p in shard_files(data_dir, s)] for s in SPLITS}
    files = {s: f for s, f in files.items() if f}
    if not files:
        raise FileNotFoundError(f"no stage-1 shards under {data_dir}: run the distill stage first.")
    return datasets.load_dataset("parquet", data_files=files)
