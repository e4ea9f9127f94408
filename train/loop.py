"""Stage 2: distil the target into a draft on accelerate.

    load stage-1 data -> frozen target + trainable draft -> resume from the last checkpoint ->
    for each optimizer_step: G micro_steps (offline or on-policy batches; loss summed over valid
    tokens, divided by the step's total) -> clip, step -> log, held-out predicted acceptance,
    checkpoint -> save the draft as an HF folder.

Everything a step depends on (data order, on-policy coins, learning rate) is a function of
optimizer_step, and checkpoints hold model, optimizer, RNG and step, so resume is exact.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
from accelerate.utils import InitProcessGroupKwargs

from assets.target import (
    cpu_has_native_bf16,
    end_of_turn_ids,
    load_target,
    load_tokenizer,
    resolve_target,
)
from decoding.acceptance import (
    acceptance_grid,
    chain_sums,
    greedy_walk,
    match_probability,
    rates,
    split,
    summarize,
)
from drafts import TargetHidden, check_train_config
from drafts.vocabulary import logits_on_rows, vocabulary_line
from recipe import Config, ConfigError, TrainConfig
from recipe.config import with_current_names
from recipe.disk import check_free_space
from runfolder import identity_differences, run_folder, train_record, write_train_record
from train.data import (
    Batch,
    checkpoint_name,
    collate,
    held_out_batches,
    is_on_policy,
    latest_checkpoint,
    load_stage1,
    micro_batch_examples,
    sample_on_policy,
)
from train.divergences import divergence, dpace_weights
from train.features import FeatureCache, feature_cache, noisy_features, target_hidden
from train.keep import BestDraft, draft_record
from train.watch import Progress, Stopped, TermSignal, draw_curve, wandb_init_kwargs, wandb_mode

# Config fields that may change between a checkpoint and its resume: they do not alter the
# trajectory (data, losses, schedule), only what gets logged or kept.
RESUMABLE_CHANGES = {"save_every", "keep_checkpoints", "eval_every", "eval_conversations"}


class TrainingDiverged(RuntimeError):
    """The loss became NaN or inf; the message names the step, the batch and the last checkpoint."""


@dataclass
class TrainState:
    """The counters accelerate saves with each checkpoint (register_for_checkpointing)."""
    optimizer_step: int = 0
    tokens: int = 0  # all tokens in the micro-batches so far, every process
    loss_tokens: int = 0
    train_seconds: float = 0.0

    def state_dict(self) -> dict:
        return dict(self.__dict__)

    def load_state_dict(self, state: dict) -> None:
        self.__dict__.update(state)

    def advance(self, dist: Dist, batches: list[Batch], loss_sum: float, step_tokens: float,
                lr: float, grad_norm, started: float) -> dict:
        """Count a finished optimizer step -> its log entry."""
        self.optimizer_step += 1
        self.tokens += int(dist.sum(sum(int(b.attention_mask.sum()) for b in batches)))
        self.loss_tokens += int(step_tokens)
        self.train_seconds += time.perf_counter() - started
        return {"optimizer_step": self.optimizer_step,
                "loss": dist.sum(loss_sum) / max(step_tokens, 1),
                "lr": lr, "grad_norm": None if grad_norm is None else float(grad_norm),
                "tokens": self.tokens, "loss_tokens": self.loss_tokens,
                "tokens_per_s": self.tokens / self.train_seconds,
                "on_policy_micro_batches": sum(b.on_policy for b in batches)}


@dataclass
class TrainSummary:
    draft_dir: Path
    optimizer_steps: int
    before: dict | None  # held-out predicted acceptance at optimizer_step 0
    after: dict
    tokens: int
    loss_tokens: int
    train_seconds: float
    resumed_from: int | None = None
    history: list[dict] = field(default_factory=list)


@dataclass
class Dist:
    """Rank and world from torch.distributed when it runs: accelerate 1.15 reports one process
    for DeepSpeed on CPU although DeepSpeed runs every rank in one torch.distributed group."""
    rank: int
    world: int
    device: torch.device

    @classmethod
    def of(cls, accelerator) -> Dist:
        if torch_dist.is_available() and torch_dist.is_initialized():
            return cls(torch_dist.get_rank(), torch_dist.get_world_size(), accelerator.device)
        return cls(accelerator.process_index, accelerator.num_processes, accelerator.device)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            torch_dist.barrier()

    def sum(self, value: float) -> float:
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        torch_dist.all_reduce(t)
        return float(t.item())


@torch.no_grad()
def target_logits(target, batch: Batch, hidden: TargetHidden | None = None,
                  rows: torch.Tensor | None = None) -> torch.Tensor:
    """The frozen target's logits at the batch's loss positions: [N, V], or with rows [Vd]
    (a draft vocabulary's target ids) those columns alone, [N, Vd], for a sixth of the
    arithmetic when Vd = V / 6."""
    hidden = target_hidden(target, batch) if hidden is None else hidden
    head = target.get_output_embeddings()
    last = hidden.last[batch.pred_mask].to(head.weight.dtype)  # [N, H]
    return (head(last) if rows is None else logits_on_rows(head, last, rows)).float()


def weighted_loss(cfg: TrainConfig, model, runs, draft_logits: torch.Tensor,
                  p_logits: torch.Tensor | None, labels: torch.Tensor) -> torch.Tensor:
    """Sum over the LossRows of their weights times the divergence of each draft row from the
    target's distribution (and label) at the loss position it is scored against, in the
    draft's vocabulary (model.restrict); the weights are each run's (train.position_weights
    'decay') or D-PACE's per row ('dpace'). A trained module with an auxiliary_loss(draft rows,
    target rows) adds that term (the DSpark confidence head's). -> [] (a sum)."""
    p_logits, labels = _unwrap(model).restrict(p_logits, labels)
    rows = split(draft_logits, runs)
    weights = (dpace_row_weights(runs, rows, labels, cfg.dpace_smoothing)
               if cfg.position_weights == "dpace" else [run.weight for run in runs])
    total = draft_logits.new_zeros(())
    for run, q, weight in zip(runs, rows, weights):
        total = total + (weight * divergence(
            cfg.loss_terms, run.pick(p_logits), q, run.pick(labels), beta=cfg.jsd_beta,
            temperature=cfg.temperature, eta=cfg.lk_eta)).sum()
    auxiliary = getattr(_unwrap(model), "auxiliary_loss", None)  # a head's own term (DSpark)
    if auxiliary is not None:
        total = total + auxiliary(rows, [run.pick(p_logits) for run in runs])
    return total


def dpace_row_weights(runs, rows: list[torch.Tensor], labels: torch.Tensor,
                      smoothing: float) -> list[torch.Tensor]:
    """D-PACE's weight of every draft row: the rows of each chain (the LossRows' starts (b, s))
    gathered into [C, k] by position, the draft's confidence q(y) in the label there (0 where
    the label is outside its vocabulary), train.divergences.dpace_weights, scattered back ->
    one [count] per run, no gradient."""
    starts = torch.cat([run.starts for run in runs])  # [M, 2]
    chains, chain = torch.unique(starts, dim=0, return_inverse=True)  # [C, 2], [M]
    positions = torch.cat([torch.full((run.count,), run.position - 1, device=starts.device)
                           for run in runs])  # [M]
    k = int(positions.max()) + 1 if len(positions) else 1
    confidence = torch.zeros(len(chains), k, device=starts.device)
    valid = torch.zeros(len(chains), k, dtype=torch.bool, device=starts.device)
    with torch.no_grad():
        label = torch.cat([run.pick(labels) for run in runs])  # [M]
        q = torch.cat([torch.log_softmax(r.float(), -1) for r in rows])  # [M, Vd]
        seen = label >= 0
        conf = torch.where(seen, q.gather(1, label.clamp_min(0)[:, None])[:, 0].exp(), 0.0)
        confidence[chain, positions] = conf
        valid[chain, positions] = True
        weights = dpace_weights(confidence, valid, smoothing)[chain, positions]  # [M]
    return list(weights.split([run.count for run in runs]))


def stored_target_logits(batch: Batch, vocab_size: int) -> torch.Tensor:
    """Stage-1 top-k log-probs as logits over the vocabulary, -inf outside the k: [N, V]."""
    logits = torch.full((batch.topk_ids.shape[0], vocab_size), -math.inf,
                        device=batch.topk_ids.device)
    return logits.scatter(1, batch.topk_ids, batch.topk_logprobs.float())


def learning_rate(cfg: TrainConfig, optimizer_step: int) -> float:
    """Linear warmup, then cosine decay to learning_rate * min_lr_ratio at max_steps."""
    if optimizer_step < cfg.warmup_steps:
        return cfg.learning_rate * (optimizer_step + 1) / (cfg.warmup_steps + 1)
    progress = (optimizer_step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    floor = cfg.learning_rate * cfg.min_lr_ratio
    return floor + 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))) * (cfg.learning_rate - floor)


