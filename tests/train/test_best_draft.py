"""train.keep=best: train/draft holds the draft of the held-out evaluation with the highest
best_by (after an optimizer step), train/last the last step's when it is another, and an
interrupted run keeps the best it had found. Held-out figures are scripted (the real ones are
computed, then best_by is replaced) so that the best is not the last."""

import json

import pytest
from accelerate import Accelerator
from safetensors.torch import load_file

import train.loop as loop
from runfolder import TRAIN_RECORD
from runfolder.provenance import hardware, source_commit
from train import accelerator_kwargs, train_draft


def _train(cfg):
    return train_draft(cfg, Accelerator(**accelerator_kwargs(cfg)))


@pytest.fixture
def scripted(monkeypatch):
    """-> (the greedy_tau values the next held-out evaluations report, in order; the draft's
    weights at each evaluation, appended as they happen)."""
    values, weights = [], []
    real = loop.evaluate_held_out

    def evaluate(model, *args, **kwargs):
        result = real(model, *args, **kwargs)
        weights.append({k: v.detach().clone()
                        for k, v in loop._unwrap(model).lm.state_dict().items()})
        return {**result, "greedy_tau": values.pop(0)}

    monkeypatch.setattr(loop, "evaluate_held_out", evaluate)
    return values, weights


def _record(folder) -> dict:
    return json.loads((folder / TRAIN_RECORD).read_text())


def test_the_best_evaluation_is_kept_and_the_last_step_beside_it(tiny_run, scripted):
    values, weights = scripted
    values += [1.0, 2.0, 1.5]  # optimizer_step 0 (never kept), 3, 6
    cfg = tiny_run()
    summary = _train(cfg)
    train = cfg.run.output_path / "train"
    kept, last = _record(train / "draft"), _record(train / "last")
    assert kept["kept"]["optimizer_step"] == 3 and kept["optimizer_steps"] == 3
    assert kept["kept"]["last_optimizer_step"] == 6 and last["optimizer_steps"] == 6
    assert summary.after["greedy_tau"] == 2.0 and kept["kept"]["last"]["greedy_tau"] == 1.5
    assert not (train / "best").exists()
    # each record names the code and hardware that trained it
    assert kept["commit"] == last["commit"] == source_commit() and kept["hardware"] == hardware()
    saved = load_file(str(train / "draft" / "model.safetensors"))
    at_step_3 = weights[1]
    assert all(saved[name].equal(at_step_3[name]) for name in saved)
    at_the_end = load_file(str(train / "last" / "model.safetensors"))
    assert any(not at_the_end[name].equal(saved[name]) for name in saved)


def test_keep_last_takes_the_last_step(tiny_run, scripted):
    values, _ = scripted
    values += [1.0, 2.0, 1.5]
    cfg = tiny_run("train.keep=last")
    _train(cfg)
    train = cfg.run.output_path / "train"
    assert _record(train / "draft")["optimizer_steps"] == 6 and "kept" not in _record(
        train / "draft")
    assert not (train / "last").exists() and not (train / "best").exists()


def test_an_interrupted_run_keeps_the_best_it_had_found(tiny_run, scripted, monkeypatch):
    values, _ = scripted
    values += [1.0, 2.0]  # the evaluations before the interruption: step 0 and step 3
    real_save = loop._save_checkpoint

    def save_then_stop(accelerator, dist, state, cfg):
        real_save(accelerator, dist, state, cfg)
        if state.optimizer_step == 3:
            raise KeyboardInterrupt  # a kill right after the step-3 checkpoint

    monkeypatch.setattr(loop, "_save_checkpoint", save_then_stop)
    cfg = tiny_run()
    with pytest.raises(KeyboardInterrupt):
        _train(cfg)
    train = cfg.run.output_path / "train"
    assert _record(train / "best")["optimizer_steps"] == 3
    monkeypatch.setattr(loop, "_save_checkpoint", real_save)
    values += [1.5]  # step 6, after the resume
    summary = _train(cfg)
    assert summary.resumed_from == 3
    assert _record(train / "draft")["kept"]["optimizer_step"] == 3
    assert _record(train / "last")["optimizer_steps"] == 6


def test_best_by_walk_tau_keeps_the_walks_best(tiny_run, monkeypatch):
    """train.best_by=walk_tau picks by the engine-realised figure, whatever greedy_tau says."""
    walks, greedy = [1.0, 1.6, 1.2], [1.0, 1.5, 2.0]  # optimizer_step 0, 3, 6
    real = loop.evaluate_held_out

    def evaluate(*args, **kwargs):
        return {**real(*args, **kwargs), "walk_tau": walks.pop(0), "greedy_tau": greedy.pop(0)}

    monkeypatch.setattr(loop, "evaluate_held_out", evaluate)
    cfg = tiny_run("train.best_by=walk_tau")
    summary = _train(cfg)
    kept = _record(cfg.run.output_path / "train" / "draft")
    assert kept["kept"]["by"] == "walk_tau" and kept["kept"]["optimizer_step"] == 3
    assert summary.after["walk_tau"] == 1.6 and summary.after["greedy_tau"] == 1.5
