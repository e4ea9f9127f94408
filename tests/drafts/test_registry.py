"""The registry: every spec and folder goes to its kind, every recipe passes its kind's checks,
and what no kind can do is refused with a message naming the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from drafts import KINDS, check_train_config, kind_of
from recipe import ConfigError, Eagle3Config, TrainConfig, load_config

RECIPES = sorted(Path("configs").glob("*.yaml"))


@pytest.mark.parametrize(("spec", "kind"), [
    ("layer-truncated:6", "independent"), ("fresh:2x64", "independent"), ("self", "independent"),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "independent"), ("medusa:4x1", "medusa"),
    ("medusa:four", "medusa"), ("eagle3", "eagle3"), ("eagle", "eagle3"),
    ("prompt-lookup", "prompt-lookup"), ("dflash", "dflash"), ("dflash:2", "dflash"),
    ("dspark", "dspark"), ("dspark:2", "dspark"),
    ("pard:layer-truncated:6", "pard"), ("pard:/some/trained/draft", "pard"),
])
def test_each_spec_goes_to_its_kind(spec, kind):
    assert kind_of(spec).name == kind


@pytest.mark.parametrize(("config", "kind"), [
    ({"model_type": "medusa", "architectures": ["MedusaModel"]}, "medusa"),
    ({"model_type": "llama", "architectures": ["LlamaForCausalLMEagle3"]}, "eagle3"),
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "independent"),
    ({"model_type": "qwen3", "architectures": ["DFlashDraftModel"]}, "dflash"),
    ({"model_type": "qwen3", "architectures": ["Qwen3DSparkModel"]}, "dspark"),
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "pard_token": 16}, "pard"),
])
def test_a_saved_folder_goes_to_its_kind_by_its_config(tmp_path, config, kind):
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert kind_of(tmp_path).name == kind == kind_of(str(tmp_path)).name


def test_the_registry_names_each_kind_once_and_the_catch_all_last():
    names = [k.name for k in KINDS]
    assert len(set(names)) == len(names) and names[-1] == "independent"


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_recipe_loads_and_passes_its_kinds_checks(recipe):
    cfg = load_config(recipe)
    assert check_train_config(cfg.train) is kind_of(cfg.train.draft)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"draft": "prompt-lookup"}, "nothing to train"),
    ({"draft": "eagle"}, "the EAGLE-3 head is 'eagle3'"),
    ({"draft": "eagle3", "eagle3": Eagle3Config(ttt_steps=2), "eval_k": 3},
     "raise train.eagle3.ttt_steps"),
    ({"draft": "eagle3", "lora_rank": 4}, "train.lora_rank=0"),
    ({"draft": "layer-truncated:zero"}, "expected a positive integer"),
    ({"draft": "fresh:2x0"}, "expected a positive integer"),
    ({"draft": "dflash:0"}, "positive layer count"),
    ({"draft": "dflash", "block_size": 2, "eval_k": 3}, "raise block_size"),
    ({"draft": "dflash", "target_logits": "topk"}, "train.target_logits=online"),
    ({"draft": "pard:"}, "names no draft"),
    ({"draft": "pard:layer-truncated:x"}, "expected a positive integer"),
    ({"draft": "pard:layer-truncated:2", "block_size": 3, "eval_k": 4}, "raise block_size"),
])
def test_what_a_kind_cannot_train_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_train_config(TrainConfig(**overrides))


@pytest.mark.parametrize("spec", ["prompt-lookup", "medusa:2x1"])
def test_compiled_steps_are_refused_for_kinds_without_them(spec):
    from drafts import load_draft
    from tests.helpers import tiny_llama

    assert [k.name for k in KINDS if k.compiled_steps] == ["eagle3", "pard", "independent"]
    with pytest.raises(ConfigError, match="only eagle3, pard, independent drafts run compiled: set "
                                          "eval.draft_compile=false"):
        load_draft(spec, tiny_llama(64), None, None, None, compile=True)


def test_an_independent_draft_compiled_steps_cannot_run_is_refused_at_load():
    from transformers import GPT2Config, GPT2LMHeadModel

    from drafts import load_draft
    from tests.helpers import tiny_llama

    loaded = load_draft("layer-truncated:1", tiny_llama(64, layers=2), None, None, None,
                        compile=True)
    assert loaded.compile and loaded.name.endswith("compiled")
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2))
    with pytest.raises(ConfigError, match="gpt2 model: set eval.draft_compile=false"):
        load_draft("self", gpt2, None, None, None, compile=True)
