"""Export a trained draft to the folder a serving engine loads, with the exact command to serve it.

    .venv/bin/python -m serving.export --config configs/smollm2-135m-medusa.yaml [--k 4]

Reads <run>/train/draft (or --draft FOLDER) and writes <run>/export/<kind>/:
  - Medusa heads: vLLM's layout (`model_type: medusa`, `MedusaModel`, `blocks.{h}.layers.{l}`,
    `lm_heads.{h}`), served with `{"method": "medusa", "num_speculative_tokens": k}`;
  - an independent draft LM: the HF folder, for vLLM `draft_model` and transformers'
    `assistant_model`;
plus the resolved config (config.yaml), the training figures, and `vllm_speculative_config.json`
with the method always written out: without it vLLM guesses from the folder name.
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
    """vLLM's speculative method: 'medusa' or 'draft_model'."""
    num_speculative_tokens: int
    target_path: str
    vllm_command: str


def _target_shape(target_path: str) -> tuple[int, int]:
    """(hidden size, vocab size) of the target, from its config.json."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(target_path)
    config = getattr(config, "text_config", None) or config
    return config.hidden_size, config.vocab_size


def export_draft(cfg: Config, k: int, draft_folder: Path | None = None,
                 out: Path | None = None) -> Export:
    """Check the draft against the target and k, then write the export folder atomically."""
    from assets.target import resolve_target

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
    if draft_config.get("model_type") == "medusa":
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
    cfg.save(tmp / "config.yaml")
    speculative = {"method": method, "model": str(out.resolve()), "num_speculative_tokens": k}
    (tmp / "vllm_speculative_config.json").write_text(json.dumps(speculative, indent=2) + "\n")
    command = ("python -m vllm.entrypoints.openai.api_server --model "
               f"{shlex.quote(target.path)} --speculative-config "
               f"{shlex.quote(json.dumps(speculative))}")
    (tmp / "SERVING.md").write_text(
        f"# Serving this draft\n\nTarget: {target.name} ({target.path}).\n\n"
        f"vLLM (`method: {method}`, always pass it):\n\n```\n{command}\n```\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return Export(out, method, k, target.path, command)


def main(argv: list[str] | None = None) -> None:
    from recipe import load_config

    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--k", type=int, default=None,
                        help="speculative tokens per step (default: eval.k)")
    parser.add_argument("--draft", type=Path, help="draft folder (default <run>/train/draft)")
    parser.add_argument("--out", type=Path, help="export folder (default <run>/export/<kind>)")
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(args.config, overrides)
    try:
        result = export_draft(cfg, args.k or cfg.eval.k, args.draft, args.out)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    print(f"[export] {result.folder} (vLLM method {result.method}, k={result.num_speculative_tokens})")
    print(f"[export] serve with:\n  {result.vllm_command}")


if __name__ == "__main__":
    main()