def accelerator_kwargs(cfg: Config) -> dict:
    """Arguments of the one Accelerator the recipe creates, checked against this machine."""
    gpu = torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())
    precision = cfg.train.mixed_precision
    if precision == "auto":
        native = torch.cuda.is_bf16_supported() if torch.cuda.is_available() else cpu_has_native_bf16()
        precision = "bf16" if native else "no"
    if precision == "fp16" and not gpu:
        raise ConfigError("train.mixed_precision=fp16 needs a GPU; on CPU use 'bf16' (if the CPU "
                          "has AVX512-BF16 or AMX) or 'no'.")
    if precision == "bf16" and not gpu and not cpu_has_native_bf16():
        raise ConfigError("train.mixed_precision=bf16: this CPU lacks AVX512-BF16/AMX, so bf16 "
                          "would be emulated and slow: set train.mixed_precision=no.")
    timeout = timedelta(minutes=cfg.run.collective_timeout_minutes)
    kwargs = {"mixed_precision": precision,
              "gradient_accumulation_steps": cfg.train.gradient_accumulation_steps,
              "kwargs_handlers": [InitProcessGroupKwargs(timeout=timeout)]}
    if not gpu and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        # accelerate 1.15 makes processes started by its (torchrun) launcher a gloo group only
        # when told cpu=True; DeepSpeed runs its own group (see Dist)
        kwargs["cpu"] = True
    if cfg.tracking.tracker != "none":
        if cfg.tracking.tracker == "wandb":
            os.environ["WANDB_MODE"] = wandb_mode(cfg)
        kwargs.update(log_with=cfg.tracking.tracker,
                      project_dir=str(run_folder(cfg).train))
    return kwargs


