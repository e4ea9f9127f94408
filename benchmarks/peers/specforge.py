"""SpecForge's EAGLE-3 trainer beside ours: its data (one .ckpt per training conversation with
the aux features and the last hidden state after the final norm), its target folder, its run,
its step clock and checkpoints, and the settings matched and not matched with ours."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from benchmarks.peers import SHARED_TAIL, layer_features, run_peer

# SpecForge's EAGLE-3 trainer beside ours (with the shared items above)
SPECFORGE_MATCHED = [
    "stage-1 conversations, their train / held-out split (by id) and truncation to max_seq_len",
    "target features: one transformers forward, fp32; the aux features in the draft's dtype, "
    "the last hidden state after the final norm in bf16 (its target head's fixed dtype)",
    "one decoder layer over the aux layers of the recipe; the same d2t / t2d",
    "training-time test: the recipe's train.eagle3.ttt_steps, step j weighted 0.8**j "
    "(SpecForge's fixed weight; the side by side refuses another train.position_decay)",
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
    if abs(t.position_decay - 0.8) > 1e-9:
        raise ValueError(f"train.position_decay is {t.position_decay}: SpecForge weighs TTT "
                         "step j by 0.8**j and has no setting for it; compare at "
                         "train.position_decay=0.8")
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
                     "ttt_length": t.eagle3.ttt_steps, "attention_backend": "sdpa",
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
