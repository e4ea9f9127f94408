"""The training loop on a tiny target: the loss falls, resume is exact, bad input is refused."""

from __future__ import annotations

import json
import re
import shutil
import time
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator

from recipe import ConfigError, load_config
from runfolder import train_record
from tests.helpers import (
    EAGLE3,
    ROOT,
    accelerate_launch,
    kill_process_tree,
    reset_accelerate,
    tensorboard_scalars,
    tiny_llama,
    wandb_history,
)
from train import TrainingDiverged, accelerator_kwargs, train_draft
from train.data import checkpoint_name


def _train(cfg):
    return train_draft(cfg, Accelerator(**accelerator_kwargs(cfg)))


def _log(out) -> list[dict]:
    return [json.loads(line) for line in (out / "train" / "log.jsonl").read_text().splitlines()]


def _losses(out, key: str = "loss") -> dict[int, float]:
    return {e["optimizer_step"]: e[key] for e in _log(out) if key in e}


def test_a_fresh_tiny_draft_learns_the_target(tiny_run):
    cfg = tiny_run("train.draft=fresh:1", "train.loss=fkl")
    summary = _train(cfg)
    losses = _losses(cfg.run.output_path)
    assert list(losses) == [1, 2, 3, 4, 5, 6]
    assert losses[6] < 0.8 * losses[1]
    assert summary.after["loss"] < 0.8 * summary.before["loss"]
    assert summary.after["tau"] > summary.before["tau"]
    assert (cfg.run.output_path / "train" / "draft" / "config.yaml").is_file()
    draft_config = json.loads((summary.draft_dir / "config.json").read_text())
    assert draft_config["num_hidden_layers"] == 1


def test_a_draft_vocabulary_trains_and_serves_the_most_frequent_labels_alone(tiny_run, capsys):
    from assets.target import load_target, load_tokenizer, resolve_target
    from drafts import engine_draft, load_draft
    from drafts.vocabulary import frequent_labels
    from train.data import load_stage1

    cfg = tiny_run("train.draft_vocab_size=512", "train.loss=fkl")
    summary = _train(cfg)
    printed = capsys.readouterr().out
    assert "the draft vocabulary (512 tokens) holds" in printed and "held-out labels" in printed
    losses = _losses(cfg.run.output_path)  # against the target renormalised on the 512
    assert losses[6] < 0.8 * losses[1]
    # the tiny random target spreads ~99 % of its mass over the other 48,640 tokens, which the
    # draft never proposes: sampled acceptance is that small, its argmax always inside
    assert summary.after["tau"] < 1.05 and summary.after["greedy_tau"] == 4.0
    ids = json.loads((summary.draft_dir / "config.json").read_text())["draft_vocabulary"]
    resolved = resolve_target(cfg.model)
    target = load_target(resolved, "float32", torch.device("cpu"))
    vocab = target.config.vocab_size
    data = load_stage1(cfg, resolved.fingerprint)
    assert ids == frequent_labels(data.train, vocab, 512)[0].tolist()
    loaded = load_draft(str(summary.draft_dir), target, load_tokenizer(resolved, {}),
                        torch.float32, torch.device("cpu"))
    draft = engine_draft(loaded)
    assert draft.vocabulary.ids.tolist() == ids and "draft vocabulary 512" in loaded.name
    assert draft.lm.head.weight.shape == (512, target.config.hidden_size)


RESUMED = {  # every path whose state a checkpoint must carry (Medusa: tests/train/test_models.py)
    "independent": ("train.loss=0.5*fkl+0.5*tvd",),
    "on-policy": ("train.on_policy_fraction=0.5", "train.on_policy_max_new_tokens=8"),
    "eagle3-online": EAGLE3,
    "eagle3-offline": (*EAGLE3, "train.target_features=offline"),
    "lora": ("train.lora_rank=4", "train.loss=fkl"),
}


