"""Each draft kind's loss curve on the tiny target, held against curves recorded from the code
before the draft-kind registry: a refactor that changes what any kind trains fails here.

    DRAFTSMITH_RECORD_CURVES=1 .venv/bin/python -m pytest tests/train/test_loss_curves.py
rewrites loss_curves.json instead of checking it (only for a change that means to move them).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

from train import accelerator_kwargs, train_draft

REFERENCE = Path(__file__).with_name("loss_curves.json")
KINDS = {
    "independent": ("train.draft=layer-truncated:1", "train.loss=0.5*fkl+0.5*tvd"),
    "medusa": ("train.draft=medusa:3x1", "train.loss=fkl", "train.learning_rate=1e-2"),
    "eagle3": ("train.draft=eagle3", "train.aux_layers=[0,1,1]",
               "train.draft_vocab_size=1024", "train.eagle3.ttt_steps=3", "train.loss=fkl"),
}
TOLERANCE = 3e-6
"""Relative to max(1, |value|). The curves are fp32 on one thread, yet CPUs differ in their
kernels: a 2-core Intel Xeon with AVX512-BF16/AMX differs from loss_curves.json (recorded at
commit 8ef852a on a 2-core x86 CPU whose model was not recorded) by at most 6.0e-7 (independent
4.6e-7, medusa 6.0e-7, eagle3 1.8e-7), and CI's machines of other models stayed within 1e-6.
5x that spread still fails any change of what a kind trains: multiplying Medusa's head decay by
0.99 moves its curve by 2.8e-4."""


def curve(cfg) -> dict:
    """Training losses per optimizer_step and the held-out loss and predicted tau per eval."""
    torch.set_num_threads(1)  # one summation order, whatever the machine's core count
    try:
        train_draft(cfg, Accelerator(**accelerator_kwargs(cfg)))
    finally:
        torch.set_num_threads(_THREADS)
    log = [json.loads(line) for line in
           (cfg.run.output_path / "train" / "log.jsonl").read_text().splitlines()]
    return {"loss": [e["loss"] for e in log if "loss" in e],
            "held_out": [[e["held_out"][key] for key in ("loss", "tau", "greedy_tau")]
                         for e in log if "held_out" in e]}


_THREADS = torch.get_num_threads()


def _flat(value) -> list[float]:
    if isinstance(value, list):
        return [x for v in value for x in _flat(v)]
    if isinstance(value, dict):
        return [x for key in sorted(value) for x in _flat(value[key])]
    return [float(value)]


@pytest.mark.parametrize("kind", list(KINDS))
def test_loss_curves_are_unchanged(tiny_run, kind):
    got = curve(tiny_run(*KINDS[kind]))
    if os.environ.get("DRAFTSMITH_RECORD_CURVES"):
        recorded = json.loads(REFERENCE.read_text()) if REFERENCE.is_file() else {}
        REFERENCE.write_text(json.dumps({**recorded, kind: got}, indent=1) + "\n")
        pytest.skip(f"recorded the {kind} curve in {REFERENCE}")
    want = json.loads(REFERENCE.read_text())[kind]
    a, b = _flat(got), _flat(want)
    assert len(a) == len(b)
    worst = max(abs(x - y) / max(1.0, abs(y)) for x, y in zip(a, b))
    assert worst <= TOLERANCE and all(math.isfinite(x) for x in a), (
        f"{kind}: the loss curve moved by {worst:.2e} (relative)\n  now  {got}\n  was  {want}")

