"""Stage 1's estimate for `distill.py --plan`: the target in vLLM, one engine per
generation.vllm_tensor_parallel_size processes, its weights over those GPUs and the rest KV
cache; the answers it generates and the Parquet they fill."""

from __future__ import annotations

from assets.published import TargetFacts
from plan.estimate import ANSWER_FILL, GIB, PROMPT_TOKENS, Sizing, StagePlan, dtype_bytes

GPU_GENERATION_MFU = 0.25
"""vLLM decoding at large batch reaches about a quarter of peak FLOP/s (assumption)."""
GPU_BANDWIDTH_EFFICIENCY = 0.7
"""...or, when memory-bound, 70 % of the bandwidth reading the active weights (assumption)."""
CPU_STAGE1_TOKENS_S = 265.0
"""Measured: SmolLM2-135M in vLLM fp32, batch 64, on 2 x86 cores (docs/results.md, stage 1 of
the embedded default); scaled by active parameters for other targets."""
CPU_KV_CACHE_GIB = 4.0
"""vLLM-CPU's KV cache as draftsmith sets it (VLLM_CPU_KVCACHE_SPACE)."""
KV_CACHE_FRACTION = 0.9
"""vLLM's gpu_memory_utilization default: weights and KV cache share 90 % of a GPU."""
STAGE1_BYTES_PER_TOKEN = 8
"""Stage-1 Parquet per conversation token, an upper bound (distill.stage.BYTES_PER_TOKEN)."""


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


def estimate(sizing: Sizing) -> StagePlan:
    cfg, facts, dev = sizing.cfg, sizing.target, sizing.device
    n = sizing.conversations
    answer, per_conversation = sizing.conversation_tokens()
    _, active = facts.parameters()
    tp = cfg.generation.vllm_tensor_parallel_size
    engines = max(1, sizing.accelerate.processes // tp)
    weights = vllm_weight_bytes(facts, cfg.model.dtype) // tp
    kv_room = (int(CPU_KV_CACHE_GIB * GIB) if sizing.on_cpu else
               int(KV_CACHE_FRACTION * sizing.capacity) - weights)
    generated = n * answer
    disk = n * per_conversation * (STAGE1_BYTES_PER_TOKEN + 8 * cfg.generation.top_k_logprobs)
    if sizing.on_cpu:
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
    plan = StagePlan("distill", generated, {"conversations": disk},
                     {"target": weights, "kv cache": max(0, kv_room)}, seconds, basis,
                     [f"{n:,} conversations x {cfg.data.max_turns} turn(s), ~{answer:,} answer "
                      f"tokens each (assumed {ANSWER_FILL:.0%} of max_new_tokens); KV cache "
                      f"holds {kv_tokens:,} tokens per engine "
                      f"({kv_bytes_per_token(facts) / 1024:.0f} KiB each)"])
    if kv_room <= 0 or kv_tokens < cfg.generation.max_new_tokens + PROMPT_TOKENS:
        plan.problems.append(
            f"distill: the target's weights ({weights / GIB:.1f} GiB per GPU) leave no room for "
            f"vLLM's KV cache in {KV_CACHE_FRACTION:.0%} of {dev.memory_gib:g} GiB: raise "
            f"generation.vllm_tensor_parallel_size (one engine over more GPUs: every t-th "
            "process drives one), or use GPUs with more memory.")
    return plan