@pytest.mark.parametrize("case", list(RESUMED))
def test_resume_from_a_checkpoint_reproduces_the_uninterrupted_run(tiny_run, tmp_path, case):
    # the last step's draft (the best one survives a kill: tests/train/test_best_draft.py); a
    # real SIGKILL of the stage's process: test_sigkill_mid_run_then_the_same_command_resumes
    overrides = (*RESUMED[case], "train.keep=last")
    cfg = tiny_run(*overrides)
    _train(cfg)
    full = _losses(cfg.run.output_path)
    full_after = train_record(cfg.run.output_path / "train" / "draft")["after"]
    # what a kill right after the step-3 checkpoint leaves behind
    killed = tmp_path / "killed"
    shutil.copytree(cfg.run.output_path, killed)
    shutil.rmtree(killed / "train" / "draft")
    shutil.rmtree(killed / "train" / "checkpoints" / checkpoint_name(6))
    resumed_cfg = tiny_run(*overrides, f"run.output_dir={killed}")
    summary = _train(resumed_cfg)
    assert summary.resumed_from == 3
    resumed = _losses(killed)
    assert list(resumed) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):  # exact: the same process, kernels and checkpointed state
        assert resumed[step] == full[step], (step, resumed[step], full[step])
    assert summary.after == full_after


def test_resume_with_another_config_is_refused(tiny_run):
    cfg = tiny_run("train.max_steps=3", "train.warmup_steps=1")
    _train(cfg)
    shutil.rmtree(cfg.run.output_path / "train" / "draft")
    with pytest.raises(ConfigError, match="train.learning_rate"):
        _train(tiny_run("train.max_steps=3", "train.warmup_steps=1", "train.learning_rate=1e-2"))
    # logging-only settings may change
    summary = _train(tiny_run("train.max_steps=3", "train.warmup_steps=1", "train.eval_every=1"))
    assert summary.resumed_from == 3


def test_resume_with_another_number_of_processes_is_refused_naming_the_launch(tiny_run):
    cfg = tiny_run("train.max_steps=3", "train.warmup_steps=1")
    _train(cfg)
    checkpoint = cfg.run.output_path / "train" / "checkpoints" / checkpoint_name(3)
    assert json.loads((checkpoint / "launch.json").read_text()) == {"processes": 1}
    shutil.rmtree(cfg.run.output_path / "train" / "draft")
    (checkpoint / "launch.json").write_text('{"processes": 2}')  # as a 2-process launch leaves
    with pytest.raises(ConfigError, match=r"written by 2 training processes and this launch has "
                                          r"1: .*--num_processes 2"):
        _train(cfg)


def test_nan_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(tiny_run, monkeypatch):
    import train.loop

    calls = {"n": 0}
    real = train.loop.divergence

    def poisoned(*args, **kwargs):
        value = real(*args, **kwargs)
        if not torch.is_grad_enabled():  # held-out evaluation
            return value
        calls["n"] += 1  # training micro_steps: 1-2 are optimizer_step 1, 3-4 optimizer_step 2
        return value * float("nan") if calls["n"] == 4 else value

    monkeypatch.setattr(train.loop, "divergence", poisoned)
    cfg = tiny_run("train.save_every=1", "train.eval_every=100")
    with pytest.raises(TrainingDiverged, match=r"optimizer_step 2 micro_step 1 .*step-00000001"):
        _train(cfg)
    checkpoints = sorted(p.name for p in (cfg.run.output_path / "train" / "checkpoints").iterdir())
    assert checkpoints == [checkpoint_name(1)]
    assert not (cfg.run.output_path / "train" / "draft").exists()


def test_a_draft_with_another_vocabulary_is_rejected(tiny_run, tmp_path):

    folder = tmp_path / "other_vocab"
    tiny_llama(1000, layers=1, hidden=32, heads=2, kv_heads=1).save_pretrained(folder)
    with pytest.raises(ConfigError, match="vocabulary has 1000 tokens"):
        _train(tiny_run(f"train.draft={folder}"))


