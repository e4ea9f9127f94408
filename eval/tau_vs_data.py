"""The tau-vs-data curve: drafts trained on growing subsets of one stage-1 data set, with the
CPU time of each stage and the acceptance they reach (predicted on held-out data, measured on
MT-bench by an eval run).

    python -m eval.tau_vs_data --runs <run-24>,<run-80>,<run-240> \
        --eval <results.json>[,<results.json>] --out <folder> [--stage1-tokens-per-s 58.1]

Each run is one point: a folder whose train stage used train.max_conversations (or all) of its
stage-1 data. Read per point: the training conversations and the tokens the target generated
for them (the data), the feature dump's seconds (features/manifest.json, when the run dumped
features), the train stage's seconds and the predicted tau after training
(train/draft's runfolder.paths.TRAIN_RECORD), the measured tau of every eval mode that names
the run's draft ('speculative' of the eval's own draft, 'speculative:<run name>' of a compared one).
Stage 1's CPU time per point is its generated tokens over the data set's tokens/s
(--stage1-tokens-per-s, as stage 1 printed it). Writes tau_vs_data.md and tau_vs_data.png.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import yaml

from runfolder import RunFolder, first_conversations, read_columns, train_record


def point(run: Path, evals: list[dict], stage1_tps: float | None) -> dict:
    """One curve point from a trained run folder."""
    folder = RunFolder(run)
    config = yaml.safe_load((folder.draft / "config.yaml").read_text())
    rows = [r for r in read_columns(folder.data, ["id", "split", "generated_tokens"])
            if r["split"] == "train"]
    rows = first_conversations(rows, config["train"]["max_conversations"], key=lambda r: r["id"])
    trained = train_record(folder.draft)
    features = folder.features_manifest
    generated = sum(r["generated_tokens"] for r in rows)
    measured = {mode: {"tau": m["tau"], "speedup": m.get("speedup"),
                       "identical": m.get("identical_to_target"), "prompts": results["num_prompts"]}
                for mode, m, results in evals_of_draft(folder, evals)}
    return {
        "run": run.name,
        "conversations": len(rows),
        "generated_tokens": generated,
        "stage1_seconds": generated / stage1_tps if stage1_tps else None,
        "feature_seconds": (json.loads(features.read_text()).get("dump_seconds")
                            if features.is_file() else None),
        "train_seconds": trained.get("train_seconds"),
        "optimizer_steps": trained["optimizer_steps"],
        "predicted_tau": trained["after"]["tau"],
        "predicted_greedy_tau": trained["after"]["greedy_tau"],
        "measured": measured,
    }


def evals_of_draft(folder: RunFolder, evals: list[dict]):
    """(mode, method figures, results) of every eval method that measured the run's trained
    draft: 'speculative' of an eval whose own draft it is, 'speculative:<run name>' of one
    that compared it; mode 'chain' or the method's '+<mode>'."""
    for results in evals:
        # the eval's own draft: "<path> (<kind>, ...)"
        own = results["draft"] is not None and Path(results["draft"].split(" (")[0]).resolve() \
            == folder.draft.resolve()
        for name, m in results["methods"].items():
            base, _, mode = name.partition("+")
            if base == f"speculative:{folder.root.name}" or (own and base == "speculative"):
                yield mode or "chain", m, results


def log_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b * log10(x) -> (a, b): b is the gain per 10x data."""
    lx = [math.log10(x) for x in xs]
    mx, my = sum(lx) / len(lx), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(lx, ys)) / sum((x - mx) ** 2 for x in lx)
    return my - b * mx, b


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:,.0f}"


def table(points: list[dict], modes: list[str]) -> str:
    head = ["train conversations", "generated tokens", "stage 1 s", "features s",
            "train s (steps)", "predicted tau sampled / greedy",
            *(f"MT-bench tau {m}" for m in modes)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in points:
        cells = [str(p["conversations"]), f"{p['generated_tokens']:,}", _s(p["stage1_seconds"]),
                 _s(p["feature_seconds"]), f"{_s(p['train_seconds'])} ({p['optimizer_steps']})",
                 f"{p['predicted_tau']:.3f} / {p['predicted_greedy_tau']:.3f}",
                 *(f"{p['measured'][m]['tau']:.2f}" if m in p["measured"] else "-"
                   for m in modes)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(points: list[dict], modes: list[str], baselines: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [p["conversations"] for p in points]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [p["predicted_greedy_tau"] for p in points], "o--", label="predicted (held-out, greedy)")
    for mode in modes:
        have = [(p["conversations"], p["measured"][mode]["tau"]) for p in points
                if mode in p["measured"]]
        if have:
            ax.plot(*zip(*have), "s-", label=f"measured MT-bench, {mode}")
    for name, tau in baselines.items():
        ax.axhline(tau, color="grey", linestyle=":", label=f"{name} {tau:.2f}")
    ax.set_xscale("log")
    ax.set_xlabel("training conversations (log)")
    ax.set_ylabel("tau (tokens per target forward, k = 4)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", required=True, help="comma-separated run folders, one per point")
    parser.add_argument("--eval", default="", help="comma-separated eval results.json files")
    parser.add_argument("--stage1-tokens-per-s", type=float, default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    runs = [Path(r).expanduser() for r in args.runs.split(",") if r]
    missing = [str(r) for r in runs 
               if train_record(RunFolder(r).draft) is None]
    if missing:
        parser.error(f"not a finished train stage: {', '.join(missing)} (train them first)")
    evals = [json.loads(Path(e).expanduser().read_text()) for e in args.eval.split(",") if e]
    points = sorted((point(r, evals, args.stage1_tokens_per_s) for r in runs),
                    key=lambda p: p["conversations"])
    modes = sorted({m for p in points for m in p["measured"]}, key=lambda m: m != "chain")
    baselines = {}
    for results in evals:
        if "prompt_lookup" in results["methods"]:
            baselines["prompt lookup"] = results["methods"]["prompt_lookup"]["tau"]
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    text = [table(points, modes)]
    if len(points) >= 2:
        for label, key in (("predicted greedy", None), *((f"measured {m}", m) for m in modes)):
            have = [(p["conversations"], p["measured"][key]["tau"] if key else
                     p["predicted_greedy_tau"]) for p in points if key is None or key in p["measured"]]
            if len(have) >= 2:
                a, b = log_fit(*map(list, zip(*have)))
                reach = f"{10 ** ((2.0 - a) / b):,.3g}" if b > 0 else "never (no gain)"
                text.append(f"- {label}: {b:+.3f} tau per 10x conversations (log-linear fit of "
                            f"{len(have)} points); tau 2.0 at ~{reach} conversations if the fit "
                            "held")
    report = "\n".join(text)
    (out / "tau_vs_data.md").write_text(report + "\n")
    (out / "tau_vs_data.json").write_text(json.dumps(points, indent=2) + "\n")
    plot(points, modes, baselines, out / "tau_vs_data.png")
    print(report)
    print(f"wrote {out / 'tau_vs_data.md'}, tau_vs_data.json and tau_vs_data.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
