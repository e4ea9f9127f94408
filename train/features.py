"""The frozen target's hidden states for training: online (a target forward per batch) or, for
heads that read aux layers, offline (written once to <run>/features and read back every epoch).

Offline features are the aux layers EAGLE-3 reads [T, 3H] and the post-norm last hidden state
[T, H] (whose lm_head product is the target's logits), per conversation, in safetensors shards of
`shard_size` conversations, in train.feature_dtype. A shard file appears complete or not at all,
so an interrupted run resumes at the first missing shard. The folder's manifest names the target
(fingerprint), the aux layers and the dtype; a folder made for anything else is refused.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from drafts.kind import TargetHidden, aux_features
from recipe import Config, ConfigError
from recipe.disk import check_free_space
from runfolder import run_folder
from train.data import Batch, Example, collate

SHARD_SIZE = 16
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@torch.no_grad()
def target_hidden(target, batch: Batch, aux_layers: list[int] | None = None) -> TargetHidden:
    """The frozen target on a batch: post-norm last hidden state [B, T, H], and with aux_layers
    the concatenated features [B, T, 3H] plus the token embeddings [B, T, H]."""
    out = target.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                               output_hidden_states=aux_layers is not None)
    if aux_layers is None:
        return TargetHidden(out.last_hidden_state)
    return TargetHidden(out.last_hidden_state, aux_features(out.hidden_states, aux_layers),
                        target.get_input_embeddings()(batch.input_ids))


def bytes_per_token(hidden_size: int, feature_dtype: str) -> int:
    """What the offline features store per token: three aux layers and the last hidden state."""
    return 4 * hidden_size * DTYPES[feature_dtype].itemsize


def noisy_features(hidden: TargetHidden, width: float, seed: int, micro_batch: int) -> TargetHidden:
    """EAGLE's feature augmentation: aux [B, T, F] + U(-width/2, width/2), drawn from a
    generator seeded by (seed, micro_batch) so a resumed run adds exactly the same noise."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + micro_batch + 7)
    noise = (torch.rand(hidden.aux.shape, generator=generator) - 0.5) * width
    return TargetHidden(hidden.last, hidden.aux + noise.to(hidden.aux.device, hidden.aux.dtype),
                        hidden.embeds)


def _identity(fingerprint: str, aux_layers: list[int], dtype: str,
              examples: list[Example]) -> dict:
    import hashlib

    ids = hashlib.sha256("\n".join(e.id for e in examples).encode()).hexdigest()[:16]
    return {"target": fingerprint, "aux_layers": list(aux_layers), "dtype": dtype,
            "conversation_ids": ids}


def _shard_path(folder: Path, index: int) -> Path:
    return folder / f"features-{index:05d}.safetensors"


class FeatureCache:
    """Offline features of every conversation of a run, looked up per batch."""

    def __init__(self, folder: Path, examples: list[Example], max_len: int):
        from safetensors import safe_open

        self.folder, self.max_len = folder, max_len
        self.where: dict[str, int] = {}
        for index in range(_shard_count(examples)):
            for e in examples[index * SHARD_SIZE:(index + 1) * SHARD_SIZE]:
                self.where[e.id] = index
        self.files = [safe_open(str(_shard_path(folder, i)), "pt")
                      for i in range(_shard_count(examples))]

    def lookup(self, batch: Batch, target) -> TargetHidden:
        """The cached features of the batch's conversations, right-padded like the batch."""
        batch_size, length = batch.input_ids.shape
        device = batch.input_ids.device
        last = aux = None
        for row, example_id in enumerate(batch.ids):
            file = self.files[self.where[example_id]]
            row_aux, row_last = file.get_tensor(f"{example_id}/aux"), file.get_tensor(
                f"{example_id}/last")
            n = min(length, row_last.shape[0])
            if last is None:
                last = torch.zeros(batch_size, length, row_last.shape[1], dtype=row_last.dtype)
                aux = torch.zeros(batch_size, length, row_aux.shape[1], dtype=row_aux.dtype)
            last[row, :n], aux[row, :n] = row_last[:n], row_aux[:n]
        with torch.no_grad():
            embeds = target.get_input_embeddings()(batch.input_ids)
        return TargetHidden(last.to(device), aux.to(device), embeds)


