"""Benchmark: draftsmith's EAGLE-3 and DFlash trainers next to the field's, on the same
conversations, the same target features and matched settings, every head measured in one vLLM
run.

    .venv/bin/python -m benchmarks.side_by_side --config configs/smollm2-135m-eagle3.yaml
        [--peers speculators[,specforge]] [--epochs 8] [--conversations 200] [--questions 10]
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
4. our trainer (resumed from its checkpoints), then each peer's (in a fresh process that finds
   ours done, so that the memory our stages left allocated is free for it; started over
   if killed, so that one run is timed), for the same epochs: the wall time of each (features
   excluded: they are shared) and the training tokens/s of its optimizer steps, as each
   trainer's own clock times them (SpecForge's: a clock the entry point puts around each of its
   steps): over all steps, and the median step's (robust to other work on the CPU);
5. every head in one vLLM worker, greedy, on MT-bench first turns: tau, alpha_k, and whether
   each text equals the target's own.
The matched settings and those that cannot be matched are listed in MATCHED and UNMATCHED
(SPECFORGE_MATCHED and SPECFORGE_UNMATCHED for SpecForge) and printed with the table.
Results: <work>/<epochs>-epochs/results.json; --write-docs puts the table into
docs/side-by-side.md with the CPU, the commit and this command. An ablation of ours
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
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.architecture_matrix import cpu_name
from runfolder.paths import RunFolder

ROOT = Path(__file__).resolve().parents[1]
PEERS = {"speculators": "speculators==0.9.0", "specforge": "specforge==0.2.0"}
PEER_ENTRY = {"speculators": ROOT / "benchmarks" / "peer_entry" / "speculators_cpu.py",
              "specforge": ROOT / "benchmarks" / "peer_entry" / "specforge_cpu.py"}
# speculators runs on our torch (the CPU wheel); SpecForge pins torch 2.11.0, whose PyPI wheel
# (built for CUDA, with its libraries: most of the venv's ~11 GB) runs on a CPU as well
CPU_TORCH = {"speculators": True, "specforge": False}

SHARED_MATCHED = [
    "stage-1 conversations, their train / held-out split (by id) and truncation to max_seq_len",
    "target features: one transformers forward, fp32, stored in bf16 by both",
]
SHARED_TAIL = [
    "AdamW, the recipe's peak learning rate, its warmup steps, cosine decay, no weight decay, "
    "gradients clipped at norm 1",
    "bf16 autocast where the CPU runs it natively (the recipe's mixed_precision: auto)",
]
SHARED_UNMATCHED = [
    "batches: ours takes micro_batch_size conversations per optimizer step; speculators packs "
    "conversations into a token budget per step (--total-seq-len), set to micro_batch_size times "
    "the mean training conversation's length, so tokens per step match on average and the step "
    "counts differ a little",
    "the cosine floor: ours decays to learning_rate * min_lr_ratio, speculators' to 0",
    "speculators saves its checkpoints in bf16, ours in fp32",
]
MATCHED = {
    "eagle3": SHARED_MATCHED + [
        "one decoder layer over the aux layers of the recipe (vLLM's default ids)",
        "draft vocabulary: the same d2t / t2d (the recipe's size, most frequent training labels)",
        "training-time test: the recipe's ttt_steps, step j weighted head_decay**j",
        "loss: forward KL against the target on the draft vocabulary (speculators' kl_div)",
        *SHARED_TAIL,
        "lm_head frozen at the target's rows of the draft vocabulary; the same epochs",
    ],
    "dflash": SHARED_MATCHED + [
        "the recipe's number of Qwen3-style layers over the aux layers of the recipe, attending "
        "to the context before the block and to the whole block (speculators' layers set to "
        "full attention: its default sliding-window layers are causal inside a block)",
        "blocks: the known token and train.block_size masks (speculators' block size is one "
        "more: it counts the known token), the same mask token; a block after every answer "
        "position (speculators' --max-anchors raised to its token budget per step)",
        "loss: forward KL against the target over the whole vocabulary, mask j weighted "
        "head_decay**(j-1) (speculators' kl_div with fixed-exp-decay, gamma = "
        "-1 / ln(head_decay))",
        *SHARED_TAIL,
        "embeddings and lm_head frozen at the target's; the same epochs",
    ],
}
UNMATCHED = {
    "eagle3": SHARED_UNMATCHED + [
        "speculators' sliding-window attention (2,048 tokens) is wider than max_seq_len, so it "
        "attends as ours does; its norms are switched off to match the EAGLE-3 layer ours "
        "trains",
    ],
    "dflash": SHARED_UNMATCHED + [
        "initialisation: ours starts each layer as a copy of one of the target's (our DFlash "
        "trainer's method, drafts/dflash/head.py); speculators' start from random weights, its "
        "only start short of a trained speculator",
    ],
}
# SpecForge's EAGLE-3 trainer beside ours (with the shared items above)
SPECFORGE_MATCHED = [
    "stage-1 conversations, their train / held-out split (by id) and truncation to max_seq_len",
    "target features: one transformers forward, fp32; the aux features in the draft's dtype, "
    "the last hidden state after the final norm in bf16 (its target head's fixed dtype)",
    "one decoder layer over the aux layers of the recipe; the same d2t / t2d",
    "training-time test: the recipe's ttt_steps, step j weighted 0.8**j (SpecForge's fixed "
    "weight; the side by side refuses another train.head_decay)",
    "loss: cross-entropy against the target's distribution on the draft vocabulary (forward "
    "KL less the target's entropy: the same gradients)",
    *SHARED_TAIL[:1],
    "micro_batch_size conversations per optimizer step, padded, as ours (its loader drops a "
    "last partial batch)",
    "the same epochs",
]
SPECFORGE_UNMATCHED = [
    "lm_head: SpecForge trains one of its own from random weights (no setting freezes it); ours "
    "is frozen at the target's rows of the draft vocabulary",
    "the cosine floor: ours decays to learning_rate * min_lr_ratio, SpecForge's to 0; its "
    "warmup is a ratio of the steps, set to the recipe's warmup steps over the run's",
    "precision where the CPU runs bf16 natively: SpecForge keeps the draft's weights in bf16 "
    "with fp32 copies in its optimizer; ours keeps fp32 weights under bf16 autocast",
    "its loss is a mean over every position of the padded batch (positions without a loss "
    "count zero); ours a weighted mean over the positions that carry one",
]
VLLM_METHOD = {"eagle3": "eagle3", "dflash": "dflash"}
KIND_NAMES = {"eagle3": "EAGLE-3", "dflash": "DFlash"}


# --- peers' environments ---------------------------------------------------------------------

def peer_python(peer: str, log=print) -> Path:
    """The python of the peer's own venv, made once. speculators: torch 2.13.0 (the CPU wheel
    on disk) first, the pinned peer with torch held to it, then without PyPI's CUDA torchvision
    / torchaudio / torchcodec, which break `import transformers` beside the CPU torch.
    SpecForge: the pinned peer with the torch it pins."""
    from recipe import cache_root

    spec = PEERS[peer]
    venv = cache_root() / "peers" / spec.replace("==", "-")
    python = venv / "bin" / "python"
    stamp = venv / ".installed"
    if stamp.is_file():
        return python
    log(f"[side-by-side] installing {spec} into {venv} (once)")
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q", "--no-compile"]
    if CPU_TORCH[peer]:
        subprocess.run([*pip, "torch==2.13.0"], check=True)
        constraints = venv / "constraints.txt"
        constraints.write_text("torch==2.13.0\n")
        subprocess.run([*pip, "-c", str(constraints), spec], check=True)
        subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", "torchvision",
                        "torchaudio", "torchcodec"], check=False)
    else:
        subprocess.run([*pip, spec], check=True)
    subprocess.run([str(python), "-c", f"import {peer}, transformers"], check=True)
    stamp.write_text(spec + "\n")
    return python


# --- the shared data -------------------------------------------------------------------------

@torch.no_grad()
def layer_features(target, input_ids: list[int], aux_layers: list[int]) -> torch.Tensor:
    """[T, len(aux_layers) + 1, H]: the inputs of the aux decoder layers (HF hidden_states
    indices) and the last decoder layer's output before the final norm, what speculators
    stores (the norm and lm_head give the target's logits from it)."""
    decoder = target.get_decoder()
    last = {}
    hook = decoder.layers[-1].register_forward_hook(
        lambda module, args, output: last.setdefault("h", output[0] if isinstance(output, tuple)
                                                      else output))
    try:
        out = decoder(input_ids=torch.tensor([input_ids]), output_hidden_states=True)
    finally:
        hook.remove()
    layers = [out.hidden_states[i][0] for i in aux_layers] + [last["h"][0]]
    return torch.stack(layers, dim=1)


def write_speculators_data(folder: Path, train, held_out, target, aux_layers: list[int],
                           draft_ids: torch.Tensor | None, log=print) -> float:
    """speculators' offline training data in `folder`, training rows first (its split takes the
    first int(n * train_data_ratio) rows), and the d2t / t2d of `draft_ids` when the draft has
    a vocabulary of its own: returns the ratio that splits exactly there."""
    from datasets import Dataset
    from safetensors.torch import load_file, save_file

    from drafts.eagle3 import vocab_maps

    rows = list(train) + list(held_out)
    hidden = folder / "hidden_states"
    hidden.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    for i, e in enumerate(rows):
        path = hidden / f"hs_{i}.safetensors"
        if path.is_file() and load_file(path)["token_ids"].tolist() == e.input_ids:
            continue
        features = layer_features(target, e.input_ids, aux_layers)
        tmp = path.with_suffix(".tmp")
        save_file({"hidden_states": features.to(torch.bfloat16).contiguous(),
                   "token_ids": torch.tensor(e.input_ids)}, str(tmp))
        tmp.replace(path)
        if (i + 1) % 50 == 0:
            log(f"[side-by-side] features {i + 1}/{len(rows)} "
                f"({time.perf_counter() - start:.0f} s)")
    # rewritten each time (it is small), in torch format as its loader reads it
    staged = folder / ".dataset.tmp"
    shutil.rmtree(staged, ignore_errors=True)
    Dataset.from_dict({"input_ids": [e.input_ids for e in rows],
                       "loss_mask": [e.loss_mask for e in rows],
                       "seq_len": [len(e.input_ids) for e in rows]}).with_format(
        "torch").save_to_disk(str(staged))
    for old in folder.glob("data-*.arrow"):
        old.unlink()
    for part in staged.iterdir():
        part.replace(folder / part.name)
    staged.rmdir()
    if draft_ids is not None:
        import numpy as np

        d2t, t2d = vocab_maps(draft_ids, target.get_output_embeddings().weight.shape[0])
        np.save(folder / f"d2t-{len(draft_ids)}.npy", d2t.numpy())
        np.save(folder / f"t2d-{len(draft_ids)}.npy", t2d.numpy())
    # int(n * ratio) == len(train), half a row clear of either neighbour
    return (len(train) + 0.5) / len(rows)


def check_features_match_ours(folder: Path, run_cfg, examples, target, log=print) -> float:
    """The largest relative difference between the speculators files and our trainer's own
    feature cache (aux features; our post-norm last hidden state against the final norm of
    theirs), over the rows our cache holds: both come from one forward of the same target."""
    from safetensors.torch import load_file

    from runfolder import run_folder

    cache = run_folder(run_cfg).features
    shards = sorted(cache.glob("features-*.safetensors")) if cache.is_dir() else []
    if not shards:
        log("[side-by-side] our feature cache is not on disk: features not cross-checked")
        return float("nan")
    ours = {}
    for shard in shards:
        ours.update(load_file(shard))
    worst, compared = 0.0, 0
    norm = target.get_decoder().norm
    for i, e in enumerate(examples):
        aux_key, last_key = f"{e.id}/aux", f"{e.id}/last"
        if aux_key not in ours:
            continue
        path = folder / "hidden_states" / f"hs_{i}.safetensors"
        theirs = load_file(path)["hidden_states"].float()
        T = ours[aux_key].shape[0]
        aux = theirs[:T, :-1].flatten(1)
        last = norm(theirs[:T, -1])
        for a, b in ((aux, ours[aux_key].float()), (last, ours[last_key].float())):
            worst = max(worst, float((a - b).norm() / b.norm().clamp_min(1e-12)))
        compared += 1
    return worst if compared else float("nan")


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


def speculators_steps(log_text: str) -> dict:
    """Its optimizer steps as its own log times them (profile/step_ms and profile/tokens_per_s,
    printed per step): the seconds and tokens of the steps alone, and each step's rate."""
    import re

    ms = [float(v) for v in re.findall(r"profile/step_ms=([0-9.e+-]+)", log_text)]
    rates = [float(v) for v in re.findall(r"profile/tokens_per_s=([0-9.e+-]+)", log_text)]
    if not ms or len(ms) != len(rates):
        raise RuntimeError("speculators' log holds no per-step timing (profile/step_ms, "
                           "profile/tokens_per_s): it changed format or trained no step")
    return {"optimizer_steps": len(ms), "step_seconds": sum(ms) / 1000,
            "step_tokens": sum(r * m / 1000 for r, m in zip(rates, ms)), "step_rates": rates}


def speculators_flags(cfg, kind: str, target_path: str, data: Path, save: Path, ratio: float,
                      epochs: int, aux_layers: list[int], bf16: bool, tokens_per_step: int,
                      mask_token_id: int | None = None) -> list[str]:
    """speculators' train flags for the recipe's settings (MATCHED[kind])."""
    t = cfg.train
    flags = ["--verifier-name-or-path", target_path, "--data-path", str(data),
             "--speculator-type", kind,
             "--target-layer-ids", *[str(i) for i in aux_layers]]
    if kind == "eagle3":
        flags += ["--num-layers", "1",
                  # the EAGLE-3 layer as ours (and vLLM's default) has it: no extra norms
                  "--no-norm-before-residual", "--no-norm-before-fc", "--no-norm-output",
                  "--draft-vocab-size", str(t.draft_vocab_size),
                  "--ttt-steps", str(t.ttt_steps), "--ttt-step-loss-decay", str(t.head_decay)]
    elif kind == "dflash":
        from drafts.dflash import parse_layers

        layers = parse_layers(t.draft)
        flags += ["--num-layers", str(layers), "--draft-arch", "qwen3",
                  # full attention: non-causal inside the block, as ours and vLLM's DFlash
                  "--full-attention-indices", *[str(i) for i in range(layers)],
                  "--block-size", str(t.block_size + 1), "--mask-token-id", str(mask_token_id),
                  "--max-anchors", str(tokens_per_step),
                  "--loss-fn", "kl_div", "--per-position-loss-weight", "fixed-exp-decay",
                  "--dflash-decay-gamma", f"{-1 / math.log(t.head_decay):.6f}"]
    else:
        raise ValueError(f"no speculators trainer for {kind!r}")
    return flags + [
        "--optimizer", "adamw", "--lr", str(t.learning_rate), "--weight-decay", "0",
        "--scheduler-type", "cosine", "--scheduler-warmup-steps", str(t.warmup_steps),
        "--epochs", str(epochs), "--total-seq-len", str(tokens_per_step),
        "--train-data-ratio", f"{ratio:.6f}", "--save-path", str(save),
        "--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--num-workers", "0",
        "--hidden-states-dtype", "bfloat16" if bf16 else "float32",
        "--seed", str(cfg.run.seed)]


def run_peer(peer: str, python: Path, args: list[str], log_path: Path, what: str,
             env: dict | None = None) -> float:
    """One run of the peer's entry point (benchmarks/peer_entry) in its venv, with our torch
    threads and `env`, its output appended to log_path: its wall seconds. A failure raises
    with the end of its log."""
    env = {**os.environ, "PYTHONPATH": "", "OMP_NUM_THREADS": str(torch.get_num_threads()),
           **(env or {})}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with log_path.open("a") as log:
        done = subprocess.run([str(python), str(PEER_ENTRY[peer]), *args], env=env,
                              cwd=log_path.parent, stdout=log, stderr=subprocess.STDOUT,
                              check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        tail = log_path.read_text()[-3000:]
        raise RuntimeError(f"{what} failed (exit {done.returncode}); its log {log_path} "
                           f"ends:\n{tail}")
    return seconds


def train_speculators(python: Path, cfg, kind: str, target_path: str, work: Path, folder: Path,
                      train, held_out, target, aux_layers: list[int],
                      draft_ids: torch.Tensor | None, mask_token: int | None, epochs: int,
                      bf16: bool) -> dict:
    """speculators' trainer of `kind` on the same conversations: its data (outside its clock),
    its run (timed), its last checkpoint, which vLLM loads as it is."""
    data = work / "speculators-data"
    ratio = write_speculators_data(data, train, held_out, target, aux_layers, draft_ids)
    mismatch = check_features_match_ours(data, cfg, train + held_out, target)
    # its steps pack conversations into a token budget: ours take micro_batch_size
    # conversations, so the budget is that many of the mean training length
    train_tokens = sum(len(e.input_ids) for e in train)
    per_step = max(cfg.train.max_seq_len,
                   round(cfg.train.micro_batch_size * train_tokens / len(train)))
    flags = speculators_flags(cfg, kind, target_path, data, folder / "checkpoints", ratio,
                              epochs, aux_layers, bf16, per_step, mask_token)
    print(f"[side-by-side] speculators: training ({epochs} epochs), log {folder / 'train.log'}")
    seconds = run_peer("speculators", python, flags, folder / "train.log",
                       "speculators' trainer")
    return {"wall_seconds": seconds,
            **speculators_steps((folder / "train.log").read_text()),
            "folder": str(latest_speculators_checkpoint(folder / "checkpoints")),
            "flags": flags, "features_vs_ours": mismatch}


def latest_speculators_checkpoint(save: Path) -> Path:
    """speculators saves <save>/<epoch>/ (config.json + weights): the last epoch's folder."""
    epochs = [p for p in save.iterdir() if p.is_dir() and p.name.isdigit()
              and (p / "config.json").is_file()]
    if not epochs:
        raise RuntimeError(f"speculators wrote no checkpoint folder under {save}")
    return max(epochs, key=lambda p: int(p.name))


# --- SpecForge --------------------------------------------------------------------------------

def write_specforge_data(folder: Path, train, target, aux_layers: list[int],
                         draft_ids: torch.Tensor, aux_dtype: torch.dtype, log=print) -> None:
    """SpecForge's offline EAGLE-3 data in `folder`: train/<i>.ckpt, one per training
    conversation (its loader reads every .ckpt under a directory, so the held-out rows are not
    written), {input_ids [T], loss_mask [T], hidden_state [1, T, H]: the last hidden state after
    the final norm, what its frozen target head projects (bf16, that head's dtype),
    aux_hidden_state [1, T, 3H] in the draft's dtype}, and vocab_mapping.pt with the d2t / t2d
    of `draft_ids`."""
    from drafts.eagle3 import vocab_maps

    rows = folder / "train"
    rows.mkdir(parents=True, exist_ok=True)
    norm = target.get_decoder().norm
    start = time.perf_counter()
    for i, e in enumerate(train):
        path = rows / f"{i:06d}.ckpt"
        if path.is_file() and torch.load(path, weights_only=True)["input_ids"].tolist() == \
                e.input_ids:
            continue
        features = layer_features(target, e.input_ids, aux_layers)
        with torch.no_grad():
            last = norm(features[:, -1])
        tmp = path.with_suffix(".tmp")
        torch.save({"input_ids": torch.tensor(e.input_ids),
                    "loss_mask": torch.tensor(e.loss_mask),
                    "hidden_state": last.to(torch.bfloat16)[None].contiguous(),
                    "aux_hidden_state": features[:, :-1].flatten(1).to(aux_dtype)[None]
                    .contiguous()}, tmp)
        tmp.replace(path)
        if (i + 1) % 50 == 0:
            log(f"[side-by-side] SpecForge features {i + 1}/{len(train)} "
                f"({time.perf_counter() - start:.0f} s)")
    for extra in rows.glob("*.ckpt"):  # rows of a larger data set written here before
        if int(extra.stem) >= len(train):
            extra.unlink()
    d2t, t2d = vocab_maps(draft_ids, target.get_output_embeddings().weight.shape[0])
    torch.save({"d2t": d2t, "t2d": t2d}, folder / "vocab_mapping.pt")


def specforge_target(target_path: str, folder: Path) -> Path:
    """The target as SpecForge reads it: its folder's files (links) plus the
    model.safetensors.index.json it looks for the lm_head's file in (a one-file checkpoint
    has none)."""
    from safetensors import safe_open

    source = Path(target_path)
    folder.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        link = folder / f.name
        if not link.is_symlink():
            link.symlink_to(f.resolve())
    weights = sorted(source.glob("*.safetensors"))
    if len(weights) != 1 and not list(source.glob("*.index.json")):
        raise RuntimeError(f"{source}: one safetensors file or an index expected")
    if not list(source.glob("*.index.json")):
        with safe_open(str(weights[0]), "pt") as f:
            weight_map = {key: weights[0].name for key in f.keys()}
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1) + "\n")
    return folder


