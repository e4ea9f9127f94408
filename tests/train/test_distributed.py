"""DDP (gloo) and DeepSpeed ZeRO-2 with 2 CPU processes follow the single-process run.

With 2 processes x 2 micro_steps the run sees the same micro-batches per optimizer_step as
1 process x 4 micro_steps, and the loss is normalised by the step's total tokens, so the loss
curves agree up to the order of floating-point sums.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from accelerate import Accelerator

from tests.helpers import ROOT, recipe_path
from train import accelerator_kwargs, train_draft

pytestmark = pytest.mark.slow  # launches distill.py / accelerate processes


def _losses(out: Path) -> dict[int, float]:
    lines = [json.loads(x) for x in (out / "train" / "log.jsonl").read_text().splitlines()]
    return {e["optimizer_step"]: e["loss"] for e in lines if "loss" in e}


@pytest.fixture
def single_process_curve(tiny_run):
    cfg = tiny_run("train.gradient_accumulation_steps=4", "train.max_steps=4",
                   "train.save_every=2")
    train_draft(cfg, Accelerator(**accelerator_kwargs(cfg)))
    return _losses(cfg.run.output_path)


@pytest.mark.parametrize("launch_config", ["ddp-cpu.yaml", "deepspeed-zero2-cpu.yaml",
                                           "fsdp-cpu.yaml", "deepspeed-zero3-cpu.yaml"])
def test_two_processes_match_one(tiny_run, tiny_target, tiny_stage1, tmp_path, launch_config,
                                 single_process_curve):
    from tests.helpers import tiny_overrides

    prompts, source = tiny_stage1
    out = tmp_path / "dist"
    out.mkdir()
    for name in ("data", "manifest.json"):
        os.symlink(source / name, out / name)
    overrides = tiny_overrides(tiny_target, prompts, out) + [
        "train.gradient_accumulation_steps=2", "train.max_steps=4", "train.save_every=2"]
    accelerate = Path(sys.executable).parent / "accelerate"
    result = subprocess.run(
        [str(accelerate), "launch", "--config_file", str(ROOT / "configs" / "accelerate" /
                                                          launch_config),
         str(ROOT / "distill.py"), "--config",
         recipe_path("smollm2-135m-independent"), "--stage", "train", *overrides],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = _losses(out)
    assert list(losses) == [1, 2, 3, 4]
    for step, loss in single_process_curve.items():
        assert losses[step] == pytest.approx(loss, abs=1e-4), (step, losses, single_process_curve)
    assert (out / "train" / "checkpoints" / "step-00000004").is_dir()
    assert (out / "train" / "draft" / "model.safetensors").is_file()
