"""Tau against CPU-hours: one run's acceptance along its training, against the time the whole
recipe has spent by then (stage 1, the feature dump, the optimizer steps so far).

    python -m eval.tau_vs_hours --run <run> (--stage1-seconds S | --stage1-tokens-per-s R) \
        [--eval <results.json>] --out <folder>

Read from the run folder: every held-out evaluation of train/log.jsonl (predicted tau, sampled
and greedy, at its optimizer_step) and the training seconds up to it (each step's entry carries
its tokens so far and tokens/s so far, so tokens / tokens_per_s is the optimizer steps' time,
resumes included), the feature dump's seconds (features/manifest.json, when the run dumped
features), and the epochs each step stands for (train/config.yaml: conversations per optimizer
step over the training conversations). Stage 1's seconds are given, as stage 1 printed them
(--stage1-seconds), or estimated from the tokens it generated for the conversations the run
used, training and held out, at a rate (--stage1-tokens-per-s). --eval adds the measured tau of
the run's trained draft at its optimizer_step. Model loads, engine starts and the eval itself
are not counted. Writes tau_vs_hours.md, tau_vs_hours.json and tau_vs_hours.png.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from eval.tau_vs_data import evals_of_draft
from runfolder import RunFolder, first_conversations, read_columns, train_record


def curve(run: Path, stage1_seconds: float | None, stage1_tokens_per_s: float | None,
          evals: list[dict]) -> dict:
    """The run's points: one per held-out evaluation, with the hours spent by then."""
    folder = RunFolder(run)
    config = yaml.safe_load((folder.train / "config.yaml").read_text())["train"]
    rows = read_columns(folder.data, ["id", "split", "generated_tokens"])
    train = first_conversations([r for r in rows if r["split"] == "train"],
                                config["max_conversations"], key=lambda r: r["id"])
    held_out = [r for r in rows if r["split"] == "held_out"]
    if stage1_seconds is None:
        generated = sum(r["generated_tokens"] for r in train + held_out)
        stage1_seconds = generated / stage1_tokens_per_s
    features = folder.features_manifest
    feature_seconds = (json.loads(features.read_text()).get("dump_seconds", 0.0)
                       if features.is_file() else 0.0)
    per_step = config["micro_batch_size"] * config["gradient_accumulation_steps"]
    log = [json.loads(line) for line in folder.train_log.read_text().splitlines()
           if line.strip()]
    seconds_at = {0: 0.0}
    for entry in log:
        if "tokens_per_s" in entry and entry["tokens_per_s"] > 0:
            seconds_at[entry["optimizer_step"]] = entry["tokens"] / entry["tokens_per_s"]
    points = []
    for entry in log:
        if "held_out" not in entry:
            continue
        step = entry["optimizer_step"]
        if step not in seconds_at:
            raise ValueError(f"{folder.train / 'log.jsonl'}: a held-out evaluation at "
                             f"optimizer_step {step} without that step's entry: the log is not "
                             "a training run's (or was edited)")
        train_seconds = seconds_at[step]
        points.append({"optimizer_step": step,
                       "epochs": step * per_step / len(train),
                       "train_seconds": train_seconds,
                       "hours": (stage1_seconds + feature_seconds + train_seconds) / 3600,
                       "predicted_tau": entry["held_out"]["tau"],
                       "predicted_greedy_tau": entry["held_out"]["greedy_tau"],
                       # what a greedy chain engine realises on the same replies (logs since
                       # the walk was added; None in older ones)
                       "walk_tau": entry["held_out"].get("walk_tau")})
    return {"run": run.name, "conversations": len(train), "held_out": len(held_out),
            "stage1_seconds": stage1_seconds, "feature_seconds": feature_seconds,
            "points": points, "measured": measured(folder, evals)}


def measured(folder: RunFolder, evals: list[dict]) -> dict:
    """Measured tau of the run's trained draft, by mode, with the optimizer_step it was
    trained to (train.keep=best can keep an earlier step's draft)."""
    done = train_record(folder.draft)
    if done is None:
        return {}
    step = done["optimizer_steps"]
    return {mode: {"tau": m["tau"], "alpha": m.get("alpha"), "prompts": results["num_prompts"],
                   "optimizer_step": step} for mode, m, results in evals_of_draft(folder, evals)}


def table(result: dict) -> str:
    walk = any(p.get("walk_tau") is not None for p in result["points"])
    lines = ["| optimizer_step | epochs | CPU-hours (stage 1 + features + training) | "
             "predicted tau sampled / greedy |" + (" greedy tau as an engine steps |" if walk
                                                    else ""),
             "|---|---|---|---|" + ("---|" if walk else "")]
    for p in result["points"]:
        row = (f"| {p['optimizer_step']} | {p['epochs']:.2f} | {p['hours']:.2f} | "
               f"{p['predicted_tau']:.3f} / {p['predicted_greedy_tau']:.3f} |")
        if walk:
            row += f" {p['walk_tau']:.3f} |" if p.get("walk_tau") is not None else " - |"
        lines.append(row)
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = result["points"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p["hours"] for p in points], [p["predicted_greedy_tau"] for p in points], "o--",
            label="predicted (held-out, greedy, averaged over start positions)")
    walked = [p for p in points if p.get("walk_tau") is not None]
    if walked:
        ax.plot([p["hours"] for p in walked], [p["walk_tau"] for p in walked], "o-",
                label="predicted (held-out, greedy, as an engine steps)")
    at = {p["optimizer_step"]: p["hours"] for p in points}
    for mode, m in result["measured"].items():
        if m["optimizer_step"] in at:
            ax.plot([at[m["optimizer_step"]]], [m["tau"]], "s", label=f"measured MT-bench, {mode}")
    ax.set_xlabel("CPU-hours: stage 1 + features + training")
    ax.set_ylabel("tau (tokens per target forward, k = 4)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="the run folder (trained, or training)")
    stage1 = parser.add_mutually_exclusive_group(required=True)
    stage1.add_argument("--stage1-seconds", type=float,
                        help="stage 1's generation time, as it printed it")
    stage1.add_argument("--stage1-tokens-per-s", type=float,
                        help="stage 1's rate, to estimate its time from the tokens it generated")
    parser.add_argument("--eval", default="", help="comma-separated eval results.json files")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    run = Path(args.run).expanduser()
    if not RunFolder(run).train_log.is_file():
        parser.error(f"{run} has no train/log.jsonl: train it (or let it start) first")
    if args.stage1_tokens_per_s is not None and args.stage1_tokens_per_s <= 0:
        parser.error("--stage1-tokens-per-s must be > 0")
    evals = [json.loads(Path(e).expanduser().read_text()) for e in args.eval.split(",") if e]
    result = curve(run, args.stage1_seconds, args.stage1_tokens_per_s, evals)
    if not result["points"]:
        parser.error(f"{run}/train/log.jsonl holds no held-out evaluation yet")
    text = [table(result),
            f"- {result['conversations']} training conversations, {result['held_out']} held out; "
            f"stage 1 {result['stage1_seconds']:,.0f} s, "
            f"features {result['feature_seconds']:,.0f} s"]
    for mode, m in result["measured"].items():
        text.append(f"- measured MT-bench tau, {mode}: {m['tau']:.3f} ({m['prompts']} prompts; "
                    f"the draft of optimizer_step {m['optimizer_step']})")
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    report = "\n".join(text)
    (out / "tau_vs_hours.md").write_text(report + "\n")
    (out / "tau_vs_hours.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / "tau_vs_hours.png")
    print(report)
    print(f"wrote {out / 'tau_vs_hours.md'}, tau_vs_hours.json and tau_vs_hours.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
