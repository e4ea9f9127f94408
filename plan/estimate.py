"""What a run will cost before a GPU-hour is spent: per stage the tokens, the disk, the peak
memory per device and a time estimate, from the recipe, the target's config (a local folder, the
HF cache or assets/published.py: nothing downloaded) and the accelerate config.

The planner is a loop over stages: each stage package states its own estimate
(distill/estimate.py, train/estimate.py, eval/estimate.py: a function of a Sizing to a
StagePlan), and a draft's costs come from its kind (drafts.kind.TrainingShape). Here: the
devices, what an accelerate config says, the plan's table and the checks every stage shares
(disk). Times are measured figures where we have them (the embedded target on a 2-core Xeon,
docs/distillation.md and docs/training.md) and named assumptions for GPUs (a fraction of the
GPU's peak bf16 FLOP/s or memory bandwidth, whichever binds), each stated by its stage. They are
estimates to size a run, not promises; the stage's own log prints the real rate within minutes.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from assets.prompts import missing_data_packages
from assets.published import TargetFacts, target_facts
from drafts import check_target_config, check_train_config
from drafts.kind import DraftKind, TrainingShape
from recipe import Config, ConfigError

GIB = 2**30


@dataclass(frozen=True)
class Device:
    name: str
    memory_gib: float
    bf16_tflops: float
    """Dense bf16 peak."""
    bandwidth_tb_s: float


DEVICES = {d.name: d for d in [
    Device("h100-80gb", 80, 989, 3.35),
    Device("h200", 141, 989, 4.8),
    Device("a100-80gb", 80, 312, 2.04),
    Device("l40s", 48, 362, 0.86),
    Device("cpu", 0, 0, 0),  # memory: this machine's RAM, shared by its processes
]}

DEFAULT_GPU = "h100-80gb"
ANSWER_FILL = 0.5
"""Answers use half of generation.max_new_tokens on average (assumption: ShareGPT prompts; the
stage-1 manifest reports the real figure after a few shards)."""
PROMPT_TOKENS = 200
"""Tokens of one templated user turn (assumption; data.max_prompt_tokens caps the first)."""


@dataclass
class Accelerate:
    """What the plan reads from an accelerate config file."""

    processes: int = 1
    """All processes, over every machine (accelerate's num_processes)."""
    cpu: bool = True
    sharding: str = "none"
    """'none' (DDP or one process), 'zero2', 'zero3' or 'fsdp'."""
    source: str = "one process (no accelerate config)"


def read_accelerate(path: str | None) -> Accelerate:
    if path is None:
        return Accelerate()
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--accelerate-config {path} does not exist: name one of "
                          "configs/accelerate/*.yaml.")
    raw = yaml.safe_load(file.read_text()) or {}
    kind = raw.get("distributed_type", "NO")
    zero = (raw.get("deepspeed_config") or {}).get("zero_stage", 0)
    sharding = {"FSDP": "fsdp"}.get(kind) or {2: "zero2", 3: "zero3"}.get(zero, "none")
    # ddp-cpu.yaml keeps use_cpu false (accelerate's MULTI_GPU falls back to gloo on CPU)
    cpu = bool(raw.get("use_cpu", False)) or file.stem.endswith("cpu")
    return Accelerate(int(raw.get("num_processes", 1)), cpu, sharding, str(file))


@dataclass
class StagePlan:
    name: str
    tokens: int
    disk: dict[str, int]
    """What the stage writes, by part, in bytes."""
    memory: dict[str, int]
    """What one device holds, by part, in bytes."""
    seconds: float
    basis: str
    """Where the time comes from (a measured figure or the named assumption)."""
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    """Each a reason the stage cannot fit, with the fix."""
    disk_fixes: dict[str, str] = field(default_factory=dict)
    """For a part of disk, how to write less of it (when the disk is too small)."""

    @property
    def peak(self) -> int:
        return sum(self.memory.values())

    @property
    def disk_bytes(self) -> int:
        return sum(self.disk.values())


@dataclass
class Sizing:
    """What every stage's estimate reads: the recipe, the target's config, the kind's training
    shape, the device and the launch."""

    cfg: Config
    target: TargetFacts
    kind: DraftKind
    shape: TrainingShape
    device: Device
    accelerate: Accelerate

    @property
    def capacity(self) -> int:
        """One device's memory in bytes (on a CPU: the RAM's share of one process)."""
        return int(self.device.memory_gib * GIB)

    @property
    def on_cpu(self) -> bool:
        return self.device.name == "cpu"

    @property
    def conversations(self) -> int:
        """data.max_prompts: what stage 1 produces (a plan needs it to be set)."""
        if self.cfg.data.max_prompts is None:
            raise ConfigError("data.max_prompts is null (all conversations of the sources): set "
                              "it to the count you expect, so the plan can size the run.")
        return self.cfg.data.max_prompts

    def conversation_tokens(self) -> tuple[int, int]:
        """(answer tokens, all tokens) of one stage-1 conversation, by the named assumptions."""
        cfg = self.cfg
        answer = int(ANSWER_FILL * cfg.generation.max_new_tokens)
        prompt = min(PROMPT_TOKENS, cfg.data.max_prompt_tokens or PROMPT_TOKENS)
        return cfg.data.max_turns * answer, cfg.data.max_turns * (prompt + answer)


