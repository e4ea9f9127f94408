"""Benchmark: draftsmith's EAGLE-3 and DFlash trainers next to the field's, on the same
conversations, the same target features and matched settings, every head measured in one vLLM
run.

    .venv/bin/python -m benchmarks.side_by_side --config configs/smollm2-135m-eagle3.yaml
        [--peers speculators[,specforge]] [--epochs 8] [--seeds 0,1] [--conversations 200]
        [--questions 16]
        [--max-new-tokens 256] [--work DIR] [--write-docs] [--variant NAME]
        [recipe overrides key=value ...]

The recipe's train.draft picks the kind: an eagle3 recipe against speculators' EAGLE-3 trainer
and SpecForge's (`--peers speculators,specforge`), a dflash recipe
(configs/smollm2-135m-dflash.yaml) against speculators' DFlash trainer.

Steps, each resumed where a killed run left it (the work folder keeps what is done):
1. stage 1 of the recipe (our distill stage, its own resume), `--conversations` prompts;
2. each peer's pinned venv under <cache>/peers (speculators: torch 2.13.0 from the CPU wheel
   first; SpecForge: the torch 2.11.0 it pins, whose PyPI wheel runs on a CPU);
3. the stage-1 split (train and held out by id, as our trainer splits it) and the target's
   features, computed once by a transformers forward and written in the peer's format (for
   speculators: a dataset of input_ids / loss_mask / seq_len with the training rows first, and
   hidden_states/hs_<i>.safetensors: the three aux layers and the last hidden state before the
   final norm, [T, 4, H]; for SpecForge: one .ckpt per training conversation with the aux
   features and the last hidden state after the final norm); for EAGLE-3 the draft vocabulary
   our trainer picked (the most frequent training labels) written as the peer's d2t / t2d, for
   DFlash our mask token;
4. for each seed of `--seeds` (the recipe's run.seed by default; each peer gets the same as
   its seed): our trainer (resumed from its checkpoints), then each peer's (in a fresh process
   that finds ours done, so that the memory our stages left allocated is free for it; started over
   if killed, so that one run is timed), for the same epochs: the wall time of each (features
   excluded: they are shared) and the training tokens/s of its optimizer steps, as each
   trainer's own clock times them (SpecForge's: a clock the entry point puts around each of its
   steps): over all steps, and the median step's (robust to other work on the CPU);
5. every head in one vLLM worker, greedy, on MT-bench first turns: tau, alpha_k, and whether
   each text equals the target's own (a head measured before in the same setting keeps its
   figures).
The matched settings and those that cannot be matched are listed in MATCHED and UNMATCHED
(SPECFORGE_MATCHED and SPECFORGE_UNMATCHED for SpecForge) and printed with the table.
Runs: <work>/<epochs>-epochs/seed-<s>/<trainer>; results: <work>/<epochs>-epochs/results.json;
--write-docs writes them as a dated study of docs/results/ with the CPU, the commit and this
command. An ablation of ours
(`--variant NAME --peers '' key=value ...`) trains ours again with the overrides on the same
conversations and features, in <work>/<epochs>-epochs-<NAME>, and measures it in vLLM.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.peers import PEERS, peer_python
from benchmarks.peers.specforge import SPECFORGE_MATCHED, SPECFORGE_UNMATCHED, train_specforge
from benchmarks.peers.speculators import MATCHED, UNMATCHED, train_speculators
from decoding.acceptance import prompt_bootstrap_tau, seeds_verdict
from runfolder.prompts import across_categories
from runfolder.provenance import cpu_name, hardware, provenance_counts, source_commit

ROOT = Path(__file__).resolve().parents[1]

VLLM_METHOD = {"eagle3": "eagle3", "dflash": "dflash"}
KIND_NAMES = {"eagle3": "EAGLE-3", "dflash": "DFlash"}


# --- training --------------------------------------------------------------------------------

def share_stage1(stage1: Path, run: Path) -> Path:
    """A run folder for one training budget whose stage-1 data, manifest and offline features
    are those of `stage1` (links): every budget trains on the same conversations and features."""
    run.mkdir(parents=True, exist_ok=True)
    (stage1 / "features").mkdir(exist_ok=True)
    for name in ("manifest.json", "data", "features"):
        link = run / name
        if not link.is_symlink():
            link.symlink_to(stage1 / name)
    return run


def train_ours(cfg, log=print) -> dict:
    """Our trainer on the recipe, with the Accelerator distill.py gives it (the recipe's mixed
    precision); its offline features are written before the clock starts (the peers' are
    written by write_speculators_data, outside theirs)."""
    from accelerate import Accelerator

    from runfolder import run_folder
    from serving.export import export_draft
    from train import train_draft
    from train.loop import accelerator_kwargs, reset_accelerate

    reset_accelerate()
    start = time.perf_counter()
    summary = train_draft(cfg, Accelerator(**accelerator_kwargs(cfg)))
    seconds = time.perf_counter() - start
    exported = export_draft(cfg, cfg.eval.k, log=log)
    return {"folder": str(exported.folder), "wall_seconds": seconds,
            "step_seconds": summary.train_seconds, "step_tokens": summary.tokens,
            "optimizer_steps": summary.optimizer_steps, "resumed_from": summary.resumed_from,
            "step_rates": our_step_rates(run_folder(cfg).train_log)}


def trained_where(draft_folder: Path) -> dict:
    """The commit and hardware our trainer recorded with its draft (a resumed run's: its last
    process's)."""
    from runfolder import train_record

    record = train_record(draft_folder) or {}
    return {key: record[key] for key in ("commit", "hardware") if key in record}


def head_vocabulary(head_folder: Path) -> torch.Tensor:
    """The target ids of an exported EAGLE-3 head's draft vocabulary, [Vd] sorted: what our
    trainer picked (the most frequent training labels), given to the peers as their d2t/t2d."""
    from safetensors import safe_open

    from drafts.eagle3 import target_ids

    with safe_open(str(head_folder / "model.safetensors"), "pt") as f:
        d2t = f.get_tensor("d2t")
    return target_ids(torch.arange(len(d2t)), d2t)


def head_mask_token(head_folder: Path) -> int:
    """The mask token of an exported DFlash drafter (dflash_config.mask_token_id): the one our
    trainer picked, given to the peer."""
    config = json.loads((head_folder / "config.json").read_text())
    return int(config["dflash_config"]["mask_token_id"])


def our_step_rates(log_path: Path) -> list[float]:
    """Tokens/s of each of our optimizer steps, from train/log.jsonl's running totals (tokens,
    and tokens / train_seconds)."""
    rates, last_tokens, last_seconds = [], 0, 0.0
    for line in log_path.read_text().splitlines():
        entry = json.loads(line)
        if "tokens_per_s" not in entry:
            continue
        seconds = entry["tokens"] / entry["tokens_per_s"]
        if seconds > last_seconds:
            rates.append((entry["tokens"] - last_tokens) / (seconds - last_seconds))
        last_tokens, last_seconds = entry["tokens"], seconds
    return rates


# --- measuring -------------------------------------------------------------------------------

def head_figures(found: dict, reference: list[list[int]]) -> dict:
    """One head's vLLM run (spec-decode counters, texts) against the target's own texts: tau =
    1 + accepted / drafts (tokens per target forward) with its 95 % interval over prompts (each
    prompt's counters, resampled), alpha_j = accepted at position j / drafts, and how many texts
    equal the target's."""
    drafts = int(found.get("drafts") or 0)
    accepted = [int(a) for a in found.get("accepted_per_position") or []]
    figures = {"tau": 1 + sum(accepted) / drafts if drafts else float("nan"),
               "alpha": [a / drafts for a in accepted] if drafts else [],
               "drafts": drafts, "prompts": len(reference),
               "identical_texts": sum(a == b for a, b in zip(found["tokens"], reference)),
               "vllm_seconds": found["seconds"]}
    if found.get("per_request"):
        figures["per_prompt"] = {"drafts": [int(r["drafts"]) for r in found["per_request"]],
                                 "accepted": [int(r["accepted"]) for r in found["per_request"]]}
        _, low, high = prompt_bootstrap_tau(figures["per_prompt"]["drafts"],
                                            figures["per_prompt"]["accepted"])
        figures["tau_interval"] = [low, high]
    return figures


def head_identity(folder: Path) -> dict[str, str]:
    """What tells one exported head from another in the same folder (a run trained again, an
    export written again from the same draft is the same head): its weight files' SHA-256."""
    import hashlib

    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(Path(folder).glob("*.safetensors"))}


