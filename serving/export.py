"""Export a trained draft to the folder a serving engine loads, with the exact command to serve it.

    .venv/bin/python -m serving.export --config configs/smollm2-135m-medusa.yaml [--k 4]

Reads <run>/train/draft (or --draft FOLDER) and writes <run>/export/<kind>/:
  - Medusa heads: vLLM's layout (`model_type: medusa`, `MedusaModel`, `blocks.{h}.layers.{l}`,
    `lm_heads.{h}`), served with `{"method": "medusa", "num_speculative_tokens": k}`;
  - an independent draft LM: the HF folder, for vLLM `draft_model` and transformers'
    `assistant_model`;
  - an EAGLE-3 head: vLLM's native layout (`LlamaForCausalLMEagle3`, `midlayer.*`, `d2t`, `t2d`,
    `norm_before_residual: false`), or with `--format speculators` the speculators layout
    (`speculators_model_type: eagle3`, `layers.0.*`); the d2t is checked against t2d first;
plus the resolved config (config.yaml), the training figures, `vllm_speculative_config.json`
with the method always written out (without it vLLM guesses from the folder name), the measured
eval results when <run>/eval measured this draft, and a model card (README.md) generated from
all of them.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

from recipe import Config, ConfigError


@dataclass
class Export:
    folder: Path
    method: str
    """vLLM's speculative method: 'medusa', 'eagle3' or 'draft_model'."""
    num_speculative_tokens: int
    target_path: str
    vllm_command: str


def export_folder(cfg: Config, folder: Path | None = None) -> Path:
    """The export folder to validate or publish: the one given, else the single one in
    <run>/export/."""
    candidates = [folder] if folder else sorted((cfg.run.output_path / "export").glob("*/"))
    candidates = [c for c in candidates if (c / "vllm_speculative_config.json").is_file()]
    if len(candidates) != 1:
        raise ConfigError(f"expected one exported draft, found {len(candidates)} in "
                          f"{cfg.run.output_path / 'export'}: run `python -m serving.export` "
                          "first, or pass --folder.")
    return candidates[0]


def target_hub_id(cfg: Config) -> str | None:
    """The target's hub id: the embedded SmolLM2's upstream repo, a hub id as given, None for a
    local folder."""
    target = cfg.model.target
    if target.startswith("embedded:"):
        return "HuggingFaceTB/" + target.removeprefix("embedded:")
    return None if Path(target).expanduser().exists() else target


