"""distill.py under `accelerate launch` with 2 processes (gloo on CPU): the main process's own
stages run after the last collective, so they may outlast the process group's timeout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, recipe_path

pytestmark = pytest.mark.slow  # launches accelerate processes

ACCELERATE = str(Path(sys.executable).parent / "accelerate")
DDP = str(ROOT / "configs" / "accelerate" / "ddp-cpu.yaml")


def test_the_main_process_may_evaluate_longer_than_the_collective_timeout(tmp_path):
    timeout_s, eval_s = 3, 12
    result = subprocess.run(
        [ACCELERATE, "launch", "--config_file", DDP, "-m", "tests.launched.slow_main_process",
         str(tmp_path), str(eval_s), "--config", recipe_path("smollm2-135m-independent"),
         "--stage", "eval", f"run.collective_timeout_minutes={timeout_s / 60}",
         f"run.output_dir={tmp_path / 'run'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("eval-rank*")) == ["eval-rank0"]