def measure(target_path: str, prompts: list[list[int]], eos: set[int], heads: dict[str, Path],
            method: str | dict[str, str], k: int, max_new_tokens: int, cache: Path) -> dict:
    """Every head and the target alone in one vLLM worker, greedy: tau, alpha_k, texts equal
    to the target's. method: vLLM's, of every head or by head name."""
    from serving.engines.vllm import run_worker

    runs = {"target": None}
    for name, folder in heads.items():
        runs[name] = {"method": method if isinstance(method, str) else method[name],
                      "model": str(Path(folder).resolve()),
                      "num_speculative_tokens": k}
    request = {"target": target_path, "dtype": "float32", "prompts": prompts,
               "max_new_tokens": max_new_tokens, "stop_token_ids": sorted(eos),
               "enforce_eager": True, "runs": runs,
               "one_at_a_time": True}  # each prompt's counters: intervals over prompts
    result = run_worker(request, cache)
    table = {name: head_figures(result[name], result["target"]["tokens"]) for name in heads}
    table["target"] = {"vllm_seconds": result["target"]["seconds"]}
    return table


# --- the command -----------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--peers", default="speculators")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--seeds", default="",
                        help="run.seed of each training, ours and the peers', e.g. 0,1 (each "
                             "peer is paired with ours of the same seed); default: the recipe's")
    parser.add_argument("--conversations", type=int, default=200,
                        help="stage-1 prompts (data.max_prompts); the held-out share is the "
                             "recipe's")
    parser.add_argument("--questions", type=int, default=16,
                        help="MT-bench first turns drawn across its 8 categories in turn")
    parser.add_argument("--split", choices=["report", "select"], default="report",
                        help="report: each category's even-indexed questions (what tables "
                             "report); select: the odd-indexed ones, disjoint, to choose arms on")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--variant", default="",
                        help="an ablation of ours: its own results folder (<epochs>-epochs-"
                             "<variant>) next to the main run's; give the recipe overrides it "
                             "changes, and --peers '' to train no peer again")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, key=value")
    argv = sys.argv[1:] if argv is None else argv  # the command, for the docs and a re-exec
    args = parser.parse_args(argv)

    from accelerate import Accelerator

    from assets.chat import render
    from assets.prompts import load_mtbench
    from assets.target import end_of_turn_ids, load_target, load_tokenizer, resolve_target
    from distill import run_distill
    from drafts.eagle3 import check_aux_layers, default_aux_layers
    from recipe import ConfigError, cache_root, load_config
    from runfolder import run_folder
    from train.data import load_stage1, truncate
    from train.features import feature_cache
    from train.loop import accelerator_kwargs, reset_accelerate

    peers = [p for p in args.peers.split(",") if p]
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        raise ConfigError(f"--peers {','.join(unknown)}: known peers are {sorted(PEERS)}.")
    work = args.work or cache_root() / "side-by-side" / f"{args.config.stem}-{args.conversations}"
    # stage 1 and the features serve every budget and variant
    budget = work / (f"{args.epochs}-epochs" + (f"-{args.variant}" if args.variant else ""))
    budget.mkdir(parents=True, exist_ok=True)
    base = load_config(args.config, [f"run.output_dir={work / 'stage1'}",
                                     f"data.max_prompts={args.conversations}", *args.overrides])
    kind = base.train.draft.partition(":")[0]
    try:
        seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [base.run.seed]
    except ValueError:
        raise ConfigError(f"--seeds {args.seeds!r}: give integers separated by commas, e.g. "
                          "--seeds 0,1.") from None
    if kind not in MATCHED:
        raise ConfigError(f"{args.config}: train.draft is {base.train.draft!r}; the side by side "
                          f"compares {' and '.join(MATCHED)} trainers: pass a recipe of one "
                          "(configs/smollm2-135m-eagle3.yaml, configs/smollm2-135m-dflash.yaml).")

    print(f"[side-by-side] stage 1: {args.conversations} prompts of {args.config.name}")
    run_distill(base, Accelerator(cpu=True))
    reset_accelerate()
    resolved = resolve_target(base.model)
    tokenizer = load_tokenizer(resolved, base.model.chat_template_kwargs)
    target = load_target(resolved, "float32", torch.device("cpu"))
    data = load_stage1(base, resolved.fingerprint)
    train = [truncate(e, base.train.max_seq_len) for e in data.train]
    held_out = [truncate(e, base.train.max_seq_len) for e in data.held_out]
    layers = target.config.num_hidden_layers
    aux_layers = check_aux_layers(base.train.aux_layers or default_aux_layers(layers),
                                  layers)
    train_tokens = sum(len(e.input_ids) for e in train)
    steps = math.ceil(args.epochs * len(train) / base.train.micro_batch_size)
    print(f"[side-by-side] {len(train)} training conversations ({train_tokens} tokens), "
          f"{len(held_out)} held out; {args.epochs} epochs = {steps} optimizer steps of ours")

    results_path = budget / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    if results and "seeds" not in results:  # a run before seeds: its heads are not reused
        raise ConfigError(f"{results_path} holds a run laid out before --seeds: move {budget} "
                          "aside (or pass --work DIR) and run again.")
    results.update(config=str(args.config), kind=kind, epochs=args.epochs, seeds=seeds,
                   train_conversations=len(train), held_out_conversations=len(held_out),
                   train_tokens=train_tokens,
                   cpu=cpu_name(), torch_threads=torch.get_num_threads(),
                   variant=args.variant, overrides=args.overrides)
    trained = results.setdefault("trainers", {})  # "<trainer>/seed-<s>" -> its run
    if "specforge" in peers and kind != "eagle3":
        raise ConfigError(f"--peers specforge: the side by side runs SpecForge's EAGLE-3 trainer "
                          f"only; a {KIND_NAMES[kind]} recipe compares with speculators "
                          "(--peers speculators).")

    heads = {}
    for seed in seeds:
        # ours: the recipe with the budget in epochs, the last step's head kept (peers keep theirs)
        ours = share_stage1(work / "stage1", budget / f"seed-{seed}" / "ours")
        cfg = load_config(args.config, [f"run.output_dir={ours}", f"run.seed={seed}",
                                        f"data.max_prompts={args.conversations}",
                                        f"train.max_steps={steps}", "train.keep=last",
                                        "train.freeze_embeddings=true", *args.overrides])
        if f"draftsmith/seed-{seed}" not in trained:
            feature_cache(cfg, target, resolved.fingerprint, data.train + data.held_out,
                          aux_layers, tokenizer.pad_token_id)  # written before its clock starts
            trained[f"draftsmith/seed-{seed}"] = train_ours(cfg)
            results_path.write_text(json.dumps(results, indent=2) + "\n")
            if any(f"{peer}/seed-{seed}" not in trained for peer in peers):
                # stage 1, the feature cache and ours' training leave ~9 GiB allocated in this
                # process (354 DFlash conversations): a peer's trainer beside it met the OOM
                # killer on 24 GiB. A fresh process finds ours done in results.json, goes on.
                print("[side-by-side] ours trained; the peers go on in a fresh process",
                      flush=True)
                os.execv(sys.executable, [sys.executable, "-m", "benchmarks.side_by_side",
                                          *argv])
        trained[f"draftsmith/seed-{seed}"].update(trained_where(run_folder(cfg).draft))
        bf16 = accelerator_kwargs(cfg)["mixed_precision"] == "bf16"  # as our trainer resolves it
        head = heads[f"draftsmith/seed-{seed}"] = Path(trained[f"draftsmith/seed-{seed}"]["folder"])
        draft_ids = head_vocabulary(head) if kind == "eagle3" else None
        mask_token = head_mask_token(head) if kind == "dflash" else None
        for peer in peers:
            name, folder = f"{peer}/seed-{seed}", budget / f"seed-{seed}" / peer
            if name not in trained:
                python = peer_python(peer)
                if folder.exists():  # a killed run's: its log and clock would mix with this one's
                    print(f"[side-by-side] {name}: the unfinished run in {folder} is started over")
                    shutil.rmtree(folder)
                if peer == "specforge":
                    trained[name] = train_specforge(python, cfg, resolved.path, work, folder,
                                                    train, target, aux_layers, draft_ids,
                                                    args.epochs, bf16)
                else:
                    trained[name] = train_speculators(python, cfg, kind, resolved.path, work,
                                                      folder, train, held_out, target, aux_layers,
                                                      draft_ids, mask_token, args.epochs, bf16)
                trained[name].update(commit=source_commit(), hardware=hardware())
                results_path.write_text(json.dumps(results, indent=2) + "\n")
            heads[name] = Path(trained[name]["folder"])
    for found in trained.values():
        found["tokens_per_second"] = found["step_tokens"] / found["step_seconds"]
        found["median_step_tokens_per_second"] = statistics.median(found["step_rates"])

    conversations, _ = load_mtbench()
    picked = across_categories(conversations, args.questions, tune=args.split == "select")
    prompts = [render(tokenizer, [{"role": "user", "content": c.user_turns[0]}], True)
               for c in picked]
    eos = end_of_turn_ids(target, tokenizer)
    setting = {"questions": [c.id for c in picked], "split": args.split,
               "max_new_tokens": args.max_new_tokens, "k": cfg.eval.k}
    if results.get("vllm_setting") != setting:  # every head is measured again
        results.update(vllm_setting=setting, vllm={}, head_identity={})
    todo = {name: folder for name, folder in heads.items()
            if name not in results["vllm"]
            or results["head_identity"].get(name) != head_identity(folder)}
    if todo:  # heads not yet measured in this setting, or trained again since
        print(f"[side-by-side] vLLM: {len(todo)} heads and the target, {len(prompts)} MT-bench "
              f"questions x {args.max_new_tokens} tokens, greedy, k={cfg.eval.k}", flush=True)
        found = measure(resolved.path, prompts, eos, todo, VLLM_METHOD[kind], cfg.eval.k,
                        args.max_new_tokens, cache_root() / "vllm")
        for name, folder in todo.items():
            results["vllm"][name] = {**found[name], "commit": source_commit(),
                                     "hardware": hardware()}
            results["head_identity"][name] = head_identity(folder)
    results.update(questions=len(prompts), question_ids=[c.id for c in picked],
                   split=args.split, max_new_tokens=args.max_new_tokens, k=cfg.eval.k)
    results_path.write_text(json.dumps(results, indent=2) + "\n")
    table = render_table(results)
    print(settings(kind))
    print(table)
    if args.write_docs:
        print(f"[side-by-side] wrote {write_docs(results, table, argv)}: list it in "
              "docs/results.md")
    return 0