def _target_shape(target_path: str) -> tuple[int, int]:
    """(hidden size, vocab size) of the target, from its config.json."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(target_path)
    config = getattr(config, "text_config", None) or config
    return config.hidden_size, config.vocab_size


def export_draft(cfg: Config, k: int, draft_folder: Path | None = None,
                 out: Path | None = None, fmt: str = "vllm") -> Export:
    """Check the draft against the target and k, then write the export folder atomically.
    fmt: 'vllm' (native layouts) or 'speculators' (EAGLE-3 heads only)."""
    from assets.target import resolve_target
    from serving.eagle3 import Eagle3Head, is_eagle3_config

    draft_folder = Path(draft_folder or cfg.run.output_path / "train" / "draft")
    config_path = draft_folder / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"{draft_folder} holds no trained draft (no config.json): run the train "
                          "stage first, or pass --draft FOLDER.")
    draft_config = json.loads(config_path.read_text())
    target = resolve_target(cfg.model)
    hidden, vocab = _target_shape(target.path)
    if k < 1:
        raise ConfigError(f"--k {k}: the number of speculative tokens must be >= 1.")
    if fmt not in ("vllm", "speculators"):
        raise ConfigError(f"--format {fmt!r}: expected 'vllm' or 'speculators'.")
    if fmt == "speculators" and not is_eagle3_config(draft_config):
        raise ConfigError("--format speculators holds EAGLE-3 heads only; export this draft with "
                          "--format vllm.")
    head = None
    if is_eagle3_config(draft_config):
        method, kind = "eagle3", "eagle3" if fmt == "vllm" else "eagle3-speculators"
        head = Eagle3Head.from_pretrained(draft_folder)  # refuses a d2t that mismatches t2d
        if (head.config.hidden_size, head.vocab_size) != (hidden, vocab):
            raise ConfigError(f"the EAGLE-3 head reads hidden size {head.config.hidden_size} over "
                              f"{head.vocab_size} tokens; the target {target.name} has {hidden} "
                              f"and {vocab}: export it with the target it was trained on "
                              "(model.target).")
    elif draft_config.get("model_type") == "medusa":
        method, kind = "medusa", "medusa"
        heads = draft_config["num_heads"]
        if k > heads:
            raise ConfigError(f"--k {k} draft tokens need {k} Medusa heads, but {draft_folder} "
                              f"has {heads}; vLLM would build the missing heads with "
                              f"uninitialised weights. Export with --k <= {heads}.")
        if (draft_config["hidden_size"], draft_config["vocab_size"]) != (hidden, vocab):
            raise ConfigError(f"the Medusa heads read hidden size {draft_config['hidden_size']} "
                              f"and predict {draft_config['vocab_size']} tokens; the target "
                              f"{target.name} has {hidden} and {vocab}: export them with the "
                              "target they were trained on (model.target).")
    else:
        method, kind = "draft_model", "draft-model"
        if draft_config.get("vocab_size") != vocab:
            raise ConfigError(f"the draft's vocabulary has {draft_config.get('vocab_size')} "
                              f"tokens, the target's {vocab}: a draft must use the target's "
                              "tokenizer.")
    out = Path(out or cfg.run.output_path / "export" / kind)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(draft_folder, tmp)
    if method == "medusa":
        from serving.medusa import MedusaHeads

        # heads trained with the target's head frozen share it: written once, as vLLM's
        # original_lm_head, so the folder is 3 lm_heads smaller and loads the same heads
        MedusaHeads.from_pretrained(draft_folder).save_pretrained(tmp)
    elif head is not None and fmt == "vllm":
        head.save_pretrained(tmp)
    elif head is not None:
        (tmp / "model.safetensors").unlink()
        save_speculators(head, tmp, k, target_hub_id(cfg) or target.path)
    cfg.save(tmp / "config.yaml")
    speculative = {"method": method, "model": str(out.resolve()), "num_speculative_tokens": k}
    (tmp / "vllm_speculative_config.json").write_text(json.dumps(speculative, indent=2) + "\n")
    command = ("python -m vllm.entrypoints.openai.api_server --model "
               f"{shlex.quote(target.path)} --speculative-config "
               f"{shlex.quote(json.dumps(speculative))}")
    eval_report = _eval_of(cfg, draft_folder)
    if eval_report is not None:
        (tmp / "eval_results.json").write_text(json.dumps(eval_report, indent=2) + "\n")
    training = draft_folder / "draftsmith_train.json"
    (tmp / "README.md").write_text(model_card(
        cfg, method, k, command, target.name,
        json.loads(training.read_text()) if training.is_file() else None, eval_report,
        _manifest_counts(cfg)))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return Export(out, method, k, target.path, command)


def save_speculators(head, folder: Path, k: int, verifier: str) -> None:
    """An EAGLE-3 head in the speculators format (which `vllm serve <folder>` also reads): the
    layer as `layers.0.*`, the Llama fields under transformer_layer_config, and
    norm_before_residual written out (it defaults to true there)."""
    from serving.folders import save_folder

    state = {k.replace("midlayer.", "layers.0.", 1): v for k, v in head.state_dict().items()
             if not k.startswith("rotary.")}
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
              "speculators_config": {
                  "algorithm": "eagle3", "default_proposal_method": "greedy",
                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k}],
                  "verifier": {"name_or_path": verifier, "architectures": []}},
              "transformer_layer_config": head.layer_config(), **head.eagle3_fields(),
              "draftsmith": head.provenance()}
    save_folder(folder, state, config)


def _eval_of(cfg: Config, draft_folder: Path) -> dict | None:
    """<run>/eval/results.json when it measured this very draft folder, else None."""
    path = cfg.run.output_path / "eval" / "results.json"
    if not path.is_file():
        return None
    report = json.loads(path.read_text())
    measured = str(report.get("draft") or "").split(" (")[0]
    if not measured or Path(measured).resolve() != draft_folder.resolve():
        return None
    return report


def _manifest_counts(cfg: Config) -> dict | None:
    path = cfg.run.output_path / "manifest.json"
    return json.loads(path.read_text()).get("counts") if path.is_file() else None


def model_card(cfg: Config, method: str, k: int, command: str, target_name: str,
               training: dict | None, eval_report: dict | None, counts: dict | None) -> str:
    """The Hub model card: what the draft is for, how it was made, what it measured, and the
    exact command that serves it, all from the resolved config and the recorded figures."""
    import yaml

    base = target_hub_id(cfg) or cfg.model.target
    kind = {"medusa": "Medusa heads", "draft_model": "an independent draft model",
            "eagle3": "an EAGLE-3 head"}[method]
    lines = ["---", f"base_model: {base}", "tags:", "- speculative-decoding", f"- {method}",
             "- draftsmith", "---", "",
             f"# Draft for {target_name}: {kind}", "",
             (f"A draft for speculative decoding with the target **{target_name}**, trained by "
              f"draftsmith (`train.draft={cfg.train.draft}`, loss `{cfg.train.loss}`). "
              "Speculative decoding keeps the target's output distribution exactly; the draft "
              "only changes the speed."), "", "## Serve it with vLLM", "",
             f"Always pass the method (`{method}`); k = {k} draft tokens per step:", "",
             "```", command, "```", "", "## How it was made", ""]
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
                  "| method | tau | alpha_k | tokens/s | speedup | identical to target |",
                  "|---|---|---|---|---|---|"]
        for name, r in eval_report["methods"].items():
            tau = f"{r['tau']:.2f}" if r["tau"] is not None else "-"
            alpha = " ".join(f"{a:.2f}" for a in r["alpha"]) or "-"
            speed = f"{r['speedup']:.2f}x" if r.get("speedup") is not None else "-"
            same = "-" if r["identical_to_target"] is None else (
                f"{r['identical_to_target']}/{eval_report['num_prompts']}")
            lines.append(f"| {name} | {tau} | {alpha} | {r['tokens_per_s']:.1f} | {speed} "
                         f"| {same} |")
    else:
        lines.append("Not measured yet: run the eval stage on this draft, then export again.")
    lines += ["", "## Resolved config", "", "```yaml",
              yaml.safe_dump(cfg.to_dict(), sort_keys=False).rstrip(), "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from recipe import load_config

    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--k", type=int, default=None,
                        help="speculative tokens per step (default: eval.k)")
    parser.add_argument("--draft", type=Path, help="draft folder (default <run>/train/draft)")
    parser.add_argument("--out", type=Path, help="export folder (default <run>/export/<kind>)")
    parser.add_argument("--format", choices=["vllm", "speculators"], default="vllm",
                        help="EAGLE-3 heads: vLLM's native layout or the speculators format")
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(args.config, overrides)
    try:
        result = export_draft(cfg, args.k or cfg.eval.k, args.draft, args.out, args.format)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    print(f"[export] {result.folder} (vLLM method {result.method}, k={result.num_speculative_tokens})")
    print(f"[export] serve with:\n  {result.vllm_command}")


if __name__ == "__main__":
    main()
