"""Training's estimate for `distill.py --plan`.

Memory per device, as the code places it: every process holds a frozen copy of the whole target
(accelerate prepares only the draft), the draft, its gradients and AdamW states (fp32: 4 + 4 + 8
bytes per trainable parameter; ZeRO-2 shards gradients and states over the processes, ZeRO-3 and
FSDP the draft's parameters too), and the activations of one micro-batch (`activations`). Disk:
the offline features, the checkpoints and the kept drafts. The draft's sizes come from its kind
(drafts.kind.TrainingShape)."""

from __future__ import annotations

from plan.estimate import GIB, Sizing, StagePlan, dtype_bytes

GPU_TRAIN_MFU = 0.3
"""Training (target forward + draft forward/backward) at 30 % of peak (assumption)."""
CPU_TRAIN_TOKENS_S = 234.0
"""Measured: the independent recipe (a target forward per batch, a 6-layer draft) on 2 x86
cores, its train/log.jsonl tokens_per_s; EAGLE-3 on offline features trains faster."""


def checkpoint_bytes(trainable: int, frozen: int) -> int:
    """One training checkpoint (accelerate's save_state): every draft parameter in fp32, frozen
    ones included, and AdamW's two fp32 moments of each trainable one."""
    return (trainable + frozen) * 4 + trainable * 8


def activations(sizing: Sizing) -> int:
    """One micro-batch's activations, the largest terms: the target's fp32 logits over the
    batch's tokens, and per row the draft scores (the kind's scored_rows) its fp32 logits and
    their gradient plus ~20 hidden-sized bf16 tensors kept for backward."""
    t, facts, shape = sizing.cfg.train, sizing.target, sizing.shape
    tokens = t.micro_batch_size * t.max_seq_len
    return tokens * facts.vocab * 4 + shape.scored_rows * (shape.draft_vocabulary * 4 * 2
                                                           + 20 * facts.hidden * 2)


def estimate(sizing: Sizing) -> StagePlan:
    cfg, t, facts, shape, acc = sizing.cfg, sizing.cfg.train, sizing.target, sizing.shape, \
        sizing.accelerate
    total, active = facts.parameters()
    trainable, frozen = shape.trainable, shape.frozen
    processes = acc.processes
    shards = processes if acc.sharding != "none" else 1
    memory = {
        "target": total * dtype_bytes(cfg.model.dtype),
        "draft": (trainable + frozen) * 4 // (processes if acc.sharding in ("zero3", "fsdp")
                                               else 1),
        "gradients+AdamW": trainable * 12 // shards,
        "activations": activations(sizing),
    }
    n = sizing.conversations
    _, per_conversation = sizing.conversation_tokens()
    conversations = t.max_steps * processes * t.micro_batch_size * t.gradient_accumulation_steps
    train_tokens = conversations * min(per_conversation, t.max_seq_len)
    notes = [f"draft: {trainable / 1e6:,.0f}M trainable + {frozen / 1e6:,.0f}M frozen "
             f"parameters; {conversations:,} conversations seen "
             f"({conversations / max(1, n):.1f} epochs)"]
    disk, fixes = {}, {}
    if t.target_features == "offline" and shape.feature_bytes:
        disk["features"] = n * min(per_conversation, t.max_seq_len) * shape.feature_bytes
        fixes["features"] = ("train.target_features=online (no dump: a target forward per "
                             "batch), or ")
        notes.append(f"offline features: {shape.feature_bytes:,} bytes per token")
    if sizing.on_cpu:
        seconds = train_tokens / CPU_TRAIN_TOKENS_S * max(1.0, active / 1.35e8)
        basis = (f"measured {CPU_TRAIN_TOKENS_S:.0f} tokens/s (independent recipe, 2 x86 "
                 "cores), scaled by active parameters")
    else:
        flops = 2 * active + 6 * trainable * shape.draft_passes
        rate = sizing.device.bf16_tflops * 1e12 * GPU_TRAIN_MFU / flops * processes
        seconds, basis = train_tokens / rate, (
            f"assumed {rate:,.0f} tokens/s: {GPU_TRAIN_MFU:.0%} of peak over 2 x active "
            "target + 6 x trainable draft FLOPs per token")
    checkpoint = checkpoint_bytes(trainable, frozen)
    disk["checkpoints"] = (t.keep_checkpoints + 1) * checkpoint + 2 * (trainable + frozen) * 4
    if t.keep_checkpoints > 1:
        fixes["checkpoints"] = "train.keep_checkpoints=1, or "
    notes.append(f"checkpoints: {checkpoint / GIB:,.2f} GiB each (fp32 draft + AdamW's two "
                 f"moments), {t.keep_checkpoints} kept + 1 being written; the best and the last "
                 "draft beside them")
    plan = StagePlan("train", train_tokens, disk, memory, seconds, basis, notes,
                     disk_fixes=fixes)
    if plan.peak > 0.95 * sizing.capacity:
        plan.problems.append(_memory_problem(sizing, plan))
    return plan


def _memory_problem(sizing: Sizing, plan: StagePlan) -> str:
    t, memory = sizing.cfg.train, plan.memory
    fixes = [f"train.micro_batch_size={t.micro_batch_size // 2} (activations "
             f"{memory['activations'] / GIB:.1f} GiB at {t.micro_batch_size})"
             ] if t.micro_batch_size > 1 else [f"train.max_seq_len={t.max_seq_len // 2}"]
    if sizing.accelerate.sharding == "none" and memory["gradients+AdamW"] > GIB:
        fixes.append("ZeRO-2/3 (configs/accelerate/deepspeed-zero3.yaml) to shard the "
                     "draft's optimizer states")
    if memory["target"] > 0.5 * sizing.capacity:
        fixes.append("devices with more memory (the frozen target is whole on each one)")
    fixes.append("more GPUs do not lower it: each holds the target and one micro-batch")
    return (f"train: {plan.peak / GIB:.1f} GiB per device over "
            f"{sizing.device.memory_gib:g} GiB: " + "; ".join(fixes) + ".")