def settings(kind: str) -> str:
    """What the side by side of `kind` matches between the trainers, and what it cannot."""
    text = (f"{KIND_NAMES[kind]}, matched:\n" + "".join(f"- {m}\n" for m in MATCHED[kind])
            + f"\n{KIND_NAMES[kind]}, not matched:\n"
            + "".join(f"- {m}\n" for m in UNMATCHED[kind]))
    if kind == "eagle3":
        text += ("\nEAGLE-3 against SpecForge, matched:\n"
                 + "".join(f"- {m}\n" for m in SPECFORGE_MATCHED)
                 + "\nEAGLE-3 against SpecForge, not matched:\n"
                 + "".join(f"- {m}\n" for m in SPECFORGE_UNMATCHED))
    return text


def render_table(results: dict) -> str:
    """The trainers' heads in vLLM, seed by seed: tau with its 95 % interval over prompts, and
    each peer's difference from ours of the same seed with its paired interval (the same
    prompts resampled together); then ours against each peer over every seed
    (decoding.acceptance.seeds_verdict) and the training speed ratio."""
    lines = ["| trainer | seed | tau [95 % over prompts] | minus draftsmith's [95 %] | "
             "alpha_1..k | texts = target's | wall time | optimizer steps | training tokens/s "
             "(all steps / median step) |", "|---|---|---|---|---|---|---|---|---|"]
    against: dict[str, list] = {}  # peer -> [(ours - theirs, low, high), speed ratio] per seed
    def order(name: str) -> tuple:  # seed by seed, ours first
        trainer, seed = name.split("/seed-")
        return int(seed), trainer != "draftsmith", trainer

    for name in sorted(results["trainers"], key=order):
        found = results["trainers"][name]
        trainer, seed = name.split("/seed-")
        v = results["vllm"][name]
        ours = results["vllm"].get(f"draftsmith/seed-{seed}", {}).get("per_prompt")
        alpha = " / ".join(f"{a:.3f}" for a in v["alpha"])
        interval = (f" [{v['tau_interval'][0]:.3f}, {v['tau_interval'][1]:.3f}]"
                    if "tau_interval" in v else "")
        difference = "-"
        if trainer != "draftsmith" and ours and "per_prompt" in v:
            d, low, high = prompt_bootstrap_tau(v["per_prompt"]["drafts"],
                                                v["per_prompt"]["accepted"],
                                                ours["drafts"], ours["accepted"])
            difference = f"{d:+.3f} [{low:+.3f}, {high:+.3f}]"
            speed = (results["trainers"][f"draftsmith/seed-{seed}"]["median_step_tokens_per_second"]
                     / found["median_step_tokens_per_second"])
            against.setdefault(trainer, []).append(((-d, -high, -low), speed))
        lines.append(f"| {trainer} | {seed} | {v['tau']:.3f}{interval} | {difference} | {alpha} | "
                     f"{v['identical_texts']}/{v['prompts']} | {found['wall_seconds']:.0f} s | "
                     f"{found['optimizer_steps']} | {found['tokens_per_second']:.0f} / "
                     f"{found['median_step_tokens_per_second']:.0f} |")
    if against:
        lines += ["", "| draftsmith against | tau, over every seed | training tokens/s, ours over "
                  "theirs (median step), per seed |", "|---|---|---|"]
    for peer, seen in against.items():
        lines.append(f"| {peer} | {seeds_verdict([d for d, _ in seen])} | "
                     f"{' / '.join(f'{r:.2f}x' for _, r in seen)} |")
    lines += ["", (f"Trained at {provenance_counts(results['trainers'].values(), 'run')}; "
                   f"measured in vLLM at {provenance_counts(results['vllm'].values(), 'head')}.")]
    return "\n".join(lines)


