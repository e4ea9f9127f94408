"""Published config values of the real targets the recipes in configs/ name, so a recipe can be
checked and a run planned without downloading anything.

Each entry is the subset of the model's config.json (on the Hugging Face hub, as published) that
the checks and the plan read: depth, widths, heads, vocabulary, rope, experts. A local copy of the
model (the HF cache, or a folder) wins over these values wherever it exists.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

PUBLISHED: dict[str, dict] = {
    "meta-llama/Llama-3.1-8B-Instruct": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 128256, "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "rope_theta": 500000.0, "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "torch_dtype": "bfloat16", "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
    },
    "Qwen/Qwen3-8B": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "num_hidden_layers": 36, "hidden_size": 4096, "intermediate_size": 12288,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": False,
        "rope_theta": 1000000.0, "rope_scaling": None, "torch_dtype": "bfloat16",
        "bos_token_id": 151643, "eos_token_id": 151645,
    },
    "Qwen/Qwen3-30B-A3B": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "num_hidden_layers": 48, "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
        "decoder_sparse_step": 1, "mlp_only_layers": [],
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": False,
        "rope_theta": 1000000.0, "rope_scaling": None, "torch_dtype": "bfloat16",
        "bos_token_id": 151643, "eos_token_id": 151645,
    },
    "openai/gpt-oss-20b": {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "num_hidden_layers": 24, "hidden_size": 2880, "intermediate_size": 2880,
        "num_local_experts": 32, "num_experts_per_tok": 4, "experts_per_token": 4,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "vocab_size": 201088, "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "sliding_window": 128, "rope_theta": 150000.0, "rope_scaling": {
            "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 4096},
        "torch_dtype": "bfloat16", "quantization_config": {"quant_method": "mxfp4"},
        "bos_token_id": 199998, "eos_token_id": 200002,
    },
}


TEMPLATE_MODES: dict[str, dict[str, tuple]] = {
    "meta-llama/Llama-3.1-8B-Instruct": {},
    "Qwen/Qwen3-8B": {"enable_thinking": (True, False)},
    "Qwen/Qwen3-30B-A3B": {"enable_thinking": (True, False)},
    "openai/gpt-oss-20b": {"reasoning_effort": ("low", "medium", "high")},
}
"""The modes each chat template reads (model.chat_template_kwargs), with their values: a recipe
for one of these targets names every mode, so its data, eval and serving agree."""

HISTORY_REWRITTEN = {"Qwen/Qwen3-8B", "Qwen/Qwen3-30B-A3B", "openai/gpt-oss-20b"}
"""Templates that drop an earlier assistant turn's reasoning when a later turn is rendered, so a
conversation is not a growing prefix: their recipes regenerate one user turn (data.max_turns=1)."""


def layer_parameters(config: dict, hidden: int | None = None, input_width: int | None = None,
                     intermediate: int | None = None) -> int:
    """One dense decoder layer shaped like config's (attention over input_width, a gated MLP of
    `intermediate`, 0 for attention alone; norms are rounding): a target's layer, or a draft
    layer built from the target's config."""
    h = hidden or config["hidden_size"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    d = config.get("head_dim") or h // heads
    mlp = intermediate if intermediate is not None else config.get("intermediate_size") or 4 * h
    return (input_width or h) * d * (heads + 2 * kv) + heads * d * h + 3 * h * mlp


@dataclass(frozen=True)
class TargetFacts:
    """What the checks and the plan know about a target, and where it came from."""

    name: str
    config: dict
    source: str
    """'local folder', 'HF cache' or 'published values (assets/published.py)'."""

    @property
    def layers(self) -> int:
        return self.config["num_hidden_layers"]

    @property
    def hidden(self) -> int:
        return self.config["hidden_size"]

    @property
    def vocab(self) -> int:
        return self.config["vocab_size"]

    @property
    def architecture(self) -> str:
        return self.config["architectures"][0]

    @property
    def head_dim(self) -> int:
        c = self.config
        return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]

    @property
    def experts(self) -> int:
        c = self.config
        return c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts") or 0

    def parameters(self) -> tuple[int, int]:
        """(total, active per token) parameter counts from the config: total counts embeddings,
        attention, dense or expert MLPs, routers and lm_head (norms are rounding); active counts
        what each token multiplies by (its experts, the lm_head; the input embedding is a
        lookup)."""
        c = self.config
        h, v, layers = self.hidden, self.vocab, self.layers
        attention = layer_parameters(c, intermediate=0)
        embeddings = v * h * (1 if c.get("tie_word_embeddings") else 2)
        if self.experts:
            expert = 3 * h * (c.get("moe_intermediate_size") or c["intermediate_size"])
            chosen = c["num_experts_per_tok"]
            total = layers * (attention + self.experts * expert + h * self.experts)
            active = layers * (attention + chosen * expert + h * self.experts)
        else:
            total = active = layers * layer_parameters(c)
        return total + embeddings, active + v * h


def hf_cache_config(hub_id: str) -> Path | None:
    """config.json of hub_id in the local Hugging Face cache, when some snapshot holds it."""
    import os

    home = Path(os.environ.get("HF_HUB_CACHE") or Path(
        os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface") / "hub")
    snapshots = home / f"models--{hub_id.replace('/', '--')}" / "snapshots"
    found = sorted(snapshots.glob("*/config.json")) if snapshots.is_dir() else []
    return found[-1] if found else None


def target_facts(target: str) -> TargetFacts | None:
    """The target's config without downloading: a local folder, the HF cache, or the published
    values above; None when none of them knows it."""
    folder = Path(target).expanduser()
    if (folder / "config.json").is_file():
        return TargetFacts(target, _text_config(folder / "config.json"), "local folder")
    if (cached := hf_cache_config(target)) is not None:
        return TargetFacts(target, _text_config(cached), "HF cache")
    if target in PUBLISHED:
        return TargetFacts(target, PUBLISHED[target], "published values (assets/published.py)")
    return None


def _text_config(path: Path) -> dict:
    config = json.loads(path.read_text())
    return {**config.get("text_config", {}), **{k: v for k, v in config.items()
                                                if k != "text_config"}}