def reset_accelerate() -> None:
    """Forget accelerate's process-wide singletons, so the next Accelerator in this process
    starts afresh (another device, mixed precision or launch)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@contextlib.contextmanager
def _loaded_whole(accelerator):
    """Models built inside are whole on every process. Under ZeRO-3 accelerate registers its
    config with transformers whatever zero3_init_flag says, and transformers then loads every
    model partitioned (empty tensors on each process): the frozen target must stay whole, and
    the draft built from it is sharded by DeepSpeed itself at prepare."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None or plugin.deepspeed_config.get("zero_optimization", {}).get("stage") != 3:
        yield
        return
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()


def _configure_deepspeed(accelerator, cfg: TrainConfig) -> None:
    """DeepSpeed needs batch sizes up front, since we feed it no DataLoader; and offload on a
    machine without GPU is meaningless (the weights already live in CPU memory)."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return
    ds = plugin.deepspeed_config
    zero = ds.get("zero_optimization", {})
    if accelerator.device.type == "cpu":
        for key in ("offload_optimizer", "offload_param"):
            if zero.get(key, {}).get("device", "none") not in ("none", None):
                raise ConfigError(f"DeepSpeed {key} is set, but this machine has no GPU and the "
                                  f"model is already in CPU memory: set {key}_device: none in "
                                  "the accelerate config (configs/accelerate/deepspeed-zero2.yaml).")
    if cfg.on_policy_fraction > 0 and zero.get("stage", 0) == 3:
        raise ConfigError("on-policy sampling needs the whole draft on each process; ZeRO-3 shards "
                          "it: use ZeRO-2 or DDP, or set train.on_policy_fraction=0.")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ds["train_micro_batch_size_per_gpu"] = cfg.micro_batch_size
    ds["gradient_accumulation_steps"] = cfg.gradient_accumulation_steps
    ds["train_batch_size"] = cfg.micro_batch_size * cfg.gradient_accumulation_steps * world
    ds["gradient_clipping"] = cfg.max_grad_norm


def _resume_check(checkpoint: Path, cfg: Config, processes: int | None = None) -> None:
    """Refuse a resume that would not continue the same run: another config, or (processes
    given) another number of processes (the micro-batches each process reads, and sharded
    FSDP / ZeRO states, depend on it)."""
    import yaml

    launch = checkpoint / "launch.json"
    saved_processes = json.loads(launch.read_text())["processes"] if launch.is_file() else None
    if None not in (saved_processes, processes) and saved_processes != processes:
        raise ConfigError(
            f"the checkpoint {checkpoint} was written by {saved_processes} training processes "
            f"and this launch has {processes}: a resume continues the same run only with the "
            f"same number (which micro-batches each process reads, and FSDP / ZeRO shards, "
            f"depend on it). Launch with --num_processes {saved_processes}, or start over "
            f"under a new run.name (or delete {checkpoint.parent}).")

    def trajectory(c: dict) -> dict:  # the settings a resumed run must share
        return {"model": c["model"], "seed": c["run"]["seed"],
                "train": {k: v for k, v in c["train"].items() if k not in RESUMABLE_CHANGES}}

    saved = with_current_names(yaml.safe_load((checkpoint / "config.yaml").read_text()))
    diffs = identity_differences(trajectory(saved), trajectory(cfg.to_dict()))
    if diffs:
        raise ConfigError(
            f"the checkpoint {checkpoint} was made with another config:\n  " + "\n  ".join(diffs)
            + f"\nResume with the config it was made with, or start over under a new run.name "
            f"(or delete {checkpoint.parent}).")


class _TiedHeadNote(logging.Filter):
    """accelerate's save_state drops a tied lm_head from the safetensors file and logs it at
    every save; loading re-ties it (the exact-resume tests compare whole curves after a kill),
    so for a draft whose head is tied that line says nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Removed shared tensor" not in record.getMessage()