def _add_dump_seconds(manifest_path: Path, seconds: float) -> None:
    """Adds seconds to the manifest's dump_seconds, replacing the file whole (a kill leaves the
    old manifest or the new one, never half of one)."""
    manifest = json.loads(manifest_path.read_text())
    manifest["dump_seconds"] = manifest.get("dump_seconds", 0.0) + seconds
    tmp = manifest_path.with_name(f".{manifest_path.name}.tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, manifest_path)


def _shard_count(examples: list[Example]) -> int:
    return -(-len(examples) // SHARD_SIZE)


def feature_cache(cfg: Config, target, fingerprint: str, examples: list[Example],
                  aux_layers: list[int], pad_id: int, rank: int = 0, world: int = 1,
                  barrier=lambda: None, log=print) -> FeatureCache:
    """Write the missing shards of <run>/features (shard i on process i % world), then open it."""
    from safetensors.torch import save_file

    tcfg = cfg.train
    folder = run_folder(cfg).features
    identity = _identity(fingerprint, aux_layers, tcfg.feature_dtype, examples)
    manifest_path = run_folder(cfg).features_manifest
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        differs = [f"{key}: cached {manifest.get(key)!r}, now {value!r}"
                   for key, value in identity.items() if manifest.get(key) != value]
        if manifest.get("max_seq_len", 0) < tcfg.max_seq_len:
            differs.append(f"max_seq_len: cached {manifest.get('max_seq_len')}, now "
                           f"{tcfg.max_seq_len}")
        if differs:
            raise ConfigError(f"the cached features in {folder} were made for another setting:\n  "
                              + "\n  ".join(differs) + f"\nFeatures only fit the target and "
                              f"layers they came from: delete {folder} to recompute them, or set "
                              "train.target_features=online.")
    dtype = DTYPES[tcfg.feature_dtype]
    hidden = target.config.hidden_size
    tokens = sum(min(len(e.input_ids), tcfg.max_seq_len) for e in examples)
    missing = [i for i in range(_shard_count(examples)) if not _shard_path(folder, i).is_file()]
    per_token = bytes_per_token(hidden, tcfg.feature_dtype)
    if rank == 0 and missing:
        shards = set(missing)
        to_write = sum(min(len(e.input_ids), tcfg.max_seq_len) for i, e in enumerate(examples)
                       if i // SHARD_SIZE in shards)
        check_free_space(folder, to_write * per_token, "writing the offline features "
                         f"({to_write:,} tokens x {per_token:,} bytes)",
                         "free disk space, point run.output_dir at a larger disk, or set "
                         "train.target_features=online (no dump: a target forward per batch).")
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        if not manifest_path.is_file():
            manifest_path.write_text(json.dumps(
                {**identity, "max_seq_len": tcfg.max_seq_len, "conversations": len(examples),
                 "tokens": tokens, "shard_size": SHARD_SIZE}, indent=2) + "\n")
        log(f"[train] offline features: {len(examples)} conversations, {tokens:,} tokens x "
            f"{4 * hidden} values ({tcfg.feature_dtype}, {per_token:,} bytes per token) = "
            f"{tokens * per_token / 2**30:.2f} GiB in {folder}; {len(missing)} of "
            f"{_shard_count(examples)} shards to write"
            + (f", shard i by process i % {world} (~{tokens * per_token / world / 2**30:.2f} "
               "GiB each)" if world > 1 else ""))
    barrier()
    began, written = time.perf_counter(), 0
    counted = began  # the dump's seconds reach the manifest shard by shard: a resume adds its own
    for index in missing:
        if index % world != rank:
            continue
        shard = examples[index * SHARD_SIZE:(index + 1) * SHARD_SIZE]
        tensors = {}
        for start in range(0, len(shard), tcfg.micro_batch_size):
            part = shard[start:start + tcfg.micro_batch_size]
            batch = collate(part, pad_id, tcfg.max_seq_len).to(target.device)
            with torch.autocast(target.device.type, dtype=torch.bfloat16,
                                enabled=dtype == torch.bfloat16 and target.device.type == "cuda"):
                out = target_hidden(target, batch, aux_layers)
            for row, e in enumerate(part):
                n = int(batch.attention_mask[row].sum())
                tensors[f"{e.id}/aux"] = out.aux[row, :n].to("cpu", dtype).contiguous()
                tensors[f"{e.id}/last"] = out.last[row, :n].to("cpu", dtype).contiguous()
                written += n
        path = _shard_path(folder, index)
        tmp = path.with_name(f".{path.name}.tmp")
        save_file(tensors, str(tmp))
        os.replace(tmp, path)
        now = time.perf_counter()
        if rank == 0:  # the dump's cost, for the tau-vs-data table (rank 0's share)
            _add_dump_seconds(manifest_path, now - counted)
            counted = now
        elapsed = now - began
        log(f"[train] features shard {index + 1}/{_shard_count(examples)} written "
            f"({written:,} tokens in {elapsed:.0f} s, {written / elapsed:.0f} tokens/s)")
    barrier()
    return FeatureCache(folder, examples, tcfg.max_seq_len)
