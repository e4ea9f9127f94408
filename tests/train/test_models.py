"""Draft kinds in training: Medusa offsets, the acceptance grid, a tiny Medusa run, bad input."""

from __future__ import annotations

import json

import pytest
import torch
from accelerate import Accelerator
from torch import nn

from decoding.acceptance import acceptance_grid, chain_sums, chained_acceptance
from drafts import check_train_config
from drafts.independent import DraftForTraining
from drafts.kind import SameVocabulary, chain_loss_rows
from recipe import ConfigError, TrainConfig
from tests.helpers import EAGLE3
from train import accelerator_kwargs, train_draft


def test_medusa_head_j_at_start_s_is_scored_at_loss_position_s_plus_j():
    pred_mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.bool)
    loss_positions = pred_mask.nonzero().tolist()  # the N rows, row-major
    slots = chain_loss_rows(pred_mask, 3, decay=0.5)
    assert [s.position for s in slots] == [1, 2, 3]
    assert [s.weight for s in slots] == [1.0, 0.5, 0.25]
    for slot in slots:
        assert slot.count == len(slot.rows) == len(slot.starts)
        for row, (b, s) in zip(slot.rows.tolist(), slot.starts.tolist()):
            assert loss_positions[row] == [b, s + slot.position]
    # every loss position t >= j is served by head j exactly once
    assert [s.count for s in slots] == [6, 5, 3]


def test_independent_draft_grid_gives_the_sliding_window_chains():
    g = torch.Generator().manual_seed(0)
    pred_mask = torch.rand(3, 12, generator=g) > 0.2
    pred_mask[:, 0] = False  # as in real data: a chain starts after a token, position 0 is none
    a = torch.rand(int(pred_mask.sum()), generator=g)
    per_position = torch.zeros(3, 12, dtype=torch.float64)
    per_position[pred_mask] = a.double()
    slots = DraftForTraining(nn.Identity()).loss_rows(pred_mask)
    grid, valid = acceptance_grid([a], slots, pred_mask, k=3)
    sums, windows = chain_sums(grid, valid)
    expected, expected_windows = chained_acceptance(per_position, pred_mask, 3)
    torch.testing.assert_close(sums, expected)
    assert windows == expected_windows > 0


class _OracleHeads(SameVocabulary, nn.Module):
    """Heads that return, for head j at start s, the target's own logits at s + j: perfect
    Medusa heads, if (and only if) the slots pair starts and loss positions correctly."""

    needs_target_hidden = True

    def __init__(self, target, num_heads):
        super().__init__()
        self.target, self.num_heads = target, num_heads

    def loss_rows(self, pred_mask):
        return chain_loss_rows(pred_mask, self.num_heads, 0.8)

    def forward(self, input_ids, attention_mask, pred_mask, target_hidden=None):
        logits = self.target.lm_head(target_hidden.last)  # [B, T, V]
        return torch.cat([logits[s.starts[:, 0], s.starts[:, 1] + s.position]
                          for s in self.loss_rows(pred_mask)])


def test_perfect_medusa_heads_are_predicted_to_reach_k_plus_one(tiny_run):
    from assets.target import load_target, load_tokenizer, resolve_target
    from train.data import held_out_batches, load_stage1
    from train.loop import evaluate_held_out

    cfg = tiny_run("train.draft=medusa:3")
    resolved = resolve_target(cfg.model)
    target = load_target(resolved, "float32", torch.device("cpu"))
    data = load_stage1(cfg, resolved.fingerprint)
    batches = held_out_batches(data, cfg, load_tokenizer(resolved).pad_token_id)
    result = evaluate_held_out(_OracleHeads(target, 3), target, batches, cfg.train,
                               torch.device("cpu"))
    assert result["tau"] == pytest.approx(cfg.train.eval_k + 1, abs=1e-4)
    assert result["greedy_tau"] == cfg.train.eval_k + 1
    assert result["loss"] == pytest.approx(0.0, abs=1e-5)