def specforge_run(cfg, target_folder: Path, data: Path, folder: Path, epochs: int,
                  train_conversations: int, aux_layers: list[int], bf16: bool) -> Path:
    """SpecForge's run config (YAML) for the recipe's settings (MATCHED["eagle3"]), and the
    draft config it trains: the target's architecture fields, one layer, the recipe's draft
    vocabulary."""
    import yaml

    t = cfg.train
    if abs(t.head_decay - 0.8) > 1e-9:
        raise ValueError(f"train.head_decay is {t.head_decay}: SpecForge weighs TTT step j by "
                         "0.8**j and has no setting for it; compare at train.head_decay=0.8")
    draft = json.loads((target_folder / "config.json").read_text())
    for key in ("dtype", "torch_dtype", "transformers_version"):
        draft.pop(key, None)
    draft.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama",
                 num_hidden_layers=1, draft_vocab_size=t.draft_vocab_size,
                 tie_word_embeddings=False,
                 eagle_config={"eagle_aux_hidden_state_layer_ids": aux_layers})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "draft_config.json").write_text(json.dumps(draft, indent=2) + "\n")
    total_steps = epochs * math.ceil(train_conversations / t.micro_batch_size)
    run = {
        "run_id": "side-by-side",
        "output_dir": str(folder / "output"),
        "model": {"target_model_path": str(target_folder),
                  "draft_model_config": str(folder / "draft_config.json"),
                  # SmolLM2 ties lm_head to the embeddings
                  "embedding_key": "model.embed_tokens.weight",
                  "lm_head_key": "model.embed_tokens.weight",
                  "vocab_mapping_path": str(data / "vocab_mapping.pt"),
                  "aux_hidden_state_layer_ids": aux_layers,
                  "torch_dtype": "bfloat16" if bf16 else "float32"},
        "data": {"hidden_states_path": str(data / "train"), "max_length": t.max_seq_len,
                 "dataloader_num_workers": 0, "cache_dir": str(folder / "cache")},
        "training": {"strategy": "eagle3", "num_epochs": epochs, "batch_size": t.micro_batch_size,
                     "accumulation_steps": 1, "fsdp_sharding": "NO_SHARD",
                     "learning_rate": t.learning_rate, "lr_scheduler": "cosine",
                     "warmup_ratio": min(t.warmup_steps, total_steps - 1) / total_steps,
                     "max_grad_norm": 1.0,
                     "ttt_length": t.ttt_steps, "attention_backend": "sdpa",
                     "log_interval": 1, "seed": cfg.run.seed},
        "tracking": {"report_to": "none"},
    }
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(run, sort_keys=False))
    return path