def checkpoint_bytes_needed(checkpoints: Path, models) -> int:
    """What the next checkpoint will take: the newest one's size, else every parameter of the
    prepared models in fp32 and two AdamW moments of the trainable ones."""
    newest = latest_checkpoint(checkpoints)
    if newest is not None:
        return sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())
    return sum(p.numel() * (12 if p.requires_grad else 4) for m in models
               for p in m.parameters())


def _save_checkpoint(accelerator, dist: Dist, state: TrainState, cfg: Config) -> Path:
    folder = run_folder(cfg).checkpoints / checkpoint_name(state.optimizer_step)
    tmp = folder.with_name(f".{folder.name}.tmp")
    short = None
    if dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        try:  # before anything is written; every process stops together
            check_free_space(folder, checkpoint_bytes_needed(folder.parent, accelerator._models),
                             f"the checkpoint after optimizer_step {state.optimizer_step}",
                             "free disk space, lower train.keep_checkpoints or point "
                             "run.output_dir at a larger disk, then run the same command: it "
                             f"resumes from {latest_checkpoint(folder.parent) or 'the start'}.")
        except ConfigError as e:
            short = e
    if dist.sum(float(short is not None)) > 0:
        raise short or ConfigError("the main process has no disk for the next checkpoint.")
    dist.barrier()
    note, accelerate_log = _TiedHeadNote(), logging.getLogger("accelerate.utils.other")
    accelerate_log.addFilter(note)
    try:
        accelerator.save_state(str(tmp))
    finally:
        accelerate_log.removeFilter(note)
    dist.barrier()
    if dist.is_main:  # appears complete or not at all
        cfg.save(tmp / "config.yaml")
        (tmp / "launch.json").write_text(json.dumps({"processes": dist.world}) + "\n")
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
        kept = sorted(p for p in folder.parent.glob("step-*") if p.is_dir())
        for old in kept[: -cfg.train.keep_checkpoints]:
            shutil.rmtree(old)
    dist.barrier()
    return folder


def read_log(path: Path, log=print) -> list[dict]:
    """The entries of a train/log.jsonl. A last line cut short (a kill or a full disk during an
    append) is dropped with a note: the checkpoint the run resumes from is before it. A bad line
    before the last is refused, naming it: the log was edited or damaged."""
    lines = path.read_text().splitlines()
    entries = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):
                log(f"[train] {path}: its last line was cut short ({line[:60]!r}...); "
                    "dropping it, the resumed run writes that step again.")
                break
            raise ConfigError(f"{path} line {number} is not JSON ({line[:60]!r}): the log was "
                              "damaged. Delete that line (or the file: the curve then starts "
                              "at the resumed step) and run again.") from None
    return entries


class _Log:
    """<output>/train/log.jsonl on the main process, plus the tracker; cut back on resume."""

    def __init__(self, path: Path, accelerator, dist: Dist, keep_until: int):
        self.path, self.accelerator, self.on = path, accelerator, dist.is_main
        self.history: list[dict] = []
        if self.on:
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.is_file():
                lines = read_log(path, accelerator.print)
                self.history = [e for e in lines if e["optimizer_step"] <= keep_until]
            tmp = path.with_name(f".{path.name}.tmp")  # a kill while rewriting loses nothing
            tmp.write_text("".join(json.dumps(e) + "\n" for e in self.history))
            os.replace(tmp, path)

    def first_held_out(self) -> dict | None:
        """The held-out figures logged at optimizer_step 0 (the draft before training)."""
        return next((e["held_out"] for e in self.history
                     if e["optimizer_step"] == 0 and "held_out" in e), None)

    def write(self, entry: dict) -> None:
        if not self.on:
            return
        self.history.append(entry)
        with self.path.open("a") as f:
            f.write(json.dumps(entry) + "\n")
        flat = {k: v for k, v in entry.items() if isinstance(v, (int, float))}
        for name, value in entry.get("held_out", {}).items():
            if isinstance(value, (int, float)):
                flat[f"held_out/{name}"] = value
        if self.accelerator.trackers:
            self.accelerator.log(flat, step=entry["optimizer_step"])


