"""SpecForge's CLI (`specforge train|export`) on a CPU. Runs in the peer's own venv
(benchmarks/side_by_side.py makes it) and imports nothing of draftsmith.

    <peer venv>/bin/python specforge_cpu.py train --config run.yaml
    <peer venv>/bin/python specforge_cpu.py export --to hf ...

SpecForge 0.2.0 on a CPU needs one patch, applied here at run time, never in the installed
package: its EAGLE-3 loss is a Triton kernel (`specforge.core.loss.LogSoftmaxLoss`), which
needs a GPU; the same formula in torch (the reference `_compute_loss` beside it, without its
torch.compile) takes its place.

With SIDE_BY_SIDE_STEP_LOG set, every training micro-step appends one JSON line to that file:
the tokens of its batch (the attention mask's sum, padding excluded), its seconds, and whether
the optimizer stepped. That is the same clock our trainer keeps per step (forward, backward,
optimizer), and it is how the side by side reads the peer's training tokens/s.
"""

import json
import os
import sys
import time

import torch


def soft_label_loss(logits, target_p, position_mask):
    """-sum_v p_target(v) log q_draft(v) over masked positions, averaged over [B, T]: what
    LogSoftmaxLoss computes (specforge.core.loss._compute_loss is its reference)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -torch.sum(position_mask * target_p * logp, dim=-1).mean()


class TorchLogSoftmaxLoss:
    @staticmethod
    def apply(logits, target_p, position_mask):
        return soft_label_loss(logits, target_p, position_mask)


def patch_for_cpu() -> None:
    from specforge.algorithms.eagle3 import model

    model.LogSoftmaxLoss = TorchLogSoftmaxLoss


def log_steps(path: str) -> None:
    from specforge.training.controller import TrainerCore

    train_step = TrainerCore.train_step

    def timed(self, batch, ctx=None):
        start = time.perf_counter()
        result = train_step(self, batch, ctx)
        seconds = time.perf_counter() - start
        tokens = int(batch.tensors["attention_mask"].sum())
        with open(path, "a") as f:
            f.write(json.dumps({"tokens": tokens, "seconds": seconds,
                                "optimizer_stepped": bool(result.optimizer_stepped)}) + "\n")
        return result

    TrainerCore.train_step = timed


def main(argv: list[str]) -> int:
    patch_for_cpu()
    if os.environ.get("SIDE_BY_SIDE_STEP_LOG"):
        log_steps(os.environ["SIDE_BY_SIDE_STEP_LOG"])
    from specforge.cli import main as cli

    return cli(argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
