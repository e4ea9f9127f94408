"""The device check (benchmarks/gpu_check.py) on this CPU: its probes and report on the tiny shape,
its reading of the device tier's results, and its imports on a machine without datasets, vLLM,
DeepSpeed or gguf (the GPU machine's environment)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_check import main, run_tests
from tests.helpers import ROOT

HIDDEN = ("datasets", "vllm", "deepspeed", "gguf")


def test_the_check_probes_the_tiny_shape_and_writes_its_table(tmp_path):
    code = main(["--device", "cpu", "--out", str(tmp_path), "--shapes", "tiny", "--skip-tests",
                 "--repeats", "1", "--new-tokens", "8", "--train-steps", "2"])
    assert code == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    tiny = report["shapes"]["tiny"]
    assert set(tiny) == {"generation", "verification", "engine", "training"}
    assert sorted(map(int, tiny["verification"]["chain_ms"])) == list(range(1, 10))
    assert tiny["engine"]["self_draft_tau"] == 5.0  # the target drafting for itself: k + 1
    assert set(tiny["training"]) == {"independent", "medusa", "eagle3", "dflash", "pard"}
    assert all(t["tokens_per_s"] > 0 for t in tiny["training"].values())
    table = (tmp_path / "gpu_check.md").read_text()
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                  .splitlines() if line.startswith("model name")), None)
    if model is not None:  # names the hardware it ran on: this machine's CPU model
        assert model in table
    assert "| training tokens/s, eagle3 |" in table


def test_the_device_tiers_results_are_read_from_pytest(tmp_path):
    found = run_tests("cpu", tmp_path, timeout_s=300, tests=(
        "tests/gpu/test_on_device.py::test_predicted_acceptance_is_the_same_on_the_device",))
    assert found["exit_code"] == 0 and found["tests"] == 1 and found["failures"] == 0, found


BLOCK = f"""
import sys
for name in {HIDDEN!r}:  # as absent as an uninstalled package: import fails, find_spec is None
    sys.modules[name] = None
"""


@pytest.mark.slow  # a Python process that runs part of the device tier
def test_the_check_and_its_tier_import_without_datasets_vllm_deepspeed_and_gguf(tmp_path):
    script = BLOCK + f"""
import pytest
from benchmarks.gpu_check import main
assert main(["--device", "cpu", "--out", {str(tmp_path)!r}, "--shapes", "tiny",
             "--skip-tests", "--repeats", "1", "--new-tokens", "4", "--train-steps", "2"]) == 0
sys.exit(pytest.main(["tests/gpu", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                      "-k", "acceptance or ddp or training or (greedy and eagle3)"]))
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "passed" in done.stdout and "failed" not in done.stdout
    for name in HIDDEN:  # and the blocker did hide them
        blocked = subprocess.run([sys.executable, "-c", BLOCK + f"import {name}"], cwd=ROOT,
                                 capture_output=True, text=True, check=False)
        assert blocked.returncode != 0 and "ModuleNotFoundError" in blocked.stderr
