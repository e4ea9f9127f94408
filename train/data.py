"""Training data for stage 2: stage-1 conversations (offline) and the draft's own samples
(on-policy), as right-padded micro-batches.

The order is a pure function of the global micro-batch number p = (optimizer_step * G + micro_step)
* world + rank, so a run resumed at an optimizer_step sees exactly the batches it would have seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import torch

from decoding.hf import generate_replies
from recipe import Config, ConfigError, GenerationConfig
from runfolder import first_conversations, read_manifest, run_folder, shard_files


@dataclass
class Example:
    id: str
    input_ids: list[int]  # [T] a conversation in the target's chat template
    loss_mask: list[int]  # [T] 1 on tokens the target wrote
    topk_ids: list[list[int]] | None = None  # [N, k], N = sum(loss_mask)
    topk_logprobs: list[list[float]] | None = None


@dataclass
class Batch:
    ids: list[str]
    input_ids: torch.Tensor  # [B, T] right-padded
    attention_mask: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T] bool: tokens the loss is on (labels)
    topk_ids: torch.Tensor | None = None  # [N, k] for the N loss tokens, row-major order
    topk_logprobs: torch.Tensor | None = None  # [N, k]
    on_policy: bool = False

    @property
    def pred_mask(self) -> torch.Tensor:
        """[B, T] positions whose next token is a label: logits there predict it."""
        mask = torch.zeros_like(self.loss_mask)
        mask[:, :-1] = self.loss_mask[:, 1:]
        return mask

    @property
    def labels(self) -> torch.Tensor:
        """[N] the label tokens, in the row-major order of pred_mask's positions."""
        return self.input_ids[:, 1:][self.loss_mask[:, 1:]]

    @property
    def loss_tokens(self) -> int:
        return int(self.loss_mask[:, 1:].sum())

    def to(self, device: torch.device) -> Batch:
        move = lambda t: None if t is None else t.to(device)
        return Batch(self.ids, move(self.input_ids), move(self.attention_mask),
                     move(self.loss_mask), move(self.topk_ids), move(self.topk_logprobs),
                     self.on_policy)


@dataclass
class TrainData:
    train: list[Example]
    held_out: list[Example]


def load_stage1(cfg: Config, target_fingerprint: str) -> TrainData:
    """The stage-1 shards of this run, checked to come from this target and to be complete."""
    run = run_folder(cfg)
    out = run.root
    manifest = read_manifest(out)
    if manifest is None or not shard_files(run.data):
        raise ConfigError(f"no stage-1 data in {out}: run the distill stage first "
                          f"(distill.py --config ... --stage distill), or set run.output_dir.")
    if manifest.get("status") != "complete":
        raise ConfigError(f"stage 1 in {out} is not complete (status {manifest.get('status')!r}): "
                          "re-run the distill stage to finish it before training.")
    made_by = manifest["identity"]["target"]
    if made_by["fingerprint"] != target_fingerprint:
        raise ConfigError(
            f"the stage-1 data in {out} was written by target {made_by['name']!r} "
            f"({made_by['fingerprint']}), but model.target is now {cfg.model.target!r} "
            f"({target_fingerprint}). A draft must learn from its own target: regenerate the "
            "data (a new run.name) or set model.target back.")
    splits: dict[str, list[Example]] = {"train": [], "held_out": []}
    has_topk = True
    for path in shard_files(run.data):
        table = pq.read_table(path)
        has_topk &= "topk_ids" in table.column_names
        for row in table.to_pylist():
            splits[row["split"]].append(Example(row["id"], row["input_ids"], row["loss_mask"],
                                                row.get("topk_ids"), row.get("topk_logprobs")))
    if cfg.train.target_logits == "topk" and not has_topk:
        raise ConfigError(f"train.target_logits=topk, but the stage-1 data in {out} holds no top-k "
                          "log-probs: use train.target_logits=online, or regenerate with "
                          "generation.top_k_logprobs > 0.")
    for split in splits.values():
        split.sort(key=lambda e: e.id)  # shard layout (ranks, batches) must not change the order
    wanted = cfg.train.max_conversations
    if wanted is not None and wanted > len(splits["train"]):
        raise ConfigError(f"train.max_conversations={wanted}, but {out} holds "
                          f"{len(splits['train'])} training conversations: lower it (or null: "
                          "all), or generate more data (data.max_prompts).")
    splits["train"] = first_conversations(splits["train"], wanted, key=lambda e: e.id)
    if len(splits["train"]) < cfg.train.micro_batch_size:
        raise ConfigError(f"{len(splits['train'])} training conversations in {out}, fewer than "
                          f"train.micro_batch_size={cfg.train.micro_batch_size}: generate more "
                          "data (data.max_prompts) or lower the micro-batch size.")
    return TrainData(splits["train"], splits["held_out"])


