"""The same training under every launch: one process, then 2 processes under each CPU accelerate
config and as two machines on one host; prints the loss at every optimizer step and each
launch's largest difference from the single process.

    python -m benchmarks.distributed_curves --config configs/smollm2-135m-eagle3.yaml \
        [--launches one,ddp-cpu,deepspeed-zero2-cpu,deepspeed-zero3-cpu,fsdp-cpu,two-machines] \
        [section.key=value ...]

The run's stage-1 data must exist (run.output_dir, or the recipe's run folder); each launch
trains into <run>/curves/<launch>/ (the data linked, not copied), with
train.gradient_accumulation_steps G for 2 processes and 2 G for one, so every optimizer step
sees the same micro-batches. A launch that already finished is read, not redone.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from runfolder.paths import RunFolder

ROOT = Path(__file__).resolve().parent.parent
ACCELERATE = Path(sys.executable).parent / "accelerate"
LAUNCHES = ["one", "ddp-cpu", "deepspeed-zero2-cpu", "deepspeed-zero3-cpu", "fsdp-cpu",
            "two-machines"]


def _commands(launch: str, train: list[str]) -> list[list[str]]:
    """The command lines of one launch (two for two machines, started together)."""
    if launch == "one":
        return [[sys.executable, *train]]
    config = ["--config_file", str(ROOT / "configs" / "accelerate" / (
        "ddp-cpu.yaml" if launch == "two-machines" else f"{launch}.yaml"))]
    if launch != "two-machines":
        return [[str(ACCELERATE), "launch", *config, *train]]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    return [[str(ACCELERATE), "launch", *config, "--num_machines", "2", "--num_processes", "2",
             "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
             "--main_process_port", port, *train] for rank in (0, 1)]


def main(argv: list[str] | None = None) -> int:
    from recipe import ConfigError, load_config
    from runfolder import run_folder

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--launches", default=",".join(LAUNCHES))
    args, overrides = parser.parse_known_args(argv)
    launches = args.launches.split(",")
    if unknown := [name for name in launches if name not in LAUNCHES]:
        print(f"error: unknown launch {unknown}: choose from {LAUNCHES}", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    source = run_folder(cfg).root
    if not run_folder(cfg).manifest.is_file():
        print(f"error: no stage-1 data in {source}: run `distill.py --config {args.config} "
              "--stage distill` with the same overrides first.", file=sys.stderr)
        return 2
    G = cfg.train.gradient_accumulation_steps
    curves, seconds = {}, {}
    for launch in launches:
        out = source / "curves" / launch
        log = RunFolder(out).train_log
        if not RunFolder(out).draft.is_dir():
            out.mkdir(parents=True, exist_ok=True)
            for item in ("data", "manifest.json"):
                if not (out / item).exists():
                    os.symlink(source / item, out / item)
            steps = 2 * G if launch == "one" else G
            train = [str(ROOT / "distill.py"), "--config", args.config, "--stage", "train",
                     *overrides, f"run.output_dir={out}",
                     f"train.gradient_accumulation_steps={steps}"]
            start = time.perf_counter()
            processes = [subprocess.Popen(c, cwd=ROOT, stdout=subprocess.DEVNULL,
                                          stderr=open(out / f"launch-{i}.log", "w"))
                         for i, c in enumerate(_commands(launch, train))]
            codes = [p.wait() for p in processes]
            seconds[launch] = time.perf_counter() - start
            if any(codes):
                print(f"[curves] {launch}: exit {codes}, see {out}/launch-*.log", flush=True)
                continue
        lines = [json.loads(x) for x in log.read_text().splitlines()]
        curves[launch] = {e["optimizer_step"]: e["loss"] for e in lines if "loss" in e}
        print(f"[curves] {launch}: {len(curves[launch])} optimizer steps"
              + (f" in {seconds[launch]:.0f} s" if launch in seconds else " (read)"), flush=True)
    steps = sorted(set().union(*curves.values())) if curves else []
    print(f"\ntrain.draft={cfg.train.draft}, {len(steps)} optimizer steps of "
          f"{2 * G} micro-batches x {cfg.train.micro_batch_size}, "
          f"mixed_precision={cfg.train.mixed_precision}; loss per optimizer_step\n")
    names = list(curves)
    print("| optimizer_step | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for step in steps:
        print(f"| {step} | " + " | ".join(f"{curves[n].get(step, float('nan')):.6f}"
                                          for n in names) + " |")
    if "one" in curves:
        print("| max abs difference from one | " + " | ".join(
            f"{max(abs(curves[n].get(s, float('nan')) - curves['one'][s]) for s in steps):.1e}"
            for n in names)
            + " |")
    return 0 if len(curves) == len(launches) else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