@torch.no_grad()
def evaluate_held_out(model, target, batches: list[Batch], cfg: TrainConfig,
                      device: torch.device, hidden_of=None) -> dict:
    """Loss and predicted acceptance (tau, alpha_1..alpha_k for k = eval_k) on held-out data,
    for sampling at temperature 1 (sum min(p, q)) and for greedy decoding (argmax match), each
    averaged over every start position; and walk_tau / walk_alpha, what a greedy chain engine
    realises stepping through the same replies (decoding.acceptance.greedy_walk), which is lower
    where acceptance varies along a reply."""
    k, trained = cfg.eval_k, _unwrap(model)
    sums = {"sampled": torch.zeros(k, dtype=torch.float64),
            "greedy": torch.zeros(k, dtype=torch.float64)}
    windows, loss_sum, tokens = 0, 0.0, 0
    walk_steps, walk_accepted = 0, [0] * k
    for batch in batches:
        batch = batch.to(device)
        pred, runs = batch.pred_mask, trained.loss_rows(batch.pred_mask)
        hidden = target_hidden(target, batch) if hidden_of is None else hidden_of(batch)
        q_logits = model(batch.input_ids, batch.attention_mask, pred, hidden).float()  # [M, Vd]
        p_logits = target_logits(target, batch, hidden)  # [N, V]
        loss_sum += float(weighted_loss(cfg, model, runs, q_logits, p_logits, batch.labels))
        tokens += batch.loss_tokens
        q_full = trained.expand(q_logits)  # [M, V]: acceptance is against the full target
        for mode in sums:
            values = [match_probability(s.pick(p_logits), q, greedy=mode == "greedy")
                      for s, q in zip(runs, split(q_full, runs))]
            grid, valid = (t.cpu() for t in acceptance_grid(values, runs, pred, k))
            chain, n = chain_sums(grid, valid)
            sums[mode] += chain
            if mode == "greedy" and walk_steps is not None:
                walk = greedy_walk(grid, valid, pred.cpu())
                if walk is None:  # a start the walk reaches is unscored (block_starts > 0)
                    walk_steps = None
                else:
                    walk_steps += walk[0]
                    walk_accepted = [a + b for a, b in zip(walk_accepted, walk[1])]
        windows += n
    sampled, greedy = summarize(sums["sampled"], windows), summarize(sums["greedy"], windows)
    walk_tau = walk_alpha = None
    if walk_steps:
        walk_tau, walk_alpha = rates(walk_steps, walk_accepted, [walk_steps] * k)
        walk_alpha = [round(a, 6) for a in walk_alpha]
    return {"loss": loss_sum / max(tokens, 1), "tau": sampled.tau, "alpha": sampled.alpha,
            "greedy_tau": greedy.tau, "greedy_alpha": greedy.alpha, "windows": windows, "k": k,
            "walk_tau": walk_tau, "walk_alpha": walk_alpha, "walk_steps": walk_steps}


def _unwrap(model):
    """The module under DDP/DeepSpeed wrappers (for loss_rows(), which is not a forward)."""
    while hasattr(model, "module"):
        model = model.module
    return model


@dataclass
class TargetSignal:
    """What the draft is trained against, decided once per run in this one place: the target's
    hidden states (a forward per batch, or the offline feature cache) and its logits (a forward,
    or the top-k stored by stage 1; none for hard-label CE alone)."""

    target: torch.nn.Module
    autocast: object  # accelerator.autocast: the target's matmuls in the training precision
    aux_layers: list[int] | None
    """Target layers the draft reads besides the last (the wrapper's aux_layers)."""
    draft_reads_hidden: bool
    logits: bool
    """Some loss term needs the target's distribution (every loss but 'ce')."""
    topk: bool
    """Offline batches take stage 1's top-k log-probs instead of a target forward."""
    vocab_size: int
    rows: torch.Tensor | None = None
    """The target ids the draft's loss scores (its draft vocabulary): online logits are
    computed on these alone. None: all V."""
    features: FeatureCache | None = None

    @classmethod
    def for_run(cls, cfg: Config, target, trainable, autocast) -> TargetSignal:
        return cls(target, autocast, trainable.aux_layers, trainable.needs_target_hidden,
                   any(name != "ce" for _, name in cfg.train.loss_terms),
                   cfg.train.target_logits == "topk",
                   target.get_output_embeddings().weight.shape[0],
                   trainable.target_rows)

    def hidden(self, batch: Batch) -> TargetHidden:
        """The target's hidden states for a batch: from the feature cache, or a forward."""
        if self.features is not None:
            return self.features.lookup(batch, self.target)
        with self.autocast():
            return target_hidden(self.target, batch, self.aux_layers)

    def __call__(self, batch: Batch) -> tuple[TargetHidden | None, torch.Tensor | None]:
        """-> (hidden states when the draft or the target's logits need them, target logits
        at the batch's loss positions or None: [N, Vd] on self.rows when computed here, [N, V]
        from stage 1's top-k)."""
        online = not self.topk or batch.on_policy  # the draft's own samples have no stored top-k
        hidden = None
        if self.draft_reads_hidden or (self.logits and online):
            hidden = self.hidden(batch)
        if not self.logits:
            return hidden, None
        if not online:
            return hidden, stored_target_logits(batch, self.vocab_size)
        with self.autocast():
            return hidden, target_logits(self.target, batch, hidden, self.rows)


