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
    <cache>/gguf/, llamacpp.json and the llama-server command;
plus the resolved config (config.yaml), the training figures, the engine's own description
(`vllm_speculative_config.json` with the method always written out, without which vLLM guesses
from the folder name; llamacpp.json), the measured eval results when <run>/eval measured this
draft, and a model card (README.md) generated from all of them. The format picks the serving
engine (serving/engines/), which writes the folder.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from recipe import Config, ConfigError
from serving.engines import Export, engine_for_format
from serving.engines.base import trained_draft
from serving.engines.llamacpp import GGUF_TYPES


def export_draft(cfg: Config, k: int, draft_folder: Path | None = None,
                 out: Path | None = None, fmt: str = "vllm", gguf_type: str = "f32",
                 log=print) -> Export:
    """Check the draft against the target, k and the engine, then write the export folder
    atomically. fmt: 'vllm' (native layouts), a format of the draft's kind (EAGLE-3:
    'speculators') or another engine's ('gguf': llama.cpp, weights in gguf_type)."""
    options = {"gguf_type": gguf_type} if fmt == "gguf" else {}
    engine = engine_for_format(fmt, **options)
    draft_folder, kind = trained_draft(cfg, draft_folder, k)
    return engine.export(cfg, draft_folder, kind, k, fmt, out, log)


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
        result = export_draft(cfg, k, args.draft, args.out, args.format, args.gguf_type)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    engine = "llama.cpp --spec-type" if args.format == "gguf" else "vLLM method"
    print(f"[export] {result.folder} ({engine} {result.method}, k={result.num_speculative_tokens})")
    print(f"[export] serve with:\n  {result.command}")


if __name__ == "__main__":
    main()