Estimate = Callable[[Sizing], StagePlan]
"""A stage's estimate: distill.estimate.estimate, train.estimate.estimate, ..."""


@dataclass
class Plan:
    target: TargetFacts
    device: Device
    accelerate: Accelerate
    stages: list[StagePlan]
    problems: list[str]
    """Each a reason the run cannot fit, with the fix."""
    free_disk: int
    where: Path

    def text(self) -> str:
        total, active = self.target.parameters()
        lines = [
            f"target {self.target.name} ({self.target.architecture}, {total / 1e9:.2f}B "
            f"parameters, {active / 1e9:.2f}B per token; config from {self.target.source})",
            f"devices: {self.accelerate.processes} x {self.device.name} "
            f"({self.device.memory_gib:g} GiB each) from {self.accelerate.source}; sharding "
            f"{self.accelerate.sharding}; {self.free_disk / GIB:,.0f} GiB free at {self.where}",
            "",
            "| stage | tokens | disk | peak memory per device | time | basis |",
            "|---|---|---|---|---|---|"]
        for s in self.stages:
            parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in s.memory.items() if v)
            lines.append(f"| {s.name} | {_count(s.tokens)} | {s.disk_bytes / GIB:,.1f} GiB | "
                         f"{s.peak / GIB:.1f} GiB ({parts}) | {_duration(s.seconds)} | "
                         f"{s.basis} |")
        for s in self.stages:
            lines += [f"{s.name}: {note}" for note in s.notes]
        lines.append(f"total: {_duration(sum(s.seconds for s in self.stages))} on "
                     f"{self.accelerate.processes} x {self.device.name}")
        if self.problems:
            lines += ["", "does not fit:"] + [f"  - {p}" for p in self.problems]
        return "\n".join(lines)


def _count(tokens: int) -> str:
    return f"{tokens / 1e6:,.1f}M" if tokens >= 1e6 else f"{tokens:,}"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def dtype_bytes(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]


def make_plan(cfg: Config, estimates: Sequence[Estimate], accelerate_config: str | None = None,
              device: str | None = None) -> Plan:
    """The plan for cfg under the accelerate config on `device` (default: cpu for a one-process
    CPU config, else h100-80gb): each stage's estimate in order, then the disk they write
    together. Refuses a target whose config cannot be found without a download."""
    facts = _facts(cfg)
    kind = check_train_config(cfg.train)
    check_target_config(cfg, kind)
    acc = read_accelerate(accelerate_config)
    dev = DEVICES[device or ("cpu" if acc.cpu else DEFAULT_GPU)]
    if dev.name == "cpu":
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        dev = Device("cpu", round(ram / acc.processes / GIB, 1), 0, 0)
    sizing = Sizing(cfg, facts, kind, kind.training_shape(cfg.train, facts.config), dev, acc)
    sizing.conversations  # refuses a null data.max_prompts before any stage
    problems = [f"data: {missing}"] if (missing := missing_data_packages(cfg)) else []
    stages = [estimate(sizing) for estimate in estimates]
    problems += [p for s in stages for p in s.problems]
    probe = cfg.run.output_path
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if problem := disk_problem(stages, free, probe):
        problems.append(problem)
    return Plan(facts, dev, acc, stages, problems, free, probe)


def disk_problem(stages: list[StagePlan], free: int, where: Path) -> str | None:
    """The stages' disk against what is free at the run folder: the fix of the part that fills
    it, then the one every run has (a larger disk)."""
    parts = [(size, s.disk_fixes.get(part, "")) for s in stages for part, size in s.disk.items()]
    total = sum(size for size, _ in parts)
    if total <= free:
        return None
    written, fix = 0, ""
    for size, part_fix in parts:
        written += size
        if written > free:
            fix = part_fix
            break
    return (f"disk: {total / GIB:,.1f} GiB to write, {free / GIB:,.1f} GiB free at {where}: "
            f"{fix}point run.output_dir at a larger disk.")


def _named(facts: TargetFacts, cfg: Config) -> TargetFacts:
    return TargetFacts(cfg.model.target, facts.config, facts.source)


def _facts(cfg: Config) -> TargetFacts:
    if cfg.model.target.startswith("embedded:"):
        from assets.target import convert_embedded

        return _named(target_facts(str(convert_embedded(cfg.model.target))), cfg)
    facts = target_facts(cfg.model.target)
    if facts is None:
        raise ConfigError(f"model.target={cfg.model.target!r}: its config.json is not in a local "
                          "folder, the HF cache or assets/published.py, and the plan downloads "
                          "nothing: fetch it first (`huggingface-cli download "
                          f"{cfg.model.target} config.json`).")
    return facts
