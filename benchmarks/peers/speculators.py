"""speculators' EAGLE-3 and DFlash trainers beside ours: its data (a dataset of input_ids,
loss_mask and seq_len with the training rows first, and hidden_states/hs_<i>.safetensors of the
aux layers and the last hidden state before the final norm), its flags, its log and checkpoints,
and the settings matched and not matched with ours."""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

import torch

from benchmarks.peers import SHARED_MATCHED, SHARED_TAIL, SHARED_UNMATCHED, layer_features, run_peer

MATCHED = {
    "eagle3": SHARED_MATCHED + [
        "one decoder layer over the aux layers of the recipe (vLLM's default ids)",
        "draft vocabulary: the same d2t / t2d (the recipe's size, most frequent training labels)",
        "training-time test: the recipe's train.eagle3.ttt_steps, step j weighted "
        "position_decay**j",
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
        "position_decay**(j-1) (speculators' kl_div with fixed-exp-decay, gamma = "
        "-1 / ln(position_decay))",
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
                  "--ttt-steps", str(t.eagle3.ttt_steps),
                  "--ttt-step-loss-decay", str(t.position_decay)]
    elif kind == "dflash":
        from drafts.dflash import parse_layers

        layers = parse_layers(t.draft)
        flags += ["--num-layers", str(layers), "--draft-arch", "qwen3",
                  # full attention: non-causal inside the block, as ours and vLLM's DFlash
                  "--full-attention-indices", *[str(i) for i in range(layers)],
                  "--block-size", str(t.block_size + 1), "--mask-token-id", str(mask_token_id),
                  "--max-anchors", str(tokens_per_step),
                  "--loss-fn", "kl_div", "--per-position-loss-weight", "fixed-exp-decay",
                  "--dflash-decay-gamma", f"{-1 / math.log(t.position_decay):.6f}"]
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
