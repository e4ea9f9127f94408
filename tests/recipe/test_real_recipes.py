"""The recipes for real targets (configs/ other than the embedded smollm2-*): each checked against
its model's published config values (assets/published.py) as the pipeline checks it at config
load, without downloading anything."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from assets.published import HISTORY_REWRITTEN, PUBLISHED, TEMPLATE_MODES, target_facts
from drafts import check_target_config, check_train_config
from recipe import ConfigError, load_config
from serving.engines import check_target_served
from serving.engines.vllm import VLLM
from tests.helpers import recipes

ROOT = Path(__file__).resolve().parents[2]
REAL = recipes(embedded=False)


def test_there_is_a_recipe_for_each_published_target_and_a_dflash_one():
    targets = {load_config(p).model.target for p in REAL}
    assert targets == set(PUBLISHED)
    assert {load_config(p).train.draft.partition(":")[0] for p in REAL} == {"eagle3", "dflash"}


@pytest.mark.parametrize("recipe", REAL, ids=lambda p: p.stem)
def test_a_real_recipe_fits_its_targets_published_config(recipe):
    cfg = load_config(recipe)
    facts = target_facts(cfg.model.target)
    assert facts.source.startswith("published")
    kind = check_train_config(cfg.train)
    check_target_config(cfg, kind)  # aux layers in range, draft vocabulary, k per step
    check_target_served(cfg, kind)
    assert VLLM().why_not_target(kind, facts.config) is None
    if cfg.train.draft_vocab_size is not None:
        assert cfg.train.draft_vocab_size < facts.vocab
    if kind.name == "dflash":
        assert cfg.eval.k == cfg.train.block_size
        assert all(1 <= i < facts.layers for i in cfg.train.aux_layers)
    assert cfg.eval.k <= max(cfg.train.eagle3.ttt_steps, cfg.train.block_size)
    assert cfg.model.dtype == facts.config["torch_dtype"]
    assert cfg.generation.backend == "vllm" and cfg.generation.vllm_tensor_parallel_size == 1
    assert cfg.train.target_features == "online" and cfg.train.mixed_precision == "bf16"


@pytest.mark.parametrize("recipe", REAL, ids=lambda p: p.stem)
def test_a_real_recipe_names_its_chat_mode_for_data_and_eval_alike(recipe):
    cfg = load_config(recipe)
    modes = TEMPLATE_MODES[cfg.model.target]
    assert set(cfg.model.chat_template_kwargs) == set(modes)
    for name, value in cfg.model.chat_template_kwargs.items():
        assert value in modes[name]
    if cfg.model.target in HISTORY_REWRITTEN:
        assert cfg.data.max_turns == 1


@pytest.mark.parametrize("recipe", REAL, ids=lambda p: p.stem)
def test_a_real_recipe_says_how_to_plan_and_launch_it(recipe):
    text = recipe.read_text()
    assert f"python distill.py --config configs/{recipe.name} --plan" in text
    launch = re.search(r"accelerate launch --config_file (\S+) distill\.py", text)
    assert launch and (ROOT / launch.group(1)).is_file()


@pytest.mark.parametrize(("override", "message"), [
    ("train.aux_layers=[2,16,32]", r"must lie in \[0, 31\]"),
    ("train.draft_vocab_size=200000", "exceeds the target's vocabulary of 128256"),
])
def test_an_eagle3_recipe_beyond_the_target_is_refused_at_config_load(override, message):
    cfg = load_config(ROOT / "configs" / "llama-3.1-8b-instruct-eagle3.yaml", [override])
    with pytest.raises(ConfigError, match=message):
        check_target_config(cfg, check_train_config(cfg.train))


def test_a_dflash_k_beyond_its_block_is_refused_at_config_load():
    cfg = load_config(ROOT / "configs" / "qwen3-8b-dflash.yaml", ["eval.k=17"])
    with pytest.raises(ConfigError, match="eval.k=17: the drafter fills blocks of"):
        check_target_config(cfg, check_train_config(cfg.train))


@pytest.mark.parametrize("draft", ["eagle3", "dflash:2"])
def test_a_kind_vllm_cannot_serve_for_the_architecture_is_refused_with_the_list(tmp_path, draft):
    (tmp_path / "config.json").write_text('{"architectures": ["Gemma3ForCausalLM"], '
                                          '"num_hidden_layers": 26, "vocab_size": 262208}')
    cfg = load_config(None, [f"model.target={tmp_path}", f"train.draft={draft}"])
    with pytest.raises(ConfigError, match="Gemma3ForCausalLM does not. Supported: .*"
                                          "LlamaForCausalLM.*Medusa head"):
        check_target_served(cfg, check_train_config(cfg.train))
    served = load_config(None, [f"model.target={tmp_path}", "train.draft=medusa:4x1"])
    check_target_served(served, check_train_config(served.train))


def test_an_independent_draft_with_another_vocabulary_size_is_refused_at_config_load(tmp_path):
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"], '
                                       '"num_hidden_layers": 28, "vocab_size": 151936}')
    cfg = load_config(ROOT / "configs" / "smollm2-135m-independent.yaml", [
        "model.target=meta-llama/Llama-3.1-8B-Instruct", f"train.draft={draft}"])
    with pytest.raises(ConfigError, match="predicts 151936 tokens, the target 128256"):
        check_target_config(cfg, check_train_config(cfg.train))


@pytest.mark.parametrize("draft", ["eagle3", "dflash:2"])
def test_an_attention_draft_beside_an_mla_target_is_refused_on_a_cpu_only(tmp_path, draft,
                                                                         monkeypatch):
    import serving.engines.vllm as vllm_engine

    (tmp_path / "config.json").write_text('{"architectures": ["DeepseekV3ForCausalLM"], '
                                          '"model_type": "deepseek_v3", "vocab_size": 129280, '
                                          '"num_hidden_layers": 61, "kv_lora_rank": 512}')
    cfg = load_config(None, [f"model.target={tmp_path}", f"train.draft={draft}"])
    monkeypatch.setattr(vllm_engine, "gpu_available", lambda: False)
    with pytest.raises(ConfigError, match=r"vLLM for CPU cannot serve .* \"No common block size"):
        check_target_served(cfg, check_train_config(cfg.train))
    medusa = load_config(None, [f"model.target={tmp_path}", "train.draft=medusa:4x1"])
    check_target_served(medusa, check_train_config(medusa.train))
    own = load_config(None, [f"model.target={tmp_path}", "train.draft=layer-truncated:4"])
    with pytest.raises(ConfigError, match="as DeepSeek's multi-token-prediction module"):
        check_target_served(own, check_train_config(own.train))
    monkeypatch.setattr(vllm_engine, "gpu_available", lambda: True)
    check_target_served(cfg, check_train_config(cfg.train))


HYBRID = {  # tiny configs of targets whose attention layers mix sliding and full attention
    "gemma3": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
               "layer_types": ["sliding_attention"] * 5 + ["full_attention"]
               + ["sliding_attention"] * 2},
    "gpt-oss": {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
                "layer_types": ["sliding_attention", "full_attention"] * 4}}


@pytest.mark.parametrize("target, draft, one", [
    ("gemma3", "layer-truncated:6", "layer-truncated:1"),
    ("gemma3", "pard:layer-truncated:5", "pard:layer-truncated:1"),
    ("gemma3", "fresh:2x64", "layer-truncated:1"),
    ("gpt-oss", "dflash:2", "dflash:1"),
])
def test_a_draft_model_of_several_layers_beside_a_hybrid_attention_target_is_refused(
        tmp_path, target, draft, one):
    (tmp_path / "config.json").write_text(json.dumps({**HYBRID[target], "vocab_size": 49152,
                                                      "num_hidden_layers": 8}))
    cfg = load_config(None, [f"model.target={tmp_path}", f"train.draft={draft}"])
    runs = {"gemma3": "5 x sliding_attention, 1 x full_attention, 2 x sliding_attention",
            "gpt-oss": "4 x sliding_attention and 4 x full_attention, interleaved"}[target]
    with pytest.raises(ConfigError, match=rf"layer draft model sits beside a target .*"
                                          rf"\(in order: {runs}.*same kv cache group.*"
                                          rf"train.draft={one}\)"):
        check_target_served(cfg, check_train_config(cfg.train))
    single = load_config(None, [f"model.target={tmp_path}", f"train.draft={one}"])
    check_target_served(single, check_train_config(single.train))
