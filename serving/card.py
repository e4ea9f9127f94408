"""The model card of an exported draft, generated from the resolved config and the figures the
run folder recorded (stage-1 counts, training, the eval of this very draft)."""

from __future__ import annotations

from pathlib import Path

from drafts import DraftKind
from recipe import Config
from runfolder import eval_report_of, run_folder, speed_text, stage1_counts, train_record


def target_hub_id(cfg: Config) -> str | None:
    """The target's hub id: the embedded SmolLM2's upstream repo, a hub id as given, None for a
    local folder."""
    target = cfg.model.target
    if target.startswith("embedded:"):
        return "HuggingFaceTB/" + target.removeprefix("embedded:")
    return None if Path(target).expanduser().exists() else target


def model_card(cfg: Config, kind: DraftKind, draft_folder: Path, tag: str, serving: str,
               target_name: str) -> str:
    """The Hub model card: what the draft is for, how it was made, what it measured, and how
    to serve it (serving: the engine's markdown section), all from the resolved config and the
    figures recorded in the run folder."""
    import yaml

    run = run_folder(cfg)
    training = train_record(draft_folder)
    eval_report, counts = eval_report_of(run, draft_folder), stage1_counts(run)
    base = target_hub_id(cfg) or cfg.model.target
    lines = ["---", f"base_model: {base}", "tags:", "- speculative-decoding", f"- {tag}",
             "- draftsmith", "---", "",
             f"# Draft for {target_name}: {kind.description}", "",
             (f"A draft for speculative decoding with the target **{target_name}**, trained by "
              f"draftsmith (`train.draft={cfg.train.draft}`, loss `{cfg.train.loss}`). "
              "Speculative decoding keeps the target's output distribution exactly; the draft "
              "only changes the speed."), "", serving.rstrip(), "", "## How it was made", ""]
    if counts:
        train = counts.get("train", {})
        lines.append(f"- Data: the target's own answers (stage 1, its chat template) to "
                     f"{train.get('conversations')} conversations from {cfg.data.sources}, "
                     f"{train.get('tokens')} tokens ({train.get('assistant_tokens')} written by "
                     "the target).")
    if training:
        lines.append(f"- Training: {training['optimizer_steps']} optimizer steps, "
                     f"{training['tokens']} tokens, {training['train_seconds']:.0f} s.")
        for name, when in (("before", "before training"), ("after", "after training")):
            if training.get(name):
                r = training[name]
                lines.append(f"- Predicted acceptance on held-out data {when} (k = {r['k']}): "
                             f"tau {r['tau']:.3f} sampling at T=1, {r['greedy_tau']:.3f} greedy.")
    lines += ["", "## Measured", ""]
    if eval_report:
        s = eval_report["settings"]
        lines += [(f"{eval_report['num_prompts']} {eval_report['prompts']} prompts, "
                   f"{s['max_new_tokens']} new tokens, T={s['temperature']}, k={s['k']}, "
                   f"{eval_report['dtype']}, batch {eval_report['batch_size']}, on "
                   f"{eval_report['device']} x{eval_report['threads']} threads "
                   "(draftsmith's engine):"), "",
                  "| method | tau | alpha_k | tokens/s | speedup (q25-q75, verdict) "
                  "| identical to target |",
                  "|---|---|---|---|---|---|"]
        for name, r in eval_report["methods"].items():
            tau = f"{r['tau']:.2f}" if r["tau"] is not None else "-"
            alpha = " ".join(f"{a:.2f}" for a in r["alpha"]) or "-"
            speed = speed_text(r.get("speed"), baseline=r.get("method") == "target")
            same = "-" if r["identical_to_target"] is None else (
                f"{r['identical_to_target']}/{eval_report['num_prompts']}")
            lines.append(f"| {name} | {tau} | {alpha} | {r['tokens_per_s']:.1f} | {speed} "
                         f"| {same} |")
    else:
        lines.append("Not measured yet: run the eval stage on this draft, then export again.")
    lines += ["", "## Resolved config", "", "```yaml",
              yaml.safe_dump(cfg.to_dict(), sort_keys=False).rstrip(), "```", ""]
    return "\n".join(lines)