def test_data_from_another_target_is_rejected(tiny_run):
    cfg = tiny_run()
    manifest_path = cfg.run.output_path / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["identity"]["target"]["fingerprint"] = "folder-sha256:0000"
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match="written by target"):
        _train(cfg)


def test_gpu_only_options_are_refused_on_cpu(tiny_run):
    from train.loop import _configure_deepspeed

    with pytest.raises(ConfigError, match="fp16 needs a GPU"):
        accelerator_kwargs(tiny_run("train.mixed_precision=fp16"))
    plugin = SimpleNamespace(deepspeed_config={
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    fake = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin),
                           device=torch.device("cpu"))
    with pytest.raises(ConfigError, match="offload_optimizer"):
        _configure_deepspeed(fake, tiny_run().train)


def test_on_policy_batches_are_sampled_by_the_draft(tiny_run):
    cfg = tiny_run("train.on_policy_fraction=1.0", "train.on_policy_max_new_tokens=8",
                   "train.max_steps=2", "train.warmup_steps=0", "train.mixed_precision=auto")
    _train(cfg)
    steps = [e for e in _log(cfg.run.output_path) if "loss" in e]
    assert [e["on_policy_micro_batches"] for e in steps] == [2, 2]
    assert all(e["loss_tokens"] <= 2 * 2 * 8 * e["optimizer_step"] for e in steps)


def test_topk_targets_lora_and_a_narrow_fresh_draft_train(tiny_run):
    from transformers import AutoModelForCausalLM

    topk = tiny_run("train.target_logits=topk", "train.loss=fkl", "train.max_steps=2",
                    "train.warmup_steps=0", "train.draft=fresh:1x32")
    summary = _train(topk)
    assert all(torch.isfinite(torch.tensor(e["loss"])) for e in summary.history if "loss" in e)
    assert json.loads((summary.draft_dir / "config.json").read_text())["hidden_size"] == 32
    shutil.rmtree(topk.run.output_path / "train")

    lora = tiny_run("train.lora_rank=4", "train.max_steps=2", "train.warmup_steps=0")
    summary = _train(lora)
    draft = AutoModelForCausalLM.from_pretrained(summary.draft_dir)  # merged: a plain model
    assert not any("lora" in name for name, _ in draft.named_parameters())


@pytest.mark.parametrize("tracker", ["tensorboard", "wandb"])
def test_trackers_write_offline(tiny_run, tracker):
    cfg = tiny_run(f"tracking.tracker={tracker}", "train.max_steps=2", "train.warmup_steps=0")
    _train(cfg)
    out = cfg.run.output_path / "train"
    logged = {e["optimizer_step"]: e["loss"] for e in _log(cfg.run.output_path) if "loss" in e}
    assert sorted(logged) == [1, 2]
    if tracker == "tensorboard":
        read = tensorboard_scalars(out, "loss")
    else:
        runs = list((out / "wandb").glob("offline-run-*/*.wandb"))
        assert len(runs) == 1, runs
        read = {row["_step"]: row["loss"] for row in wandb_history(runs[0]) if "loss" in row}
    assert read.keys() == logged.keys()
    for step, loss in logged.items():  # tensorboard stores float32
        assert read[step] == pytest.approx(loss, rel=1e-6), step


