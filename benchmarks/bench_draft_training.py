"""Benchmark: predicted acceptance of the draft before and after distillation, per loss.

    python -m benchmarks.bench_draft_training --config configs/smollm2-135m-independent.yaml \
        --losses ce,tvd,fkl [section.key=value ...]

Each loss trains the same initial draft (train.draft) with the same budget (train.max_steps
optimizer steps of the same batches) on this run's stage-1 data, into
<output>/bench-train/<loss>/ (resumable: a finished loss is not redone). Prints, per loss, the
held-out predicted tau for k = train.eval_k (sampling at T=1 and greedy) before and after,
the ratio, the training throughput and the CPU time; writes bench-train/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from runfolder.paths import RunFolder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--losses", default="ce,tvd,fkl",
                        help="comma-separated train.loss values, one training run each")
    args, overrides = parser.parse_known_args(argv)

    from accelerate import Accelerator

    from recipe import ConfigError, load_config
    from train import accelerator_kwargs, train_draft

    try:
        base = load_config(args.config, overrides)
        losses = [loss.strip() for loss in args.losses.split(",") if loss.strip()]
        configs = {}
        for loss in losses:
            out = base.run.output_path / "bench-train" / loss.replace("*", "x").replace("+", "_")
            configs[loss] = load_config(args.config, [*overrides, f"train.loss={loss}",
                                                      f"run.output_dir={out}"])
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    data = base.run.output_path
    if not (data / "manifest.json").is_file():
        print(f"error: no stage-1 data in {data}: run `distill.py --config {args.config} "
              "--stage distill` first.", file=sys.stderr)
        return 2

    rows = []
    for loss, cfg in configs.items():
        out = cfg.run.output_path
        out.mkdir(parents=True, exist_ok=True)
        for name in ("data", "manifest.json"):  # every loss reads the same stage-1 data
            if not (out / name).exists():
                os.symlink(data / name, out / name)
        accelerator = Accelerator(**accelerator_kwargs(cfg))
        wall, cpu = time.perf_counter(), time.process_time()
        summary = train_draft(cfg, accelerator)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        timing = out / "bench_timing.json"
        if summary.history:  # trained (or resumed) now: record this process's time
            previous = json.loads(timing.read_text()) if timing.is_file() else {"wall_s": 0,
                                                                               "cpu_s": 0}
            timing.write_text(json.dumps({"wall_s": previous["wall_s"] + wall,
                                          "cpu_s": previous["cpu_s"] + cpu}) + "\n")
        spent = json.loads(timing.read_text()) if timing.is_file() else {"wall_s": None,
                                                                         "cpu_s": None}
        rows.append({"loss": loss, "steps": summary.optimizer_steps, "before": summary.before,
                     "after": summary.after, "tokens": summary.tokens,
                     "loss_tokens": summary.loss_tokens, "train_seconds": summary.train_seconds,
                     "tokens_per_s": summary.tokens / max(summary.train_seconds, 1e-9),
                     "wall_s": spent["wall_s"], "cpu_s": spent["cpu_s"],
                     "curve": _curve(RunFolder(out).train_log)})

    t = base.train
    print(f"\ndraft {t.draft}, {t.max_steps} optimizer steps x {t.micro_batch_size} x "
          f"{t.gradient_accumulation_steps} conversations, lr {t.learning_rate}, precision "
          f"{accelerator_kwargs(base)['mixed_precision']}; predicted tau for k={t.eval_k} on held-out data "
          "(sampled T=1 | greedy)")
    print("| loss | tau before | tau after | after/before | alpha after (T=1) | tokens | "
          "tokens/s | wall s | CPU s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b, a = r["before"], r["after"]
        print(f"| {r['loss']} | {b['tau']:.3f} / {b['greedy_tau']:.3f} | {a['tau']:.3f} / "
              f"{a['greedy_tau']:.3f} | {a['tau'] / b['tau']:.2f}x / "
              f"{a['greedy_tau'] / b['greedy_tau']:.2f}x | {a['alpha']} | {r['tokens']} | "
              f"{r['tokens_per_s']:.0f} | {_fmt(r['wall_s'])} | {_fmt(r['cpu_s'])} |")
    print("\nheld-out predicted tau (T=1 | greedy) by optimizer_step:")
    for r in rows:
        print(f"  {r['loss']}: " + ", ".join(f"{step}: {tau:.3f} | {greedy:.3f}"
                                             for step, tau, greedy in r["curve"]))
    results = base.run.output_path / "bench-train" / "results.json"
    results.write_text(json.dumps({"config": base.to_dict(), "runs": rows}, indent=2) + "\n")
    print(f"\nwritten {results}")
    return 0


def _curve(log: Path) -> list[tuple[int, float, float]]:
    """(optimizer_step, tau, greedy tau) of every held-out evaluation in a training log."""
    entries = [json.loads(line) for line in log.read_text().splitlines() if line]
    return [(e["optimizer_step"], e["held_out"]["tau"], e["held_out"]["greedy_tau"])
            for e in entries if "held_out" in e]


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.0f}"


if __name__ == "__main__":
    sys.exit(main())
