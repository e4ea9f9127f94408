"""DDP (gloo) and DeepSpeed ZeRO-2 with 2 CPU processes follow the single-process run, for an
independent draft.

With 2 processes x 2 micro_steps the run sees the same micro-batches per optimizer_step as
1 process x 4 micro_steps, and the loss is normalised by the step's total tokens, so the loss
curves agree up to the order of floating-point sums. The sharded launches, FSDP2 and ZeRO-3 (an
EAGLE-3 head), are held to the 1-process curve and gradient norms over 24 steps and a SIGKILL by
tests/train/test_loop.py::test_sigkill_mid_run_then_the_same_command_resumes_to_the_same_curve:
one pair of launches proves both.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from accelerate import Accelerator

from tests.helpers import ROOT, accelerate_launch, recipe_path
from train import accelerator_kwargs, train_draft

pytestmark = pytest.mark.slow  # launches distill.py / accelerate processes


def _losses(out: Path, key: str = "loss") -> dict[int, float]:
    lines = [json.loads(x) for x in (out / "train" / "log.jsonl").read_text().splitlines()]
    return {e["optimizer_step"]: e[key] for e in lines if e.get(key) is not None}


@pytest.mark.parametrize("launch_config", ["ddp-cpu.yaml", "deepspeed-zero2-cpu.yaml"])
def test_two_processes_match_one(tiny_run, tiny_target, tiny_stage1, tmp_path, launch_config):
    from tests.helpers import tiny_overrides

    cfg = tiny_run("train.gradient_accumulation_steps=4", "train.max_steps=4",
                   "train.save_every=2")
    train_draft(cfg, Accelerator(**accelerator_kwargs(cfg)))
    single_process_curve = _losses(cfg.run.output_path)
    single_process_norms = _losses(cfg.run.output_path, "grad_norm")
    prompts, source = tiny_stage1
    out = tmp_path / "dist"
    out.mkdir()
    for name in ("data", "manifest.json"):
        os.symlink(source / name, out / name)
    overrides = tiny_overrides(tiny_target, prompts, out) + [
        "train.gradient_accumulation_steps=2", "train.max_steps=4",
        "train.save_every=2"]
    result = subprocess.run(
        [*accelerate_launch(launch_config), str(ROOT / "distill.py"), "--config",
         recipe_path("smollm2-135m-independent"), "--stage", "train", *overrides],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = _losses(out)
    assert list(losses) == [1, 2, 3, 4]
    for step, loss in single_process_curve.items():
        assert losses[step] == pytest.approx(loss, abs=1e-4), (step, losses, single_process_curve)
    # the gradient before clipping (at 1.0, which with AdamW would hide a constant error in the
    # cross-process gradient scale from the loss curve): the same norm at every step
    norms = _losses(out, "grad_norm")
    assert sorted(single_process_norms) == [1, 2, 3, 4] and sorted(norms) == [1, 2, 3, 4]
    for step, norm in single_process_norms.items():
        assert norms[step] == pytest.approx(norm, rel=1e-3), (step, norms, single_process_norms)
    assert (out / "train" / "checkpoints" / "step-00000004").is_dir()
    assert (out / "train" / "draft" / "model.safetensors").is_file()