@dataclass
class _Training:
    """What one training run holds between its optimizer steps."""

    cfg: Config
    accelerator: Any
    dist: Dist
    state: TrainState
    model: Any
    optimizer: Any
    target: Any
    tokenizer: Any
    data: Any
    signal: TargetSignal
    held_out: list[Batch]
    log: _Log
    progress: Progress
    eos_ids: set[int]
    pad_id: int
    resumed_from: int | None

    def save_draft(self, folder: Path, record: dict) -> None:
        _save_draft(self.accelerator, self.dist, self.model, self.tokenizer, self.cfg, folder,
                    record)

    def held_out_eval(self) -> dict:
        """Predicted acceptance on the held-out conversations, logged and drawn."""
        tcfg = self.cfg.train
        self.model.eval()
        result = evaluate_held_out(self.model, self.target, self.held_out, tcfg,
                                   self.accelerator.device, self.signal.hidden)
        self.model.train()
        walk = result["walk_tau"]
        self.accelerator.print(
            f"[train] optimizer_step {self.state.optimizer_step}: held-out loss "
            f"{result['loss']:.4f}, predicted tau(k={tcfg.eval_k}) {result['tau']:.3f} sampled "
            f"/ {result['greedy_tau']:.3f} greedy"
            + (f" ({walk:.3f} as a greedy engine steps)" if walk is not None else "")
            + f", alpha {result['alpha']}")
        self.log.write({"optimizer_step": self.state.optimizer_step, "held_out": result})
        if self.dist.is_main:
            draw_curve(self.log.history, run_folder(self.cfg).train_curve, tcfg.best_by)
        return result


def train_draft(cfg: Config, accelerator) -> TrainSummary:
    """Train cfg.train.draft, of whatever kind, against the target on this run's stage-1 data;
    resumes from the last checkpoint and does not redo a finished draft."""
    run, tcfg = run_folder(cfg), cfg.train
    if (record := train_record(run.draft)) is not None:
        return _already_trained(run.draft, record, cfg, accelerator)
    t = _prepare(cfg, accelerator)
    best = BestDraft(run, tcfg, t.dist, t.save_draft, fresh=t.state.optimizer_step == 0)
    before = last_eval = t.held_out_eval() if t.state.optimizer_step == 0 else None
    before = before or t.log.first_held_out()
    with TermSignal() as term:
        while t.state.optimizer_step < tcfg.max_steps:
            entry = _train_step(t)
            done = t.state.optimizer_step == tcfg.max_steps
            if done or t.state.optimizer_step % tcfg.eval_every == 0:
                last_eval = t.held_out_eval()
                best.offer(draft_record(t.state, before, last_eval))
            saved = None
            if done or t.state.optimizer_step % tcfg.save_every == 0:
                saved = _save_checkpoint(accelerator, t.dist, t.state, cfg)
            if not done and t.dist.sum(float(term.requested)) > 0:  # all stop at the same step
                folder = saved or _save_checkpoint(accelerator, t.dist, t.state, cfg)
                raise Stopped(f"SIGTERM: stopped after optimizer_step {entry['optimizer_step']} "
                              f"with its checkpoint saved ({folder}); the same command resumes "
                              "from it.")
    if last_eval is None:  # resumed at the very end
        last_eval = t.held_out_eval()
        best.offer(draft_record(t.state, before, last_eval))
    after = best.finish(draft_record(t.state, before, last_eval))
    for tracker in accelerator.trackers:  # not end_training(): it ends the process group
        tracker.finish()
    return TrainSummary(run.draft, t.state.optimizer_step, before, after, t.state.tokens,
                        t.state.loss_tokens, t.state.train_seconds, t.resumed_from,
                        t.log.history)