def specforge_steps(step_log: Path) -> dict:
    """Its optimizer steps from the entry point's per-step lines: seconds, tokens, rates."""
    steps = [json.loads(line) for line in step_log.read_text().splitlines()]
    stepped = [s for s in steps if s["optimizer_stepped"]]
    if not stepped:
        raise RuntimeError(f"{step_log}: SpecForge trained no optimizer step")
    return {"optimizer_steps": len(stepped), "step_seconds": sum(s["seconds"] for s in steps),
            "step_tokens": sum(s["tokens"] for s in steps),
            "step_rates": [s["tokens"] / s["seconds"] for s in stepped]}


def latest_specforge_checkpoint(output: Path) -> Path:
    """The newest checkpoint folder SpecForge wrote under its output_dir."""
    found = [p.parent for p in output.rglob("*.pt") if p.parent.name != "cache"]
    if not found:
        raise RuntimeError(f"SpecForge wrote no checkpoint under {output}")
    return max(found, key=lambda p: p.stat().st_mtime)


def train_specforge(python: Path, cfg, target_path: str, work: Path, folder: Path, train,
                    target, aux_layers: list[int], draft_ids: torch.Tensor, epochs: int,
                    bf16: bool) -> dict:
    """SpecForge's EAGLE-3 trainer on the same conversations: its data (outside its clock), its
    run (timed), its checkpoint exported in the HF layout vLLM loads."""
    data = work / "specforge-data"
    write_specforge_data(data, train, target, aux_layers, draft_ids,
                         torch.bfloat16 if bf16 else torch.float32)
    target_folder = specforge_target(target_path, work / "specforge-target")
    config = specforge_run(cfg, target_folder, data, folder, epochs, len(train), aux_layers,
                           bf16)
    steps = folder / "steps.jsonl"
    print(f"[side-by-side] specforge: training ({epochs} epochs), log {folder / 'train.log'}")
    on_cpu = {"SPECFORGE_DEVICE": "cpu"}
    seconds = run_peer("specforge", python, ["train", "--config", str(config)],
                       folder / "train.log", "SpecForge's trainer",
                       {**on_cpu, "SIDE_BY_SIDE_STEP_LOG": str(steps)})
    checkpoint = latest_specforge_checkpoint(folder / "output")
    head = folder / "head"
    run_peer("specforge", python, ["export", "--to", "hf", "--checkpoint", str(checkpoint),
                                   "--draft-config", str(folder / "draft_config.json"),
                                   "--output-dir", str(head),
                                   "--vocab-mapping", str(data / "vocab_mapping.pt"),
                                   "--embedding-source", str(target_folder),
                                   "--embedding-key", "model.embed_tokens.weight"],
             folder / "export.log", "SpecForge's export", on_cpu)
    return {"wall_seconds": seconds, "folder": str(head), "checkpoint": str(checkpoint),
            "config": str(config), **specforge_steps(steps)}