KILLED_RUNS = {  # one process, and the launches whose processes each hold a shard of the state
    "independent": (),
    "fsdp-2-processes": (*EAGLE3, "train.gradient_accumulation_steps=4"),
    "zero3-2-processes": (*EAGLE3, "train.gradient_accumulation_steps=4"),
}
LAUNCH = {"fsdp-2-processes": "fsdp-cpu.yaml", "zero3-2-processes": "deepspeed-zero3-cpu.yaml"}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(KILLED_RUNS))
def test_sigkill_mid_run_then_the_same_command_resumes_to_the_same_curve(tiny_run, tmp_path,
                                                                          case):
    """The pipeline's train stage in its own process, SIGKILLed (with every process it started)
    once checkpoints exist, then the same command again: the loss curve and gradient norms of
    the uninterrupted run. The sharded launches (an EAGLE-3 head, 2 processes x 2 micro_steps
    against 1 x 4) are also tests/train/test_distributed.py's 2-processes-match-one for FSDP2
    and ZeRO-3."""
    import subprocess
    import sys
    import time

    overrides = ["train.max_steps=24", "train.save_every=1", "train.eval_every=100",
                 "train.warmup_steps=2", *KILLED_RUNS[case]]
    reference = tiny_run(*overrides)
    _train(reference)
    expected = _losses(reference.run.output_path)
    expected_norms = _losses(reference.run.output_path, "grad_norm")

    killed = tmp_path / "killed"
    shutil.copytree(reference.run.output_path, killed,
                    ignore=shutil.ignore_patterns("train", "features"))  # the stage-1 data only
    root = ROOT
    launcher = [sys.executable]
    if case in LAUNCH:  # 2 processes x 2 micro_steps = 1 x 4 micro_steps
        overrides = [*overrides, "train.gradient_accumulation_steps=2"]
        launcher = accelerate_launch(LAUNCH[case])
    cfg = tiny_run(*overrides, f"run.output_dir={killed}")
    command = [*launcher, str(root / "distill.py"), "--config",
               str(root / "configs" / "smollm2-135m-independent.yaml"), "--stage", "train",
               *[f"{section}.{key}="
                 f"{json.dumps(value) if isinstance(value, (list, dict)) else value}"
                 for section, values in cfg.to_dict().items() for key, value in values.items()
                 if section in ("run", "model", "train", "eval") and value is not None]]
    process = subprocess.Popen(command, cwd=root, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    checkpoints = killed / "train" / "checkpoints"
    deadline = time.monotonic() + 300
    while not (checkpoints / checkpoint_name(2)).is_dir():
        assert process.poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.005)
    kill_process_tree(process.pid)  # torchrun's workers included
    process.wait()
    assert not (killed / "train" / "draft").exists()  # killed mid-run, not after it
    last = max(int(p.name.split("-")[1]) for p in checkpoints.glob("step-*"))
    assert last < 24

    resumed = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=600,
                             check=False)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from {checkpoints / checkpoint_name(last)}" in resumed.stdout
    losses, norms = _losses(killed), _losses(killed, "grad_norm")
    assert list(losses) == list(range(1, 25)) and list(norms) == list(range(1, 25))
    for step in range(1, 25):
        assert losses[step] == pytest.approx(expected[step], abs=1e-4), step
        # before clipping: a wrong cross-process gradient scale shows here, not in the loss
        assert norms[step] == pytest.approx(expected_norms[step], rel=1e-3), step


def test_the_target_as_its_own_draft_is_predicted_to_reach_k_plus_one(tiny_run):
    from assets.target import load_target, load_tokenizer, resolve_target
    from drafts.independent import DraftForTraining
    from train.data import held_out_batches, load_stage1
    from train.loop import evaluate_held_out

    cfg = tiny_run()
    resolved = resolve_target(cfg.model)
    target = load_target(resolved, "float32", torch.device("cpu"))
    data = load_stage1(cfg, resolved.fingerprint)
    batches = held_out_batches(data, cfg, load_tokenizer(resolved).pad_token_id)
    result = evaluate_held_out(DraftForTraining(target), target, batches, cfg.train,
                               torch.device("cpu"))
    assert result["tau"] == pytest.approx(cfg.train.eval_k + 1, abs=1e-4)
    assert result["greedy_tau"] == cfg.train.eval_k + 1
    assert result["loss"] == pytest.approx(0.0, abs=1e-5)