def write_docs(results: dict, table: str, argv: list[str], today: str | None = None) -> Path:
    """This run as a study of the dated results log: docs/results/<date>-side-by-side-<recipe>-
    <conversations>-<epochs>[-<variant>].md, with the CPU, the commit, the command, the table
    and the settings matched and not; a run repeated the same day replaces that day's file.
    -> the file (docs/results.md lists it: add its line there)."""
    import datetime

    commit = source_commit()
    epochs = f"{results['epochs']} epoch{'s' if results['epochs'] != 1 else ''}"
    title = (f"Side by side: {results['config']}, {results['train_conversations']} training "
             f"conversations, {epochs}" + (f", {results['variant']} "
                                           f"({' '.join(results['overrides'])})"
                                           if results.get("variant") else ""))
    today = today or datetime.date.today().isoformat()
    name = "-".join([today, "side-by-side", Path(results["config"]).stem,
                     str(results["train_conversations"]), f"{results['epochs']}-epochs",
                     *([results["variant"]] if results.get("variant") else [])])
    doc = ROOT / "docs" / "results" / f"{name}.md"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text("\n".join([
        f"# {title}", "",
        f"{results['cpu']}; {results['torch_threads']} torch threads; commit {commit}; "
        f"`.venv/bin/python -m benchmarks.side_by_side {' '.join(argv)}`. vLLM (CPU, fp32), "
        f"{results['questions']} MT-bench first turns drawn across its categories "
        f"({results.get('split', 'report')} split: questions "
        f"{', '.join(map(str, results.get('question_ids', [])))}) x "
        f"{results['max_new_tokens']} tokens, greedy, k={results['k']}; intervals resample "
        f"prompts; training seeds {results.get('seeds', [0])}, each peer paired with ours of "
        "the same seed.", "", table, "",
        settings(results.get("kind", "eagle3")), ""]))
    return doc


if __name__ == "__main__":
    raise SystemExit(main())
