"""What a person watches while a draft trains: a progress line with ETA, the W&B run (the same
one after a resume), and the training curve as a picture in the run folder."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path

from recipe import Config
from runfolder import RunFolder


def eta_seconds(step: int, total: int, first_step: int, elapsed: float) -> float | None:
    """The time left at `step` of `total`, from this invocation's pace (steps since first_step in
    elapsed seconds); None before a step of it is done."""
    done = step - first_step
    return None if done <= 0 else (total - step) * elapsed / done


def clock(seconds: float | None) -> str:
    """1 h 02 min, 4 min 05 s, 12 s; '?' when unknown."""
    if seconds is None:
        return "?"
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    return f"{s // 60} min {s % 60:02d} s" if s >= 60 else f"{s} s"


class Progress:
    """The main process's progress: a tqdm bar on a terminal; in a log file (not a TTY) one line
    at most every `every_s` seconds, and always at the last step."""

    def __init__(self, total: int, first_step: int, every_s: float, enabled: bool,
                 stream=None):
        self.total, self.first, self.every_s = total, first_step, every_s
        self.stream = stream or sys.stderr
        self.started = self.last_line = time.monotonic()
        self.bar = None
        self.enabled = enabled and first_step < total
        if self.enabled and self.stream.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=first_step, unit="step", desc="train",
                            file=self.stream, dynamic_ncols=True)

    def update(self, entry: dict) -> None:
        if not self.enabled:
            return
        step = entry["optimizer_step"]
        now = time.monotonic()
        eta = eta_seconds(step, self.total, self.first, now - self.started)
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(loss=f"{entry['loss']:.4f}",
                                 tok_s=f"{entry['tokens_per_s']:.0f}", refresh=False)
            if step >= self.total:
                self.bar.close()
            return
        if self.every_s and (now - self.last_line >= self.every_s or step >= self.total):
            self.last_line = now
            print(f"[train] optimizer_step {step}/{self.total} ({100 * step / self.total:.0f} %)"
                  f": loss {entry['loss']:.4f}, {entry['tokens_per_s']:.0f} tokens/s, ETA "
                  f"{clock(eta)}", file=self.stream, flush=True)


def wandb_mode(cfg: Config) -> str:
    """tracking.wandb_mode, else the environment's WANDB_MODE, else offline."""
    return cfg.tracking.wandb_mode or os.environ.get("WANDB_MODE") or "offline"


def wandb_init_kwargs(cfg: Config, run: RunFolder) -> dict:
    """wandb.init's arguments: the run id kept in the run folder (made at the first start), so a
    resumed training logs into the same W&B run; the recipe's entity, group and tags."""
    path = run.wandb_run_id
    if path.is_file():
        run_id = path.read_text().strip()
    else:
        run_id = uuid.uuid4().hex[:12]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(run_id + "\n")
    t = cfg.tracking
    return {"name": cfg.run.name, "dir": str(run.train), "id": run_id, "resume": "allow",
            **({"entity": t.entity} if t.entity else {}),
            **({"group": t.group} if t.group else {}), **({"tags": list(t.tags)} if t.tags else {})}


def draw_curve(entries: list[dict], out: Path, best_by: str) -> None:
    """log.jsonl's entries -> a picture: the training loss by optimizer_step and the held-out
    loss and acceptance (best_by, e.g. walk_tau) at each held-out evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [(e["optimizer_step"], e["loss"]) for e in entries if "loss" in e]
    held = [(e["optimizer_step"], e["held_out"]) for e in entries if "held_out" in e]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    if steps:
        left.plot(*zip(*steps), lw=1, label="train")
    if held:
        left.plot([s for s, _ in held], [h["loss"] for _, h in held], "o-", label="held-out")
        figures = [(s, h.get(best_by)) for s, h in held if h.get(best_by) is not None]
        if figures:
            right.plot(*zip(*figures), "o-", color="C2")
    left.set(xlabel="optimizer_step", ylabel="loss", title="loss")
    left.legend()
    right.set(xlabel="optimizer_step", ylabel=best_by, title=f"held-out {best_by}")
    fig.tight_layout()
    tmp = out.with_name(out.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(out)


class Stopped(RuntimeError):
    """Training stopped on SIGTERM (a scheduler's preemption) after saving a checkpoint; the same
    command resumes from it."""


class TermSignal:
    """Within: a SIGTERM is noted, not fatal (requested turns True), so the loop can finish its
    optimizer step and save; the previous handler is restored after. Outside the main thread
    (where Python cannot install handlers) nothing is noted."""

    def __init__(self):
        self.requested, self.previous = False, None

    def __enter__(self) -> TermSignal:
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, self._note)
        return self

    def _note(self, signum, frame) -> None:
        self.requested = True

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)