def test_medusa_heads_train_resume_and_save_in_vllm_layout(tiny_run):
    from safetensors import safe_open

    from drafts.medusa import MedusaHeads

    cfg = tiny_run("train.draft=medusa:3x2", "train.loss=fkl", "train.learning_rate=1e-2")
    summary = train_draft(cfg, Accelerator(**accelerator_kwargs(cfg)))
    log = [json.loads(line) for line in
           (cfg.run.output_path / "train" / "log.jsonl").read_text().splitlines()]
    losses = {e["optimizer_step"]: e["loss"] for e in log if "loss" in e}
    assert losses[6] < 0.8 * losses[1]
    assert summary.after["loss"] < summary.before["loss"]
    assert summary.after["tau"] > summary.before["tau"]
    folder = summary.draft_dir
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "medusa" and config["architectures"] == ["MedusaModel"]
    assert (config["num_heads"], config["num_hidden_layers"]) == (3, 2)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert names == {f"blocks.{h}.layers.{l}.weight" for h in range(3) for l in range(2)} | {
        f"lm_heads.{h}.weight" for h in range(3)}
    heads = MedusaHeads.from_pretrained(folder)
    assert heads.num_heads == 3 and (folder / "config.yaml").is_file()
    # a second run finds the trained heads and does not redo them
    again = train_draft(cfg, Accelerator(**accelerator_kwargs(cfg)))
    assert again.after == summary.after


@pytest.mark.parametrize(("overrides", "message"), [
    ({"draft": "medusa:2", "eval_k": 3}, "train.eval_k=3 draft tokens need as many Medusa heads"),
    ({"draft": "medusa:4", "on_policy_fraction": 0.5}, "cannot sample on their own"),
    ({"draft": "medusa:4", "lora_rank": 8}, "set train.lora_rank=0"),
    ({"draft": "medusa:four"}, "expected 'medusa:<heads>'"),
    ({"draft": "medusa:4", "position_decay": 0.0}, "train.position_decay=0.0"),
])
def test_bad_medusa_settings_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_train_config(TrainConfig(**overrides))


def test_medusa_heads_for_another_target_are_refused():
    from drafts.medusa import MedusaHeads, check_fits_target

    class _Target:
        def get_output_embeddings(self):
            return nn.Linear(64, 100, bias=False)

    with pytest.raises(ConfigError, match="hidden size 32 and predict 100 tokens"):
        check_fits_target(MedusaHeads(32, 100, num_heads=2), _Target())


@pytest.mark.parametrize("figure,overrides", [
    ("tau", ("train.draft=medusa:3", "train.loss=lk_lambda", "train.position_weights=dpace",
             "train.learning_rate=1e-2")),
    ("greedy_tau", (*EAGLE3, "train.loss=lk_alpha", "train.position_weights=dpace",
                    "train.dpace_smoothing=0.3")),
], ids=["medusa-lk_lambda-dpace", "eagle3-lk_alpha-dpace"])
def test_acceptance_targeted_losses_and_dpace_weights_train_a_draft(tiny_run, figure, overrides):
    """figure: the predicted acceptance the tiny target moves in 6 steps (its Medusa heads start
    near its own distribution, sampled tau 3.77 of 4; its EAGLE-3 head far, greedy tau 1)."""
    cfg = tiny_run(*overrides)
    summary = train_draft(cfg, Accelerator(**accelerator_kwargs(cfg)))
    assert summary.after[figure] > summary.before[figure]
    assert summary.after["loss"] < summary.before["loss"]


def test_dpace_is_refused_for_a_draft_without_draft_positions():
    with pytest.raises(ConfigError, match=r"train.position_weights='dpace' is read by "
                                          r"\['medusa', 'eagle3', 'dspark', 'dflash', 'pard'\]"):
        check_train_config(TrainConfig(draft="layer-truncated:2", position_weights="dpace"))
    for bad, message in [({"lk_eta": -1.0}, "lk_eta"), ({"dpace_smoothing": 0.0},
                                                       "dpace_smoothing")]:
        with pytest.raises(ConfigError, match=message):
            TrainConfig(**bad)
