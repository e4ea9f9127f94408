"""Which trained draft a run keeps (train.keep): the last step's, or the best by held-out
acceptance (train.best_by), which waits in train/best while training goes on and becomes
train/draft at the end, the last step's draft then in train/last."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from recipe import TrainConfig
from runfolder import RunFolder, train_record, write_train_record
from runfolder.provenance import hardware, source_commit


def draft_record(state, before: dict | None, after: dict) -> dict:
    """What a draft folder's train record says of a draft saved after state's optimizer_step
    (state: train.loop.TrainState; before, after: held-out figures), with the commit and the
    hardware of the process that saved it (a resumed run's: the last)."""
    return {"optimizer_steps": state.optimizer_step, "before": before, "after": after,
            "tokens": state.tokens, "loss_tokens": state.loss_tokens,
            "train_seconds": state.train_seconds, "commit": source_commit(),
            "hardware": hardware()}


class BestDraft:
    """The best draft so far (its record, or None) and the folders it moves between.

    save(folder, record) writes the draft being trained into folder on the main process (every
    process calls it: the weights are gathered from all). dist: train.loop.Dist."""

    def __init__(self, run: RunFolder, cfg: TrainConfig, dist, save: Callable[[Path, dict], None],
                 fresh: bool):
        self.run, self.keep, self.by, self.dist, self.save = run, cfg.keep, cfg.best_by, dist, save
        if fresh:  # no best of an earlier run
            if dist.is_main:
                for folder in (run.best, run.last):
                    shutil.rmtree(folder, ignore_errors=True)
            dist.barrier()
        self.record = train_record(run.best)

    def better(self, record: dict) -> bool:
        """Whether a draft with this record beats the best so far (step 0 never does)."""
        figure = record["after"][self.by]
        best = None if self.record is None else self.record["after"].get(self.by)
        return (self.keep == "best" and record["optimizer_steps"] > 0 and figure is not None
                and (best is None or figure > best))

    def offer(self, record: dict) -> None:
        """The draft after a held-out eval: saved to train/best when better (the main process
        decides for all)."""
        if self.dist.sum(float(self.better(record) and self.dist.is_main)) > 0:
            self.record = record
            self.save(self.run.best, record)

    def finish(self, last: dict) -> dict:
        """Save the last step's draft and move the kept one to train/draft -> its held-out
        figures."""
        run = self.run
        if self.record is None or self.record["optimizer_steps"] == last["optimizer_steps"]:
            self.save(run.draft, last)
            if self.dist.is_main:
                shutil.rmtree(run.best, ignore_errors=True)  # the same draft as train/draft
            return last["after"]
        self.save(run.last, last)
        best = self.record
        if self.dist.is_main:
            kept = {**best, "kept": {"by": self.by, "optimizer_step": best["optimizer_steps"],
                                     "last_optimizer_step": last["optimizer_steps"],
                                     "last": last["after"], "last_folder": str(run.last)}}
            write_train_record(run.best, kept)
            shutil.rmtree(run.draft, ignore_errors=True)
            os.replace(run.best, run.draft)
            print(f"[train] train/draft holds the best draft by held-out {self.by} "
                  f"({best['after'][self.by]:.3f}, optimizer_step {best['optimizer_steps']}); "
                  f"the last step's ({last['after'][self.by]:.3f}, optimizer_step "
                  f"{last['optimizer_steps']}) is in {run.last}")
        self.dist.barrier()
        return best["after"]