def truncate(example: Example, max_len: int) -> Example:
    """Cut a conversation to max_len tokens, and its top-k rows to the loss tokens that remain."""
    if len(example.input_ids) <= max_len:
        return example
    mask = example.loss_mask[:max_len]
    kept = sum(mask)
    return Example(example.id, example.input_ids[:max_len], mask,
                   example.topk_ids[:kept] if example.topk_ids is not None else None,
                   example.topk_logprobs[:kept] if example.topk_logprobs is not None else None)


def collate(examples: list[Example], pad_id: int, max_len: int) -> Batch:
    """Right-padded [B, T] tensors; top-k rows concatenated in row-major order of the labels."""
    examples = [truncate(e, max_len) for e in examples]
    width = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    loss_mask = torch.zeros((len(examples), width), dtype=torch.bool)
    for row, e in enumerate(examples):
        n = len(e.input_ids)
        input_ids[row, :n] = torch.tensor(e.input_ids)
        attention_mask[row, :n] = 1
        loss_mask[row, :n] = torch.tensor(e.loss_mask, dtype=torch.bool)
    loss_mask[:, 0] = False  # nothing predicts the first token
    topk_ids = topk_logprobs = None
    if all(e.topk_ids is not None for e in examples):
        # the first token is never a label in stage-1 data (it is template text)
        topk_ids = torch.tensor([r for e in examples for r in e.topk_ids], dtype=torch.long)
        topk_logprobs = torch.tensor([r for e in examples for r in e.topk_logprobs])
    return Batch([e.id for e in examples], input_ids, attention_mask, loss_mask, topk_ids,
                 topk_logprobs)


def micro_batch_examples(data: list[Example], p: int, micro_batch_size: int,
                         seed: int) -> list[Example]:
    """Global micro-batch number p: a fresh seeded permutation every epoch, full batches only."""
    per_epoch = len(data) // micro_batch_size
    epoch, index = divmod(p, per_epoch)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed + epoch))
    chosen = order[index * micro_batch_size:(index + 1) * micro_batch_size]
    return [data[i] for i in chosen.tolist()]


def is_on_policy(p: int, fraction: float, seed: int) -> bool:
    """Whether micro-batch p is sampled by the draft: a seeded coin per p, stable under resume."""
    if fraction <= 0:
        return False
    if fraction >= 1:
        return True
    coin = torch.rand((), generator=torch.Generator().manual_seed(seed * 1_000_003 + p + 1))
    return bool(coin < fraction)


def prompt_of(example: Example) -> list[int]:
    """The conversation up to the first token the target wrote (the first user turn, templated,
    with the assistant header)."""
    first = example.loss_mask.index(1) if 1 in example.loss_mask else len(example.loss_mask)
    return example.input_ids[:first]


@torch.no_grad()
def sample_on_policy(draft, examples: list[Example], *, max_new_tokens: int, temperature: float,
                     eos_ids: set[int], pad_id: int, max_len: int) -> Batch:
    """The draft continues each prompt (sampling); the loss goes on the tokens it wrote."""
    prompts = [prompt_of(e)[: max_len - max_new_tokens] for e in examples]
    gen = GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature, batch_size=1)
    replies = generate_replies(draft, prompts, gen, eos_ids, pad_id)
    sampled = [Example(e.id, p + r.token_ids, [0] * len(p) + [1] * len(r.token_ids))
               for e, p, r in zip(examples, prompts, replies)]
    batch = collate(sampled, pad_id, max_len)
    batch.on_policy = True
    return batch


def held_out_batches(data: TrainData, cfg: Config, pad_id: int) -> list[Batch]:
    held = data.held_out[: cfg.train.eval_conversations] if data.held_out else []
    if not held:
        raise ConfigError(f"no held-out conversations in {cfg.run.output_path} to measure the "
                          "predicted acceptance on: regenerate with data.held_out_fraction > 0.")
    size = cfg.train.micro_batch_size
    return [collate(held[i:i + size], pad_id, cfg.train.max_seq_len)
            for i in range(0, len(held), size)]


def checkpoint_name(optimizer_step: int) -> str:
    return f"step-{optimizer_step:08d}"


def latest_checkpoint(folder: Path) -> Path | None:
    found = sorted(p for p in folder.glob("step-*") if p.is_dir())
    return found[-1] if found else None