# --- measuring -------------------------------------------------------------------------------

def head_figures(found: dict, reference: list[list[int]]) -> dict:
    """One head's vLLM run (spec-decode counters, texts) against the target's own texts: tau =
    1 + accepted / drafts (tokens per target forward), alpha_j = accepted at position j /
    drafts, and how many texts equal the target's."""
    drafts = int(found.get("drafts") or 0)
    accepted = [int(a) for a in found.get("accepted_per_position") or []]
    return {"tau": 1 + sum(accepted) / drafts if drafts else float("nan"),
            "alpha": [a / drafts for a in accepted] if drafts else [],
            "drafts": drafts, "prompts": len(reference),
            "identical_texts": sum(a == b for a, b in zip(found["tokens"], reference)),
            "vllm_seconds": found["seconds"]}


def measure(target_path: str, prompts: list[list[int]], eos: set[int], heads: dict[str, Path],
            method: str, k: int, max_new_tokens: int, cache: Path) -> dict:
    """Every head and the target alone in one vLLM worker, greedy: tau, alpha_k, texts equal
    to the target's."""
    from serving.engines.vllm import run_worker

    runs = {"target": None}
    for name, folder in heads.items():
        runs[name] = {"method": method, "model": str(Path(folder).resolve()),
                      "num_speculative_tokens": k}
    request = {"target": target_path, "dtype": "float32", "prompts": prompts,
               "max_new_tokens": max_new_tokens, "stop_token_ids": sorted(eos),
               "enforce_eager": True, "runs": runs}
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
    parser.add_argument("--conversations", type=int, default=200,
                        help="stage-1 prompts (data.max_prompts); the held-out share is the "
                             "recipe's")
    parser.add_argument("--questions", type=int, default=10)
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
    aux_layers = check_aux_layers(base.train.eagle_aux_layers or default_aux_layers(layers),
                                  layers)
    train_tokens = sum(len(e.input_ids) for e in train)
    steps = math.ceil(args.epochs * len(train) / base.train.micro_batch_size)
    print(f"[side-by-side] {len(train)} training conversations ({train_tokens} tokens), "
          f"{len(held_out)} held out; {args.epochs} epochs = {steps} optimizer steps of ours")

    results_path = budget / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    results.update(config=str(args.config), kind=kind, epochs=args.epochs,
                   train_conversations=len(train), held_out_conversations=len(held_out),
                   train_tokens=train_tokens,
                   cpu=cpu_name(), torch_threads=torch.get_num_threads(),
                   variant=args.variant, overrides=args.overrides)
    trained = results.setdefault("trainers", {})

    # ours: the recipe with the budget in epochs, the last step's head kept (peers keep theirs)
    ours = share_stage1(work / "stage1", budget / "ours")
    cfg = load_config(args.config, [f"run.output_dir={ours}",
                                    f"data.max_prompts={args.conversations}",
                                    f"train.max_steps={steps}", "train.keep=last",
                                    "train.freeze_embeddings=true", *args.overrides])
    if "draftsmith" not in trained:
        feature_cache(cfg, target, resolved.fingerprint, data.train + data.held_out, aux_layers,
                      tokenizer.pad_token_id)  # ours, written before its clock starts
        trained["draftsmith"] = train_ours(cfg)
        results.pop("vllm_setting", None)  # a head trained now is measured now
        results_path.write_text(json.dumps(results, indent=2) + "\n")
        if any(peer not in trained for peer in peers):
            # stage 1, the feature cache and ours' training leave ~9 GiB allocated in this
            # process (354 DFlash conversations): a peer's trainer beside it met the OOM killer
            # on 24 GiB. A fresh process finds ours done in results.json and goes on.
            print("[side-by-side] ours trained; the peers go on in a fresh process", flush=True)
            os.execv(sys.executable, [sys.executable, "-m", "benchmarks.side_by_side", *argv])
    bf16 = accelerator_kwargs(cfg)["mixed_precision"] == "bf16"  # as our trainer resolves it

    heads = {"draftsmith": Path(trained["draftsmith"]["folder"])}
    draft_ids = head_vocabulary(heads["draftsmith"]) if kind == "eagle3" else None
    mask_token = head_mask_token(heads["draftsmith"]) if kind == "dflash" else None
    if "specforge" in peers and kind != "eagle3":
        raise ConfigError(f"--peers specforge: the side by side runs SpecForge's EAGLE-3 trainer "
                          f"only; a {KIND_NAMES[kind]} recipe compares with speculators "
                          "(--peers speculators).")
    for peer in peers:
        folder = budget / peer
        if peer not in trained:
            python = peer_python(peer)
            if folder.exists():  # a killed run's: its log and clock would mix with this one's
                print(f"[side-by-side] {peer}: the unfinished run in {folder} is started over")
                shutil.rmtree(folder)
            if peer == "specforge":
                trained[peer] = train_specforge(python, cfg, resolved.path, work, folder, train,
                                                target, aux_layers, draft_ids, args.epochs, bf16)
            else:
                trained[peer] = train_speculators(python, cfg, kind, resolved.path, work, folder,
                                                  train, held_out, target, aux_layers, draft_ids,
                                                  mask_token, args.epochs, bf16)
            results.pop("vllm_setting", None)  # a head trained now is measured now
            results_path.write_text(json.dumps(results, indent=2) + "\n")
        heads[peer] = Path(trained[peer]["folder"])
    if "step_rates" not in trained["draftsmith"]:  # a results.json written before they were
        trained["draftsmith"]["step_rates"] = our_step_rates(RunFolder(ours).train_log)
    for name, found in trained.items():
        if "step_rates" not in found:  # speculators' runs recorded before they were
            found["step_rates"] = speculators_steps(
                (budget / name / "train.log").read_text())["step_rates"]
        found["tokens_per_second"] = found["step_tokens"] / found["step_seconds"]
        found["median_step_tokens_per_second"] = statistics.median(found["step_rates"])

    conversations, _ = load_mtbench()
    prompts = [render(tokenizer, [{"role": "user", "content": c.user_turns[0]}], True)
               for c in conversations[: args.questions]]
    eos = end_of_turn_ids(target, tokenizer)
    setting = {"heads": {name: str(folder) for name, folder in heads.items()},
               "questions": len(prompts), "max_new_tokens": args.max_new_tokens, "k": cfg.eval.k}
    if results.get("vllm_setting") != setting:  # once per trained heads and setting
        print(f"[side-by-side] vLLM: {len(heads)} heads and the target, {len(prompts)} MT-bench "
              f"questions x {args.max_new_tokens} tokens, greedy, k={cfg.eval.k}")
        results["vllm"] = measure(resolved.path, prompts, eos, heads, VLLM_METHOD[kind],
                                  cfg.eval.k, args.max_new_tokens, cache_root() / "vllm")
        results["vllm_setting"] = setting
    results.update(questions=len(prompts), max_new_tokens=args.max_new_tokens, k=cfg.eval.k)
    results_path.write_text(json.dumps(results, indent=2) + "\n")
    table = render_table(results)
    print(settings(kind))
    print(table)
    if args.write_docs:
        write_docs(results, table, argv)
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
    lines = ["| trainer | tau | alpha_1..k | texts = target's | wall time | optimizer steps | "
             "training tokens/s (all steps / median step) |", "|---|---|---|---|---|---|---|"]
    for name, found in results["trainers"].items():
        v = results["vllm"][name]
        alpha = " / ".join(f"{a:.3f}" for a in v["alpha"])
        lines.append(f"| {name} | {v['tau']:.3f} | {alpha} | {v['identical_texts']}/"
                     f"{v['prompts']} | {found['wall_seconds']:.0f} s | "
                     f"{found['optimizer_steps']} | {found['tokens_per_second']:.0f} / "
                     f"{found['median_step_tokens_per_second']:.0f} |")
    return "\n".join(lines)


