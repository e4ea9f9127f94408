import re
from pathlib import Path

import pytest
import yaml

from recipe import Config, ConfigError, Eagle3Config, load_config
from recipe.config import RENAMED, parse_overrides
from tests.helpers import ROOT, recipes

RECIPE = ROOT / "configs" / "smollm2-135m-independent.yaml"


def test_shipped_recipe_loads_and_matches_its_yaml():
    cfg = load_config(RECIPE)
    raw = yaml.safe_load(RECIPE.read_text())
    for section, values in raw.items():
        for key, value in values.items():
            assert getattr(getattr(cfg, section), key) == value, f"{section}.{key}"


def test_both_override_forms_and_types():
    cfg = load_config(RECIPE, ["data.max_prompts=7", "--generation.temperature", "0.5",
                               "--generation.top_p=0.9", "data.sources=[sharegpt, x.jsonl]",
                               "data.max_prompt_tokens=null", "model.dtype=bfloat16"])
    assert cfg.data.max_prompts == 7
    assert cfg.generation.temperature == 0.5 and isinstance(cfg.generation.temperature, float)
    assert cfg.generation.top_p == 0.9 and cfg.generation.do_sample
    assert cfg.data.sources == ["sharegpt", "x.jsonl"]
    assert cfg.data.max_prompt_tokens is None
    assert cfg.model.dtype == "bfloat16"


def test_override_beats_yaml(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("data:\n  max_prompts: 3\n")
    assert load_config(path).data.max_prompts == 3
    assert load_config(path, ["data.max_prompts=4"]).data.max_prompts == 4


@pytest.mark.parametrize("overrides, message", [
    (["data.max_promts=3"], "valid keys of 'data': sources, max_prompts"),
    (["trainer.lr=1"], "valid sections: run, model, data, generation, train, tracking, eval, publish"),
    (["data.max_prompts=many"], "must be an integer"),
    (["model.dtype=float8"], "is not one of"),
    (["generation.max_new_tokens"], "write section.field=value"),
    (["--generation.max_new_tokens"], "has no value"),
])
def test_bad_overrides_name_the_problem(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(RECIPE, overrides)


def test_unknown_key_in_yaml_lists_valid_keys(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("generation:\n  max_tokens: 3\n")
    with pytest.raises(ConfigError, match="unknown key 'generation.max_tokens'.*max_new_tokens"):
        load_config(path)


@pytest.mark.parametrize("overrides, message", [
    (["generation.top_p=0.5"], "no effect with greedy"),
    (["generation.temperature=-1"], "must be >= 0"),
    (["data.sources=[mtbench]"], "never used for training"),
    (["data.held_out_fraction=1.0"], r"in \[0, 1\)"),
    (["model.target=embedded:SmolLM2-135M-Instruct", "model.revision=main"], "only applies"),
    (["eval.draft=null"], "eval.draft is not set"),
    (["eval.methods=[target, medusa]"], "choose from"),
    (["eval.k=0"], r"must be in \[1, 64\]"),
    (["eval.draft_temperature=-0.5"], "0 for argmax drafting"),
    (["eval.draft_top_k=-1"], "null for the target's top_k"),
    (["eval.methods=[target, hf_assisted]", "eval.batch_size=4"], "batch 1 only"),
    (["train.best_by=walk"], "best_by one of"),
    (["train.draft=dflash", "train.block_starts=8", "train.best_by=walk_tau"],
     "set train.block_starts=0"),
])
def test_contradictions_rejected(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(RECIPE, overrides)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(RECIPE, ["generation.temperature=0.7", "generation.top_p=0.95"])
    cfg.save(tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again == cfg and isinstance(again, Config)


def test_parse_overrides_reads_yaml_scalars():
    assert parse_overrides(["a.b=1", "--c.d", "x y", "e.f=true", "g.h=[1, 2]"]) == [
        ("a.b", 1), ("c.d", "x y"), ("e.f", True), ("g.h", [1, 2])]


def test_train_section_reads_yaml_1_1_scalars_and_rejects_bad_losses():
    cfg = load_config(None, ["train.learning_rate=3e-4", "train.mixed_precision=no",
                             "train.loss=0.25*fkl+0.75*tvd"])
    assert cfg.train.learning_rate == 3e-4 and cfg.train.mixed_precision == "no"
    assert cfg.train.loss_terms == [(0.25, "fkl"), (0.75, "tvd")]
    for bad, message in [("train.loss=kl", "weighted mix"), ("train.loss=-1*tvd", "weighted mix"),
                         ("train.warmup_steps=200", "warmup_steps"),
                         ("train.target_logits=topk train.loss=rkl", "reverse KL")]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, bad.split())


def test_tests_write_under_a_temporary_cache(temporary_cache):

    from recipe import cache_root

    assert cache_root() == temporary_cache
    assert Path.home() / ".cache" not in cache_root().parents


@pytest.mark.parametrize("recipe", recipes(embedded=True),
                         ids=lambda p: p.stem)
def test_every_embedded_recipe_loads_with_the_auto_backend(recipe):
    cfg = load_config(recipe)
    assert cfg.generation.backend == "auto" and cfg.generation.batch_size is None


@pytest.mark.parametrize("old,new", sorted(RENAMED.items()))
def test_a_renamed_key_is_refused_naming_its_new_name(old, new, tmp_path):
    with pytest.raises(ConfigError, match=rf"{re.escape(old)} \(command line\) is now "
                                          rf"{re.escape(new)}"):
        load_config(None, [f"{old}=1"])
    section, _, name = old.partition(".")
    recipe = tmp_path / "old.yaml"
    recipe.write_text(f"{section}:\n  {name}: 1\n")
    with pytest.raises(ConfigError, match=rf"is now {re.escape(new)}"):
        load_config(recipe)


def test_a_group_of_keys_reads_as_a_mapping_or_key_by_key(tmp_path):
    recipe = tmp_path / "grouped.yaml"
    recipe.write_text("train:\n  draft: eagle3\n  eagle3:\n    ttt_steps: 3\n    layers: 2\n")
    cfg = load_config(recipe, ["train.eagle3.intermediate_size=64"])
    assert cfg.train.eagle3 == Eagle3Config(ttt_steps=3, intermediate_size=64, layers=2)
    assert cfg.to_dict()["train"]["eagle3"] == {"ttt_steps": 3, "intermediate_size": 64,
                                                "layers": 2, "fc_norm": False,
                                                "norm_output": False}
    saved = tmp_path / "resolved.yaml"
    cfg.save(saved)
    assert load_config(saved) == cfg  # the resolved config reads back, groups included
    for override, message in [("train.eagle3=2", "is a group of keys"),
                              ("train.eagle3.depth=2", "valid keys of 'train.eagle3'"),
                              ("train.draft.x=1", "is a single value")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(None, [override])


def test_a_config_saved_before_the_renames_reads_under_todays_names():
    from recipe.config import with_current_names

    now = load_config(None, ["train.draft=eagle3", "train.eagle3.ttt_steps=3",
                             "train.position_decay=0.7"]).to_dict()
    before = {**now, "train": {k: v for k, v in now["train"].items()
                               if k not in ("eagle3", "position_decay", "aux_layers")}}
    before["train"].update(ttt_steps=3, eagle_intermediate_size=None, eagle_layers=1,
                           head_decay=0.7, eagle_aux_layers=None)
    assert with_current_names(before) == now
