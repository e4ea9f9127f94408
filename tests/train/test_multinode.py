"""Two machines on one host: two `accelerate launch` commands (--num_machines 2, machine rank
0 and 1, 127.0.0.1 as the main machine) write the stage-1 data and the loss curve of one
machine with 2 processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runfolder import read_columns, read_manifest
from tests.helpers import (
    ROOT,
    chat_records,
    free_port,
    kill_process_tree,
    recipe_path,
    tiny_overrides,
    write_jsonl,
)

pytestmark = pytest.mark.slow  # launches accelerate processes

ACCELERATE = str(Path(sys.executable).parent / "accelerate")
DDP = str(ROOT / "configs" / "accelerate" / "ddp-cpu.yaml")


def _one_machine(args: list[str]) -> None:
    result = subprocess.run([ACCELERATE, "launch", "--config_file", DDP, *args], cwd=ROOT,
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]


def _two_machines(args: list[str]) -> None:
    """Machine 0 and machine 1, one process each, meeting at 127.0.0.1:<port>."""
    port = str(free_port())
    machines = [subprocess.Popen(
        [ACCELERATE, "launch", "--config_file", DDP, "--num_machines", "2", "--num_processes",
         "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
         "--main_process_port", port, *args], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        for rank in (0, 1)]
    try:
        logs = [m.communicate(timeout=600)[0] for m in machines]
    finally:
        for m in machines:
            kill_process_tree(m.pid)
    for rank, (machine, log) in enumerate(zip(machines, logs)):
        assert machine.returncode == 0, (rank, log[-3000:])


def _stage(stage: str, out: Path, overrides: list[str]) -> list[str]:
    return [str(ROOT / "distill.py"), "--config", recipe_path("smollm2-135m-independent"),
            "--stage", stage, *overrides, f"run.output_dir={out}"]


def test_two_machines_write_the_data_of_one_machine_with_two_processes(tiny_target, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", chat_records(8))
    overrides = tiny_overrides(tiny_target, prompts, tmp_path) + ["generation.batch_size=2"]
    _one_machine(_stage("distill", tmp_path / "one", overrides))
    _two_machines(_stage("distill", tmp_path / "two", overrides))
    columns = ["id", "input_ids", "loss_mask", "messages", "topk_ids"]
    one, two = (sorted(read_columns(tmp_path / name / "data", columns), key=lambda r: r["id"])
                for name in ("one", "two"))
    assert len(one) == 8 and one == two
    assert read_manifest(tmp_path / "two")["status"] == "complete"
    ranks = {p.name.split("-")[1] for p in (tmp_path / "two" / "data").glob("*.parquet")}
    assert ranks == {"r0", "r1"}  # each machine wrote its share


def test_two_machines_train_the_curve_of_one_machine_with_two_processes(tiny_target,
                                                                       tiny_stage1, tmp_path):
    prompts, source = tiny_stage1
    runs = {}
    for name, launch in (("one", _one_machine), ("two", _two_machines)):
        out = tmp_path / name
        out.mkdir()
        for item in ("data", "manifest.json"):
            os.symlink(source / item, out / item)
        launch(_stage("train", out, tiny_overrides(tiny_target, prompts, out) + [
            "train.gradient_accumulation_steps=2", "train.max_steps=4", "train.save_every=2"]))
        lines = [json.loads(x) for x in (out / "train" / "log.jsonl").read_text().splitlines()]
        runs[name] = {e["optimizer_step"]: e["loss"] for e in lines if "loss" in e}
    assert list(runs["two"]) == [1, 2, 3, 4]
    for step, loss in runs["one"].items():
        assert runs["two"][step] == pytest.approx(loss, abs=1e-6), (step, runs)