def write_docs(results: dict, table: str, argv: list[str]) -> None:
    """This run's section of docs/side-by-side.md, in place of the section of the same title
    (a section titled apart, such as "... (ours alone)", is kept beside it). A new doc opens
    with the steps and the settings lists; an existing doc keeps what precedes its first
    section (the summary table across runs is written there by hand)."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True, check=False).stdout.strip()
    doc = ROOT / "docs" / "side-by-side.md"
    section = "\n".join([
        f"## {results['config']}: {results['train_conversations']} training conversations, "
        f"{results['epochs']} epoch{'s' if results['epochs'] != 1 else ''}"
        + (f", {results['variant']} ({' '.join(results['overrides'])})"
           if results.get("variant") else ""), "",
        f"{results['cpu']}; {results['torch_threads']} torch threads; commit {commit}; "
        f"`.venv/bin/python -m benchmarks.side_by_side {' '.join(argv)}`. vLLM (CPU, fp32), "
        f"{results['questions']} MT-bench first turns x {results['max_new_tokens']} tokens, "
        f"greedy, k={results['k']}.", "", table, ""])
    if doc.is_file():
        head, *sections = doc.read_text().split("\n## ")
    else:
        head = "# Side by side with the field's trainers\n\n" + __doc__.split("\n\n", 2)[2]
        head += "".join(f"\n{settings(kind)}" for kind in MATCHED)
        sections = []
    title = section.split("\n", 1)[0][3:]
    kept = [s for s in sections if s.split("\n", 1)[0] != title]
    doc.write_text(head + "".join("\n## " + s for s in kept) + "\n" + section)


if __name__ == "__main__":
    raise SystemExit(main())
