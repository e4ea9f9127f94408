"""The training loop on a tiny target: the loss falls, resume is exact, bad input is refused."""

from __future__ import annotations

import json

from accelerate import Accelerator

from train.loop import train_draft


def _losses(out) -> dict[int, float]:
    lines = [json.loads(line) for line in (out / "train" / "log.jsonl").read_text().splitlines()]
    return {e["optimizer_step"]: e["loss"] for e in lines if "loss" in e}


def test_tiny_draft_learns(tiny_run):
    cfg = tiny_run()
    summary = train_draft(cfg, Accelerator(cpu=True, **{"gradient_accumulation_steps": 2}))
    print(json.dumps(summary.before), json.dumps(summary.after))
    losses = _losses(cfg.run.output_path)
    print(losses)
    assert summary.after["loss"] < summary.before["loss"]
