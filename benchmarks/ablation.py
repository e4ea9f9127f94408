"""Benchmark: arms of our own trainer (a loss, a norm, a weighting: recipe overrides) on the same
conversations and target features, each trained with every seed, every head measured in one
vLLM run; each arm's tau against the first arm's (the baseline), paired on the same prompts.

    .venv/bin/python -m benchmarks.ablation --config configs/smollm2-135m-eagle3.yaml \\
        --arm 'fkl train.loss=fkl' --arm 'lk_lambda train.loss=lk_lambda' \\
        [--arm 'NAME key=value ...' ...] [--seeds 0,1] [--conversations 200] [--questions 16]
        [--split report|select] [--max-new-tokens 256] [--work DIR] [--write-docs]
        [overrides every arm shares, key=value ...]

Steps, each resumed where a killed run left it:
1. stage 1 of the recipe once (`--conversations` prompts), in <work>/stage1;
2. each seed x arm in its own run folder, <work>/seed-<s>/<arm>, whose stage-1 data and offline
   features are stage 1's (links: the first arm trained writes the features, the rest read
   them): `distill.py --stage train` in a fresh process with run.seed=<s>, the shared overrides
   and the arm's; then the draft exported for vLLM;
3. every head not yet measured and the target alone in one vLLM worker, greedy, on MT-bench
   first turns drawn across its categories (`--split report`: the questions tables report;
   `select`: the disjoint ones to choose arms on); a head measured before in the same setting
   keeps its figures (greedy vLLM gives the target the same text in every worker).
The table gives, per arm and seed, the held-out figures its trainer logged and the head's vLLM
tau with a 95 % interval over prompts, and its difference from the baseline of the same seed
with the paired interval (the same prompts resampled together). An arm is called ahead or
behind only where every seed's interval excludes 0 on the same side (`seeds_verdict`); otherwise the
difference is not resolved. Each trained draft names the commit and hardware that trained it
(its train record); the table lists them. Results: <work>/results.json; --write-docs writes a
dated study of docs/results/ with the command.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.side_by_side import head_identity, measure, share_stage1
from decoding.acceptance import prompt_bootstrap_tau, seeds_verdict
from runfolder import RunFolder, train_record
from runfolder.prompts import across_categories
from runfolder.provenance import cpu_name, source_commit

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Arm:
    name: str
    overrides: tuple[str, ...]


def parse_arm(text: str) -> Arm:
    """'NAME key=value ...' -> Arm; a name is a folder name, each override a key=value."""
    from recipe import ConfigError

    words = shlex.split(text)
    if not words or "=" in words[0] or "/" in words[0]:
        raise ConfigError(f"--arm {text!r}: give a name first, then the recipe overrides of the "
                          "arm, e.g. --arm 'lk_lambda train.loss=lk_lambda'.")
    bad = [w for w in words[1:] if "=" not in w]
    if bad:
        raise ConfigError(f"--arm {text!r}: {bad[0]!r} is not a key=value override.")
    return Arm(words[0], tuple(words[1:]))


def train_arm(config: Path, folder: Path, arm: Arm, seed: int, shared: list[str]):
    """The arm trained with this seed by distill.py's train stage in a fresh process (a finished
    run is not redone), then exported for vLLM -> serving.engines.base.Export."""
    from recipe import load_config
    from serving.export import export_draft

    overrides = [f"run.output_dir={folder}", f"run.name={arm.name}", f"run.seed={seed}",
                 *shared, *arm.overrides]
    command = [sys.executable, "distill.py", "--config", str(config), "--stage", "train",
               *overrides]
    print(f"[ablation] {arm.name}, seed {seed}: {shlex.join(command[1:])}", flush=True)
    subprocess.run(command, cwd=ROOT, check=True)
    cfg = load_config(config, overrides)
    return export_draft(cfg, cfg.eval.k)


def arm_row(name: str, seed: int, record: dict, vllm: dict, base: dict | None) -> dict:
    """One arm and seed: its held-out figures (train record), its vLLM figures, and its paired
    difference from the baseline's vLLM run (None for the baseline itself)."""
    after = record["after"]
    row = {"arm": name, "seed": seed, "optimizer_steps": record["optimizer_steps"],
           "held_out": {key: after.get(key) for key in ("tau", "greedy_tau", "walk_tau")},
           "tokens_per_second": record["tokens"] / max(record["train_seconds"], 1e-9),
           "commit": record.get("commit", "unrecorded"),
           "hardware": record.get("hardware", "unrecorded"), "vllm": vllm}
    if base is not None:
        ours, theirs = vllm["per_prompt"], base["per_prompt"]
        row["difference"] = list(prompt_bootstrap_tau(ours["drafts"], ours["accepted"],
                                                      theirs["drafts"], theirs["accepted"]))
    return row


