"""draftsmith: train draft models for speculative decoding, as one recipe.

    accelerate launch distill.py --config configs/smollm2-135m-independent.yaml [section.key=value ...]
    python distill.py --config ... --stage distill

Stages, in order: distill (the target writes the data), train (the draft learns the target's
distributions on that data), eval (tau, alpha_k and speedup of eval.draft against the
baselines), export (the trained draft as the folder vLLM serves, k = eval.k, with its model
card), publish (the export to the Hub, when publish.repo_id is set). `--stage validate` checks
the export inside real vLLM (several minutes; not part of the default run).

This script and the stage-1 package share a name: `from distill import run_distill` below
imports the package distill/ (Python finds the folder's __init__.py), not this file. Each stage
is one call into its own package; the draft kind (drafts/) checks the train section first, so a
contradiction fails before stage 1 starts.
"""

from __future__ import annotations

import argparse
import sys

STAGES = ["distill", "train", "eval", "export", "publish"]  # publish: when publish.repo_id is set
ON_REQUEST = ["validate"]  # stages that run only when named


def main(argv: list[str] | None = None) -> int:
    args, overrides = _arguments().parse_known_args(argv)
    from recipe import ConfigError

    try:
        cfg = _checked_config(args.config, overrides, plan=args.plan)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.plan:
        return _plan(cfg, args.accelerate_config, args.device)

    from accelerate import Accelerator

    from train import Stopped, TrainingDiverged, accelerator_kwargs

    try:
        accelerator = Accelerator(**accelerator_kwargs(cfg))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    _warn_if_starved(accelerator)
    try:
        status = pipeline(cfg, accelerator, args.stage)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingDiverged as e:
        print(f"training stopped: {e}", file=sys.stderr)
        return 3
    except Stopped as e:
        print(f"[train] {e}", file=sys.stderr)
        return 128 + 15  # as a process ended by SIGTERM: a scheduler requeues it
    return _leave_process_group(status)


def pipeline(cfg, accelerator, stage: str = "all") -> int:
    """The stages, in order (stage: one of them alone) -> the exit status."""
    from distill import run_distill
    from eval.speculative import evaluate
    from serving.export import export_draft
    from serving.publish import publish_stage
    from serving.validate import validate
    from train import Dist, train_draft

    stages = STAGES if stage == "all" else [stage]
    if "distill" in stages:
        run_distill(cfg, accelerator)
    if "train" in stages:
        train_draft(cfg, accelerator)
    # the last collective: the other processes leave, so no barrier waits out the main
    # process's own stages (hours of eval on a large target) against the group's timeout
    accelerator.wait_for_everyone()
    if not Dist.of(accelerator).is_main:
        return 0
    if "eval" in stages:  # one process measures speed
        evaluate(cfg, accelerator.device)
    if "export" in stages:
        exported = export_draft(cfg, cfg.eval.k)
        print(f"[export] {exported.folder}; serve with:\n  {exported.command}")
    if "publish" in stages and (cfg.publish.repo_id or stage == "publish"):
        publish_stage(cfg)
    if "validate" in stages:
        result = validate(cfg, device=accelerator.device)
        print(f"[validate] tau {result.tau_ours:.3f} in our engine, {result.tau_engine:.3f} in "
              f"vLLM ({result.method}); vLLM texts identical with and without the draft: "
              f"{result.identical_engine_texts}/{result.prompts}")
        if not result.ok:
            print("error: the export does not reproduce the trained draft in vLLM:\n  "
                  + "\n  ".join(result.failures), file=sys.stderr)
            return 1
    return 0


def _arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="recipe YAML, e.g. configs/*.yaml")
    parser.add_argument("--stage", choices=["all", *STAGES, *ON_REQUEST], default="all",
                        help="run one stage alone (default: the whole pipeline)")
    parser.add_argument("--plan", action="store_true",
                        help="print each stage's tokens, disk, peak memory per device and time, "
                             "and refuse a run that cannot fit; runs nothing, downloads nothing")
    parser.add_argument("--accelerate-config", default=None,
                        help="with --plan: the accelerate config the run will be launched with "
                             "(e.g. configs/accelerate/ddp.yaml; default one process)")
    parser.add_argument("--device", default=None,
                        help="with --plan: h100-80gb, h200, a100-80gb, l40s or cpu (default: cpu "
                             "for a CPU accelerate config, else h100-80gb)")
    return parser


def _checked_config(path: str, overrides: list[str], plan: bool):
    """The recipe with its overrides, checked against its kind, its target and the engines
    before any stage: a contradiction fails in seconds, not after stage 1."""
    from assets.prompts import check_data_packages
    from drafts import check_target_config, check_train_config
    from recipe import load_config
    from serving.engines import check_target_served

    cfg = load_config(path, overrides)
    kind = check_train_config(cfg.train)
    check_target_config(cfg, kind)
    check_target_served(cfg, kind)
    if not plan:  # the plan lists it among its problems
        check_data_packages(cfg)
    return cfg


def _leave_process_group(status: int) -> int:
    """End this process's part in the launch's process group (a launcher's processes leave one
    by one: the main process last, after its own stages)."""
    import torch.distributed as torch_dist

    if torch_dist.is_available() and torch_dist.is_initialized():
        torch_dist.destroy_process_group()
    return status


def stage_estimates() -> list:
    """What each stage says it will cost (plan.Sizing -> plan.StagePlan), in pipeline order."""
    from distill.estimate import estimate as distill_estimate
    from eval.estimate import estimate as eval_estimate
    from train.estimate import estimate as train_estimate

    return [distill_estimate, train_estimate, eval_estimate]


def _plan(cfg, accelerate_config: str | None, device: str | None) -> int:
    from plan import DEVICES, make_plan
    from recipe import ConfigError

    if device is not None and device not in DEVICES:
        print(f"config error: --device {device!r}: one of {', '.join(DEVICES)}.", file=sys.stderr)
        return 2
    try:
        plan = make_plan(cfg, stage_estimates(), accelerate_config, device)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(plan.text())
    if plan.problems:
        print("error: this run does not fit (above); nothing was started.", file=sys.stderr)
        return 2
    return 0


def _warn_if_starved(accelerator) -> None:
    """`accelerate launch` without a config sets OMP_NUM_THREADS=1 on a machine without GPU."""
    import os

    import torch

    cores = os.cpu_count() or 1
    if (accelerator.device.type == "cpu" and accelerator.num_processes == 1
            and torch.get_num_threads() < cores):
        accelerator.print(
            f"[distill] warning: computing on {torch.get_num_threads()} of {cores} CPU cores "
            f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}); launch with "
            "`accelerate launch --config_file configs/accelerate/cpu.yaml` to use them all.")


if __name__ == "__main__":
    sys.exit(main())