def _prepare(cfg: Config, accelerator) -> _Training:
    """Target, tokenizer, data, the draft under accelerate with its optimizer, resumed from the
    last checkpoint, the tracker and the target's signal (offline features dumped first)."""
    tcfg, run = cfg.train, run_folder(cfg)
    kind = check_train_config(tcfg)
    resolved = resolve_target(cfg.model)
    tokenizer = load_tokenizer(resolved, cfg.model.chat_template_kwargs)
    data = load_stage1(cfg, resolved.fingerprint)
    with _loaded_whole(accelerator):
        target = load_target(resolved, cfg.model.dtype, accelerator.device)
        torch.manual_seed(cfg.run.seed)  # the same initial draft on every process and every run
        draft = kind.build(tcfg, target, tokenizer, data.train, accelerator.print)
    kind.freeze(draft, tcfg)
    model = kind.wrap(_with_lora(draft, tcfg) if tcfg.lora_rank else draft, tcfg)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=tcfg.learning_rate, betas=(0.9, 0.95),
                                  weight_decay=tcfg.weight_decay)
    _configure_deepspeed(accelerator, tcfg)
    model, optimizer = accelerator.prepare(model, optimizer)
    dist, state = Dist.of(accelerator), TrainState()
    accelerator.register_for_checkpointing(state)
    resumed_from = _resume(accelerator, run.checkpoints, cfg, state)
    if dist.is_main:
        cfg.save(run.train / "config.yaml")
    _start_tracking(accelerator, dist, cfg)
    log = _Log(run.train_log, accelerator, dist, keep_until=state.optimizer_step)
    pad_id = tokenizer.pad_token_id
    rows = getattr(_unwrap(model), "target_rows", None)  # [Vd] target ids of a draft vocabulary
    if rows is not None:
        vocab = target.get_output_embeddings().weight.shape[0]
        accelerator.print(f"[train] {vocabulary_line(data.train, data.held_out, rows, vocab)}")
    signal = TargetSignal.for_run(cfg, target, _unwrap(model), accelerator.autocast)
    if signal.aux_layers is not None and tcfg.target_features == "offline":
        signal.features = feature_cache(cfg, target, resolved.fingerprint,
                                        data.train + data.held_out, signal.aux_layers, pad_id,
                                        dist.rank, dist.world, dist.barrier, accelerator.print)
    progress = Progress(tcfg.max_steps, state.optimizer_step, cfg.tracking.progress_every_s,
                        enabled=dist.is_main)
    return _Training(cfg, accelerator, dist, state, model, optimizer, target, tokenizer, data,
                     signal, held_out_batches(data, cfg, pad_id), log, progress,
                     end_of_turn_ids(target, tokenizer), pad_id, resumed_from)


def _train_step(t: _Training) -> dict:
    """One optimizer_step: its batches, forward and backward, the step, the log line."""
    started = time.perf_counter()
    lr = learning_rate(t.cfg.train, t.state.optimizer_step)
    for group in t.optimizer.param_groups:
        group["lr"] = lr
    batches = _step_batches(t.cfg, t.data, t.state.optimizer_step, t.dist, t.accelerator,
                            t.model, t.eos_ids, t.pad_id)
    loss_sum, step_tokens, grad_norm = step_on_batches(
        t.cfg, t.accelerator, t.dist, t.model, t.optimizer, batches, t.signal, t.state)
    entry = t.state.advance(t.dist, batches, loss_sum, step_tokens, lr, grad_norm, started)
    t.log.write(entry)
    t.progress.update(entry)
    return entry


def _already_trained(final: Path, done: dict, cfg: Config, accelerator) -> TrainSummary:
    _resume_check(final, cfg)
    accelerator.print(f"[train] {final} is already trained; not redoing it.")
    return TrainSummary(final, done["optimizer_steps"], done["before"], done["after"],
                        done["tokens"], done["loss_tokens"], done["train_seconds"])


def _step_batches(cfg: Config, data, optimizer_step: int, dist: Dist, accelerator, model,
                  eos_ids: set[int], pad_id: int) -> list[Batch]:
    """The G micro-batches of this process at this optimizer_step: stage-1 conversations, or
    the draft's own continuations of their prompts (on-policy), as its seeded coin says."""
    tcfg, G = cfg.train, cfg.train.gradient_accumulation_steps
    batches = []
    for micro_step in range(G):
        p = (optimizer_step * G + micro_step) * dist.world + dist.rank
        examples = micro_batch_examples(data.train, p, tcfg.micro_batch_size, cfg.run.seed)
        if is_on_policy(p, tcfg.on_policy_fraction, cfg.run.seed):
            batches.append(sample_on_policy(
                accelerator.unwrap_model(model).lm, examples,
                max_new_tokens=tcfg.on_policy_max_new_tokens,
                temperature=tcfg.on_policy_temperature, eos_ids=eos_ids, pad_id=pad_id,
                max_len=tcfg.max_seq_len).to(accelerator.device))
        else:
            batches.append(collate(examples, pad_id, tcfg.max_seq_len).to(accelerator.device))
    return batches


