"""Every real recipe's resolved config and its plan under every GPU accelerate config, held
against plans.json (recorded before the planner became a loop over the stages' own estimates and
the kinds' TrainingShape): a refactor that changes what a recipe means or what its run costs
fails here.

    DRAFTSMITH_RECORD_PLANS=1 .venv/bin/python -m pytest tests/test_plan_reference.py
rewrites plans.json instead of checking it (only for a change that means to move them).
"""

from __future__ import annotations

import json
import os
from collections import namedtuple
from pathlib import Path

import pytest

from recipe import Config, load_config
from tests.helpers import plan_of, recipes

REFERENCE = Path(__file__).with_name("plans.json")
ROOT = Path(__file__).resolve().parents[1]
ACCELERATE = sorted(p for p in (ROOT / "configs" / "accelerate").glob("*.yaml")
                    if not p.stem.endswith("cpu") and p.stem != "cpu")
"""GPU launches only: a CPU plan reads this machine's RAM."""
OUTPUT = "/draftsmith-plan-reference/runs"
"""Never created: the plan measures free disk at its first existing parent, /."""


def snapshot(monkeypatch) -> dict:
    import plan.estimate

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(plan.estimate.shutil, "disk_usage",  # a node's 4 TiB
                        lambda path: usage(2**42, 0, 2**42))
    out = {}
    for recipe in recipes(embedded=False):
        cfg = load_config(recipe, [f"run.output_dir={OUTPUT}"])
        out[recipe.stem] = {"config": json.loads(json.dumps(cfg.to_dict(), default=str))}
        for accelerate in ACCELERATE:
            out[recipe.stem][accelerate.stem] = plan_of(cfg, str(accelerate)).text().replace(
                str(accelerate), accelerate.name)
    return out


def test_every_real_recipe_resolves_and_plans_as_recorded(monkeypatch):
    now = snapshot(monkeypatch)
    if os.environ.get("DRAFTSMITH_RECORD_PLANS"):
        REFERENCE.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"recorded {REFERENCE}")
    recorded = json.loads(REFERENCE.read_text())
    assert sorted(now) == sorted(recorded)
    defaults = json.loads(json.dumps(Config().to_dict(), default=str))
    for recipe, entries in recorded.items():
        for key, value in entries.items():
            if key == "config":
                assert config_changes(now[recipe][key], value, defaults) == [], recipe
            else:
                assert now[recipe][key] == value, f"{recipe}: {key} differs from {REFERENCE.name}"


def config_changes(now: dict, recorded: dict, defaults: dict) -> list[str]:
    """'section.key' of every value that differs from the recorded one; a key added since the
    recording counts only when the recipe sets it away from its default (a new key changes
    nothing a recipe meant)."""
    changes = []
    for section, values in now.items():
        for key, value in values.items():
            was = recorded.get(section, {}).get(key, defaults[section][key])
            if isinstance(value, dict) and isinstance(was, dict):  # a group: key by key
                was = {**defaults[section][key], **was}
            if value != was:
                changes.append(f"{section}.{key}: {was!r} -> {value!r}")
    return changes


def test_a_changed_value_or_a_new_key_set_away_from_its_default_is_a_change():
    defaults = {"train": {"loss": "tvd", "lk_eta": 3.0}}
    recorded = {"train": {"loss": "fkl"}}
    assert config_changes({"train": {"loss": "fkl", "lk_eta": 3.0}}, recorded, defaults) == []
    assert config_changes({"train": {"loss": "tvd", "lk_eta": 3.0}}, recorded, defaults) == [
        "train.loss: 'fkl' -> 'tvd'"]
    assert config_changes({"train": {"loss": "fkl", "lk_eta": 1.0}}, recorded, defaults) == [
        "train.lk_eta: 3.0 -> 1.0"]