@pytest.mark.parametrize("features", ["online", "offline"])
def test_an_eagle3_head_learns_the_target(tiny_run, features):
    cfg = tiny_run(*EAGLE3, f"train.target_features={features}")
    began = time.perf_counter()
    summary = _train(cfg)
    wall = time.perf_counter() - began
    losses = _losses(cfg.run.output_path)
    assert losses[6] < 0.8 * losses[1]
    assert summary.after["loss"] < summary.before["loss"]
    assert len(summary.after["alpha"]) == 3
    assert summary.after["walk_tau"] is not None  # a head scores every start: a walk
    head_config = json.loads((summary.draft_dir / "config.json").read_text())
    assert head_config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert head_config["draft_vocab_size"] == 1024
    cache = cfg.run.output_path / "features"
    assert (cache / "manifest.json").is_file() == (features == "offline")
    if features == "offline":  # the dump's own seconds, within the run's
        assert 0 < json.loads((cache / "manifest.json").read_text())["dump_seconds"] < wall


def test_an_interrupted_feature_dump_keeps_its_seconds_and_the_resume_adds_its_own(tiny_run,
                                                                                   monkeypatch):
    import safetensors.torch

    monkeypatch.setattr("train.features.SHARD_SIZE", 4)
    save_file, calls = safetensors.torch.save_file, []

    def killed_at_the_third_shard(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 3:
            raise KeyboardInterrupt
        return save_file(*args, **kwargs)

    monkeypatch.setattr("safetensors.torch.save_file", killed_at_the_third_shard)
    cfg = tiny_run(*EAGLE3, "train.target_features=offline", "train.max_steps=2",
                   "train.save_every=2", "train.eval_every=2")
    with pytest.raises(KeyboardInterrupt):
        _train(cfg)
    cache = cfg.run.output_path / "features"
    assert len(list(cache.glob("features-*.safetensors"))) == 2
    first = json.loads((cache / "manifest.json").read_text())["dump_seconds"]
    assert first > 0  # the two shards' seconds survive the kill

    monkeypatch.setattr("safetensors.torch.save_file", save_file)
    began = time.perf_counter()
    _train(cfg)
    wall = time.perf_counter() - began
    shards = len(list(cache.glob("features-*.safetensors")))
    assert shards > 2
    total = json.loads((cache / "manifest.json").read_text())["dump_seconds"]
    assert first < total < first + wall  # the resume's seconds added, no shard counted twice


def test_feature_noise_and_the_target_init_train(tiny_run):
    cfg = tiny_run(*EAGLE3, "train.feature_noise=0.2", "train.head_init=target",
                   "train.max_steps=3", "train.save_every=3", "train.eval_every=3")
    summary = _train(cfg)
    assert all(torch.isfinite(torch.tensor(v)) for v in _losses(cfg.run.output_path).values())
    assert summary.after["loss"] < summary.before["loss"]


def test_cached_features_for_other_layers_are_refused(tiny_run):
    cfg = tiny_run(*EAGLE3, "train.target_features=offline", "train.max_steps=2",
                   "train.save_every=2", "train.eval_every=2")
    _train(cfg)
    shutil.rmtree(cfg.run.output_path / "train")  # a new head, on the old features folder
    with pytest.raises(ConfigError, match=r"aux_layers: cached \[0, 1, 1\], now \[0, 0, 1\]"):
        _train(tiny_run(*EAGLE3, "train.target_features=offline", "train.max_steps=2",
                        "train.aux_layers=[0,0,1]"))


def test_features_that_would_not_fit_on_the_disk_are_refused_before_writing(tiny_run,
                                                                            monkeypatch):
    usage = shutil.disk_usage("/")
    monkeypatch.setattr("recipe.disk.shutil.disk_usage",
                        lambda path: usage._replace(free=1000))
    cfg = tiny_run(*EAGLE3, "train.target_features=offline", "train.max_steps=2")
    with pytest.raises(ConfigError, match=r"offline features .* needs about .* GiB .* only "
                                          r"0.00 GiB is free .*target_features=online"):
        _train(cfg)
    assert not (cfg.run.output_path / "features").exists()  # nothing written


@pytest.mark.parametrize(("override", "message"), [
    ("train.aux_layers=[0,1,2]", r"must lie in \[0, 1\]"),
    ("train.draft_vocab_size=49153", "larger than the target's vocabulary"),
])
def test_eagle3_bad_input_is_refused(tiny_run, override, message):
    with pytest.raises(ConfigError, match=message):
        _train(tiny_run(*EAGLE3, override))


@pytest.mark.parametrize("kind", [
    ("train.draft=dflash", "train.aux_layers=[1]", "train.block_size=3", "train.loss=fkl"),
    ("train.draft=pard:layer-truncated:1", "train.block_size=3", "train.block_starts=4",
     "train.loss=fkl"),
    ("train.draft=dspark", "train.aux_layers=[1]", "train.block_size=3", "train.loss=fkl",
     "train.dspark.markov_rank=16"),
], ids=["dflash", "pard", "dspark"])
def test_a_parallel_drafter_learns_the_target(tiny_run, kind):
    cfg = tiny_run(*kind)
    summary = _train(cfg)
    losses = _losses(cfg.run.output_path)
    assert losses[6] < 0.8 * losses[1]
    assert summary.after["loss"] < summary.before["loss"]
    assert summary.after["tau"] > summary.before["tau"]
    assert len(summary.after["alpha"]) == 3
    # every block start scored (dflash) gives a walk; 4 random starts per conversation (pard) not
    assert (summary.after["walk_tau"] is None) == ("train.block_starts=4" in kind)
    saved = json.loads((summary.draft_dir / "config.json").read_text())
    if "dflash" in kind[0] or "dspark" in kind[0]:
        assert saved["architectures"] == [
            "DFlashDraftModel" if "dflash" in kind[0] else "Qwen3DSparkModel"]
        assert saved["dflash_config"] == {"mask_token_id": 16, "target_layer_ids": [0]}
    else:
        assert saved["pard_token"] == 16 and saved["pard_trained_k"] == 3


def test_max_conversations_trains_on_a_nested_subset_and_refuses_more_than_there_is(tiny_run):
    from train.data import load_stage1

    fingerprint = json.loads((tiny_run().run.output_path / "manifest.json").read_text())[
        "identity"]["target"]["fingerprint"]
    every = load_stage1(tiny_run(), fingerprint).train
    four = load_stage1(tiny_run("train.max_conversations=4"), fingerprint).train
    assert [e.id for e in four] == [e.id for e in every[:4]] and len(every) > 4
    with pytest.raises(ConfigError, match=f"holds {len(every)} training conversations"):
        load_stage1(tiny_run(f"train.max_conversations={len(every) + 1}"), fingerprint)
    with pytest.raises(ConfigError, match="must be >= train.micro_batch_size"):
        tiny_run("train.max_conversations=1")


def test_training_shows_its_progress_resumes_its_wandb_run_and_draws_its_curve(
        tiny_run, tmp_path, capsys):
    overrides = ("tracking.tracker=wandb", "tracking.wandb_mode=offline", "tracking.group=arms",
                 "tracking.tags=[tiny,resumed]", "tracking.progress_every_s=0.001",
                 "train.keep=last")
    cfg = tiny_run(*overrides)
    _train(cfg)
    err = capsys.readouterr().err
    assert re.search(r"\[train\] optimizer_step 6/6 \(100 %\): loss \d+\.\d+, \d+ tokens/s, "
                     r"ETA 0 s", err), err[-2000:]
    out = cfg.run.output_path
    assert (out / "train" / "curve.png").stat().st_size > 10_000
    killed = tmp_path / "killed"  # what a kill right after the step-3 checkpoint leaves behind
    shutil.copytree(out, killed)
    shutil.rmtree(killed / "train" / "draft")
    shutil.rmtree(killed / "train" / "checkpoints" / checkpoint_name(6))
    time.sleep(1.1)  # W&B names an offline run's folder by the second it starts
    assert _train(tiny_run(*overrides, f"run.output_dir={killed}")).resumed_from == 3
    assert "optimizer_step 4/6" in capsys.readouterr().err  # the ETA counts from the resume
    runs = sorted((killed / "train" / "wandb").glob("offline-run-*"))
    run_id = (killed / "train" / "wandb-run-id").read_text().strip()
    assert len(runs) == 2 and all(r.name.endswith(f"-{run_id}") for r in runs)
    resumed = {row["_step"] for row in wandb_history(next(runs[1].glob("*.wandb")))
               if "loss" in row}
    assert resumed == {4, 5, 6}


def test_wandb_mode_is_the_recipes_else_the_environments_else_offline(monkeypatch):
    from train.watch import wandb_mode

    monkeypatch.setenv("WANDB_MODE", "online")
    assert wandb_mode(load_config(None, [])) == "online"
    assert wandb_mode(load_config(None, ["tracking.wandb_mode=offline"])) == "offline"
    monkeypatch.delenv("WANDB_MODE")
    assert wandb_mode(load_config(None, [])) == "offline"


def test_the_eta_and_its_clock():
    from train.watch import clock, eta_seconds

    assert eta_seconds(3, 6, 3, 10.0) is None  # nothing done in this invocation yet
    assert eta_seconds(5, 10, 3, 20.0) == 50.0  # 2 steps in 20 s, 5 to go
    assert [clock(s) for s in (None, 12, 245, 3720)] == ["?", "12 s", "4 min 05 s",
                                                         "1 h 02 min"]


def test_sigterm_saves_a_checkpoint_and_the_same_command_resumes_to_the_same_curve(
        tiny_run, tmp_path, monkeypatch):
    """A scheduler's SIGTERM mid-run: the step under way finishes, a checkpoint is saved at it
    (between save_every's), training stops; the same command then ends on the uninterrupted
    curve."""
    import os
    import signal

    from train import Stopped
    from train.watch import Progress

    overrides = ("train.max_steps=6", "train.save_every=100", "train.eval_every=100",
                 "train.keep=last")
    reference = tiny_run(*overrides)
    _train(reference)
    expected = _losses(reference.run.output_path)
    stopped = tmp_path / "stopped"
    shutil.copytree(reference.run.output_path, stopped,
                    ignore=shutil.ignore_patterns("train"))  # the stage-1 data (and features)
    cfg = tiny_run(*overrides, f"run.output_dir={stopped}")
    update = Progress.update

    def terminated_at_step_3(self, entry):
        update(self, entry)
        if entry["optimizer_step"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(Progress, "update", terminated_at_step_3)
    with pytest.raises(Stopped, match="after optimizer_step 3 .*step-00000003.*resumes"):
        _train(cfg)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored
    assert not (stopped / "train" / "draft").exists()
    monkeypatch.setattr(Progress, "update", update)
    assert _train(cfg).resumed_from == 3
    losses = _losses(stopped)
    assert list(losses) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):
        assert losses[step] == pytest.approx(expected[step], abs=1e-4), step


@pytest.mark.slow
def test_a_2_process_launch_shows_progress_stops_on_sigterm_and_resumes_its_wandb_run(
        tiny_run, tmp_path):
    """accelerate launch with 2 processes (gloo): the main process alone prints the progress
    line with its ETA; a SIGTERM to the launcher (a scheduler's preemption) makes every process
    save at the same step and stop; the same command then finishes the uninterrupted curve,
    logged into the same W&B run (offline files), with its curve drawn."""
    import signal
    import subprocess

    overrides = ["train.max_steps=40", "train.save_every=100", "train.eval_every=100",
                 "train.warmup_steps=2", "train.gradient_accumulation_steps=2",
                 "tracking.tracker=wandb", "tracking.wandb_mode=offline",
                 "tracking.progress_every_s=0.001"]
    reference = tiny_run(*overrides[:5], "train.gradient_accumulation_steps=4")
    _train(reference)  # 1 process x 4 micro_steps = 2 processes x 2
    expected = _losses(reference.run.output_path)
    out = tmp_path / "launched"
    shutil.copytree(reference.run.output_path, out, ignore=shutil.ignore_patterns("train"))
    cfg = tiny_run(*overrides, f"run.output_dir={out}")
    command = [*accelerate_launch("ddp-cpu.yaml"), str(ROOT / "distill.py"), "--config",
               str(ROOT / "configs" / "smollm2-135m-independent.yaml"), "--stage", "train",
               *[f"{section}.{key}="
                 f"{json.dumps(value) if isinstance(value, (list, dict)) else value}"
                 for section, values in cfg.to_dict().items() for key, value in values.items()
                 if section in ("run", "model", "train", "eval", "tracking")
                 and value is not None]]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    log = out / "train" / "log.jsonl"
    deadline = time.monotonic() + 300
    while not (log.is_file() and sum(1 for _ in log.open()) >= 6):
        assert process.poll() is None and time.monotonic() < deadline, "no steps logged"
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    printed = process.communicate(timeout=120)[0]
    assert process.returncode != 0 and "SIGTERM: stopped after optimizer_step" in printed
    stopped_at = max(int(p.name.split("-")[1]) for p in (out / "train" / "checkpoints")
                     .glob("step-*"))
    assert 5 <= stopped_at < 40 and not (out / "train" / "draft").exists()
    progress = re.findall(r"\[train\] optimizer_step (\d+)/40 .*ETA", printed)
    assert progress and len(progress) == len(set(progress))  # the main process alone

    resumed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                             check=False)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "optimizer_step 40/40 (100 %)" in resumed.stdout + resumed.stderr
    losses = _losses(out)
    assert list(losses) == list(range(1, 41))
    for step in range(1, 41):
        assert losses[step] == pytest.approx(expected[step], abs=1e-4), step
    run_id = (out / "train" / "wandb-run-id").read_text().strip()
    runs = sorted((out / "train" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(f"-{run_id}") for r in runs)
    assert (out / "train" / "curve.png").is_file()


def test_a_log_cut_short_by_a_kill_resumes_and_a_damaged_one_is_named(tmp_path):
    from train.loop import read_log

    log = tmp_path / "log.jsonl"
    log.write_text('{"optimizer_step": 1, "loss": 2.0}\n{"optimizer_step": 2, "lo')
    notes = []
    assert read_log(log, notes.append) == [{"optimizer_step": 1, "loss": 2.0}]
    assert "cut short" in notes[0]
    log.write_text('{"optimizer_step": 1}\nnot json\n{"optimizer_step": 3}\n')
    with pytest.raises(ConfigError, match="line 2 is not JSON"):
        read_log(log)


def test_a_checkpoint_the_disk_cannot_hold_stops_the_run_before_writing_it(tiny_run,
                                                                           monkeypatch):
    """Free disk is checked before each checkpoint (the next one the size of the last): the run
    stops naming the fix, with the checkpoints already written intact, and resumes."""
    from collections import namedtuple

    import recipe.disk

    cfg = tiny_run("train.max_steps=4", "train.save_every=2")
    real = recipe.disk.shutil.disk_usage
    calls = []

    def full_after_one(path):  # room for the first checkpoint only
        calls.append(path)
        usage = namedtuple("usage", "total used free")
        return usage(1, 1, 0) if len(calls) > 1 else real(path)

    monkeypatch.setattr(recipe.disk.shutil, "disk_usage", full_after_one)
    with pytest.raises(ConfigError, match=r"the checkpoint after optimizer_step 4 needs about "
                                          r".* resumes from .*step-0*2"):
        train_draft(cfg, Accelerator(**accelerator_kwargs(cfg)))
    monkeypatch.setattr(recipe.disk.shutil, "disk_usage", real)
    reset_accelerate()
    summary = train_draft(cfg, Accelerator(**accelerator_kwargs(cfg)))
    assert summary.resumed_from == 2 and summary.optimizer_steps == 4