def step_on_batches(cfg: Config, accelerator, dist: Dist, model, optimizer, batches, signal,
                    state: TrainState) -> tuple[float, float, torch.Tensor | None]:
    """Forward and backward over the step's micro-batches, then one optimizer step ->
    (the summed loss, the step's loss tokens on every process, the gradient norm)."""
    tcfg, G, world = cfg.train, cfg.train.gradient_accumulation_steps, dist.world
    # the step's loss is sum(token losses) / (loss tokens of every micro-batch on every
    # process); accelerate divides by G and DDP/DeepSpeed average over processes: undo both
    step_tokens = dist.sum(sum(b.loss_tokens for b in batches))
    scale = G * world / max(step_tokens, 1)  # 0 only if truncation left no reply token
    loss_sum, grad_norm = 0.0, None
    for micro_step, batch in enumerate(batches):
        with accelerator.accumulate(model):
            pred, runs = batch.pred_mask, _unwrap(model).loss_rows(batch.pred_mask)
            hidden, p_logits = signal(batch)
            if tcfg.feature_noise:  # seeded by the micro-batch: a resumed run adds the same
                p = (state.optimizer_step * G + micro_step) * world + dist.rank
                hidden = noisy_features(hidden, tcfg.feature_noise, cfg.run.seed, p)
            draft_logits = model(batch.input_ids, batch.attention_mask, pred, hidden)
            loss = weighted_loss(tcfg, model, runs, draft_logits, p_logits, batch.labels)
            if dist.sum(float(not torch.isfinite(loss))) > 0:
                raise TrainingDiverged(
                    f"the loss is {loss.item()} at optimizer_step {state.optimizer_step + 1} "
                    f"micro_step {micro_step} (process {dist.rank}, conversations "
                    f"{batch.ids}). Nothing after the last checkpoint "
                    f"({latest_checkpoint(run_folder(cfg).checkpoints) or 'none yet'}) was saved; "
                    "lower train.learning_rate or raise train.warmup_steps, then resume.")
            accelerator.backward(loss * scale)
            loss_sum += float(loss.detach())
            if accelerator.sync_gradients:
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), tcfg.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad()
            if accelerator.sync_gradients and grad_norm is None and hasattr(
                    model, "get_global_grad_norm"):  # DeepSpeed clips inside its step
                grad_norm = model.get_global_grad_norm()
    return loss_sum, step_tokens, grad_norm


def _with_lora(draft, tcfg: TrainConfig):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(draft, LoraConfig(r=tcfg.lora_rank, lora_alpha=tcfg.lora_alpha,
                                            target_modules=tcfg.lora_targets))


def _resume(accelerator, checkpoints: Path, cfg: Config, state: TrainState) -> int | None:
    """Load the latest checkpoint, if any -> the optimizer_step resumed from."""
    checkpoint = latest_checkpoint(checkpoints)
    if checkpoint is None:
        return None
    _resume_check(checkpoint, cfg, Dist.of(accelerator).world)
    accelerator.load_state(str(checkpoint))
    accelerator.print(f"[train] resumed from {checkpoint} (optimizer_step "
                      f"{state.optimizer_step})")
    return state.optimizer_step


def _start_tracking(accelerator, dist: Dist, cfg: Config) -> None:
    if accelerator.trackers == [] and cfg.tracking.tracker != "none" and dist.is_main:
        flat = {f"{section}.{key}": value if isinstance(value, (int, float, str, bool)) else str(value)
                for section, values in cfg.to_dict().items() for key, value in values.items()}
        init = ({"wandb": wandb_init_kwargs(cfg, run_folder(cfg))}
                if cfg.tracking.tracker == "wandb" else {})
        accelerator.init_trackers(cfg.tracking.project, config=flat, init_kwargs=init)


def _save_draft(accelerator, dist: Dist, model, tokenizer, cfg: Config, final: Path,
                record: dict) -> None:
    """The draft as an HF folder (LoRA merged) in final, with the resolved config and record."""
    state_dict = accelerator.get_state_dict(model)  # gathered from FSDP/ZeRO-3 shards
    if not dist.is_main:
        dist.barrier()
        return
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    lm = accelerator.unwrap_model(model).lm
    if cfg.train.lora_rank:
        lm = copy.deepcopy(lm).merge_and_unload()  # training may go on with the adapters
        lm.save_pretrained(tmp)
    else:
        lm.save_pretrained(tmp, state_dict={k.removeprefix("lm."): v
                                            for k, v in state_dict.items()})
    tokenizer.save_pretrained(tmp)
    cfg.save(tmp / "config.yaml")
    write_train_record(tmp, record)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    accelerator.print(f"[train] draft saved to {final}")
    dist.barrier()