def render_table(rows: list[dict], baseline: str) -> str:
    """The arms, seed by seed, then each arm's verdict over its seeds."""
    lines = ["| arm | seed | held-out tau (sampled / greedy / walk) | vLLM tau [95 % over prompts] "
             f"| minus {baseline}'s [95 %, paired] | texts = target's | training tokens/s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        h, v = r["held_out"], r["vllm"]
        held = " / ".join("-" if h[k] is None else f"{h[k]:.3f}"
                          for k in ("tau", "greedy_tau", "walk_tau"))
        low, high = v.get("tau_interval", [float("nan")] * 2)
        diff = ("-" if "difference" not in r else
                "{:+.3f} [{:+.3f}, {:+.3f}]".format(*r["difference"]))
        lines.append(f"| {r['arm']} | {r['seed']} | {held} | {v['tau']:.3f} [{low:.3f}, "
                     f"{high:.3f}] | {diff} | {v['identical_texts']}/{v['prompts']} | "
                     f"{r['tokens_per_second']:.0f} |")
    lines += ["", "| arm | against the baseline, over every seed |", "|---|---|"]
    for name in dict.fromkeys(r["arm"] for r in rows if "difference" in r):
        seen = [tuple(r["difference"]) for r in rows if r["arm"] == name]
        lines.append(f"| {name} | {seeds_verdict(seen)} |")
    trained = {(r["commit"], r["hardware"]) for r in rows}
    lines += ["", "Trained at " + "; ".join(f"commit {c} on {h}" for c, h in sorted(trained))
              + "."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--arm", action="append", required=True,
                        help="'NAME key=value ...': an arm and its overrides; the first is the "
                             "baseline")
    parser.add_argument("--seeds", default="0", help="run.seed of each training, e.g. 0,1")
    parser.add_argument("--conversations", type=int, default=200)
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--split", choices=["report", "select"], default="report")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("overrides", nargs="*", help="overrides every arm shares, key=value")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)

    import torch
    from accelerate import Accelerator

    from assets.chat import render
    from assets.prompts import load_mtbench
    from assets.target import end_of_turn_ids, load_target, load_tokenizer, resolve_target
    from distill import run_distill
    from recipe import ConfigError, cache_root, load_config

    arms = [parse_arm(a) for a in args.arm]
    if len({a.name for a in arms}) < len(arms) or len(arms) < 2:
        raise ConfigError("--arm: give at least two arms (the first is the baseline), each "
                          "with its own name.")
    seeds = [int(s) for s in args.seeds.split(",")]
    work = (args.work or cache_root() / "ablations"
            / f"{args.config.stem}-{args.conversations}").resolve()
    shared = [f"data.max_prompts={args.conversations}", *args.overrides]
    base = load_config(args.config, [f"run.output_dir={work / 'stage1'}", *shared])
    print(f"[ablation] stage 1: {args.conversations} prompts of {args.config.name}")
    run_distill(base, Accelerator(cpu=True))

    heads, methods = {}, {}
    for seed in seeds:
        for arm in arms:
            folder = share_stage1(work / "stage1", work / f"seed-{seed}" / arm.name)
            exported = train_arm(args.config, folder, arm, seed, shared)
            heads[f"{arm.name}/seed-{seed}"] = exported.folder
            methods[f"{arm.name}/seed-{seed}"] = exported.method

    resolved = resolve_target(base.model)
    tokenizer = load_tokenizer(resolved, base.model.chat_template_kwargs)
    target = load_target(resolved, "float32", torch.device("cpu"))
    conversations, _ = load_mtbench()
    picked = across_categories(conversations, args.questions, tune=args.split == "select")
    prompts = [render(tokenizer, [{"role": "user", "content": c.user_turns[0]}], True)
               for c in picked]
    results_path = work / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    setting = {"split": args.split, "questions": [c.id for c in picked],
               "max_new_tokens": args.max_new_tokens, "k": base.eval.k}
    if results.get("setting") != setting:  # every head is measured again
        results = {"setting": setting, "vllm": {}, "heads": {}}
    todo = {n: f for n, f in heads.items()
            if n not in results["vllm"] or results["heads"].get(n) != head_identity(f)}
    if todo:  # the heads not yet measured in this setting, or trained again since
        print(f"[ablation] vLLM: {len(todo)} heads and the target, {len(prompts)} MT-bench "
              f"questions x {args.max_new_tokens} tokens, greedy, k={base.eval.k}", flush=True)
        found = measure(resolved.path, prompts, end_of_turn_ids(target, tokenizer), todo,
                        methods, base.eval.k, args.max_new_tokens, cache_root() / "vllm")
        for name, folder in todo.items():
            results["vllm"][name], results["heads"][name] = found[name], head_identity(folder)
        results_path.write_text(json.dumps(results, indent=2) + "\n")
    rows = []
    for seed in seeds:
        baseline = results["vllm"][f"{arms[0].name}/seed-{seed}"]
        for i, arm in enumerate(arms):
            record = train_record(RunFolder(work / f"seed-{seed}" / arm.name).draft)
            vllm = results["vllm"][f"{arm.name}/seed-{seed}"]
            rows.append(arm_row(arm.name, seed, record, vllm, None if i == 0 else baseline))
    results.update(config=str(args.config), arms=[[a.name, *a.overrides] for a in arms],
                   shared=shared, seeds=seeds, rows=rows, cpu=cpu_name())
    results_path.write_text(json.dumps(results, indent=2) + "\n")
    table = render_table(rows, arms[0].name)
    print(table)
    if args.write_docs:
        print(f"[ablation] wrote {write_docs(results, table, argv, picked)}: list it in "
              "docs/results.md")
    return 0


def write_docs(results: dict, table: str, argv: list[str], picked,
               today: str | None = None) -> Path:
    """The run as a study of the dated results log: docs/results/<date>-ablation-<recipe>.md,
    <date>-ablation-<recipe>-select.md for the selection split (so that choosing on one split
    and confirming on the other writes two studies) -> the file (docs/results.md lists it: add
    its line there)."""
    import datetime

    today = today or datetime.date.today().isoformat()
    split = "" if results["setting"]["split"] == "report" else f"-{results['setting']['split']}"
    doc = ROOT / "docs" / "results" / f"{today}-ablation-{Path(results['config']).stem}{split}.md"
    doc.parent.mkdir(parents=True, exist_ok=True)
    arms = "\n".join(f"- `{name}`: {' '.join(f'`{o}`' for o in overrides) or 'the recipe'}"
                     for name, *overrides in results["arms"])
    setting = results["setting"]
    doc.write_text("\n".join([
        f"# Ablation: {results['config']}", "",
        f"Measured at commit {source_commit()} on {results['cpu']}: "
        f"`.venv/bin/python -m benchmarks.ablation {shlex.join(argv)}`.", "",
        f"Every arm trains on the same stage-1 conversations and target features with "
        f"{' '.join(f'`{o}`' for o in results['shared'])}, seeds {results['seeds']}; the first "
        "arm is the baseline:", "", arms, "",
        f"vLLM (CPU, fp32), greedy, k={setting['k']}, {len(picked)} MT-bench first turns drawn "
        f"across its categories ({setting['split']} split: questions "
        f"{', '.join(str(c.id) for c in picked)}) x {setting['max_new_tokens']} tokens; "
        "intervals resample prompts. Held-out figures: the trainer's last evaluation on its "
        "held-out conversations (no interval).", "", table, ""]))
    return doc


if __name__ == "__main__":
    raise SystemExit(main())
