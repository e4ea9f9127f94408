"""The side-by-side benchmark's own pieces (benchmarks/side_by_side.py), on a tiny random
Llama: the features in speculators' layout, its data folder as its loader splits it, the draft
vocabulary maps, the mask token, the peer's flags per kind, the last checkpoint, the acceptance
figures; SpecForge's offline files, target folder, run config, step log and CPU loss. Training
the peers and vLLM is the benchmark's job, not a test's."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.peers import layer_features, run_peer
from benchmarks.peers.specforge import (
    specforge_run,
    specforge_steps,
    specforge_target,
    write_specforge_data,
)
from benchmarks.peers.speculators import (
    latest_speculators_checkpoint,
    speculators_flags,
    speculators_steps,
    write_speculators_data,
)
from benchmarks.side_by_side import (
    ROOT,
    head_figures,
    head_mask_token,
    head_vocabulary,
    our_step_rates,
    render_table,
)
from drafts.eagle3 import target_ids, vocab_maps
from tests.helpers import tiny_llama
from train.data import Example


@pytest.fixture(scope="module")
def target():
    return tiny_llama(96, layers=4)


def _examples(n: int, seed: int) -> list[Example]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = int(torch.randint(6, 14, (1,), generator=g))
        ids = torch.randint(0, 96, (length,), generator=g).tolist()
        rows.append(Example(f"{seed}-{i}", ids, [0] * 3 + [1] * (length - 3)))
    return rows


def test_features_are_the_aux_layer_inputs_and_the_last_layer_before_the_final_norm(target):
    ids = [5, 17, 3, 88, 41, 9]
    features = layer_features(target, ids, [1, 2, 3])  # [T, 4, H]
    out = target.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    assert features.shape == (6, 4, 64)
    for slot, layer in enumerate([1, 2, 3]):
        torch.testing.assert_close(features[:, slot], out.hidden_states[layer][0])
    torch.testing.assert_close(target.model.norm(features[:, 3]), out.last_hidden_state[0])
    assert not torch.allclose(features[:, 3], out.last_hidden_state[0])  # before the norm


def test_speculators_data_splits_where_ours_does_and_is_written_once(target, tmp_path):
    from datasets import load_from_disk
    from safetensors.torch import load_file, save_file

    train, held_out = _examples(7, 0), _examples(2, 1)
    draft_ids = torch.tensor([2, 5, 9, 40, 77])
    ratio = write_speculators_data(tmp_path, train, held_out, target, [1, 2, 3], draft_ids,
                                   log=lambda *a: None)
    rows = load_from_disk(str(tmp_path))
    assert isinstance(rows[0]["input_ids"], torch.Tensor)  # the format its loader compares in
    rows = rows.with_format(None)
    assert int(len(rows) * ratio) == len(train)  # speculators' split: the first int(n * ratio)
    assert rows["input_ids"] == [e.input_ids for e in train + held_out]
    assert rows["loss_mask"] == [e.loss_mask for e in train + held_out]
    assert rows["seq_len"] == [len(e.input_ids) for e in train + held_out]
    for i, e in enumerate(train + held_out):
        saved = load_file(tmp_path / "hidden_states" / f"hs_{i}.safetensors")
        assert saved["token_ids"].tolist() == e.input_ids
        assert saved["hidden_states"].shape == (len(e.input_ids), 4, 64)
        assert saved["hidden_states"].dtype == torch.bfloat16
    d2t = torch.from_numpy(np.load(tmp_path / "d2t-5.npy"))
    t2d = torch.from_numpy(np.load(tmp_path / "t2d-5.npy"))
    assert target_ids(torch.arange(5), d2t).tolist() == draft_ids.tolist()
    assert t2d.nonzero().flatten().tolist() == draft_ids.tolist()

    first = tmp_path / "hidden_states" / "hs_0.safetensors"
    stale = tmp_path / "hidden_states" / "hs_1.safetensors"
    save_file({"hidden_states": torch.zeros(2, 4, 64), "token_ids": torch.tensor([1, 2])},
              str(stale))  # another conversation's file
    stamp = first.stat().st_mtime_ns
    write_speculators_data(tmp_path, train, held_out, target, [1, 2, 3], draft_ids,
                           log=lambda *a: None)
    assert first.stat().st_mtime_ns == stamp  # kept
    assert load_file(stale)["token_ids"].tolist() == train[1].input_ids  # rewritten


def test_the_last_epochs_checkpoint_is_taken(tmp_path):
    with pytest.raises(RuntimeError, match="no checkpoint folder"):
        latest_speculators_checkpoint(tmp_path)
    for epoch in (0, 1, 10):
        (tmp_path / str(epoch)).mkdir()
        (tmp_path / str(epoch) / "config.json").write_text("{}")
    (tmp_path / "11").mkdir()  # an epoch being written: no config yet
    (tmp_path / "best").symlink_to("1")
    assert latest_speculators_checkpoint(tmp_path) == tmp_path / "10"


def test_acceptance_figures_from_vllms_counters_with_intervals_over_prompts():
    reference = [[1, 2, 3], [4, 5], [6]]
    per_prompt = [{"drafts": 4, "accepted": 6}, {"drafts": 4, "accepted": 3},
                  {"drafts": 2, "accepted": 1}]
    found = {"drafts": 10, "accepted_per_position": [6, 3, 1, 0], "seconds": 2.5,
             "tokens": [[1, 2, 3], [4, 9], [6]], "per_request": per_prompt}
    figures = head_figures(found, reference)
    assert figures["tau"] == pytest.approx(2.0)
    assert figures["alpha"] == pytest.approx([0.6, 0.3, 0.1, 0.0])
    assert (figures["identical_texts"], figures["prompts"]) == (2, 3)
    low, high = figures["tau_interval"]
    assert low < 2.0 < high  # prompts accept 2.5, 1.75 and 1.5 tokens per step
    peer = head_figures({**found, "per_request": [{"drafts": 4, "accepted": 2},
                                                  {"drafts": 4, "accepted": 1},
                                                  {"drafts": 2, "accepted": 0}],
                         "accepted_per_position": [3, 0, 0, 0]}, reference)
    trainer = {"wall_seconds": 100.4, "optimizer_steps": 6, "tokens_per_second": 321.6,
               "median_step_tokens_per_second": 340.2}
    slower = {**trainer, "median_step_tokens_per_second": 170.1}
    table = render_table({"trainers": {"draftsmith/seed-0": trainer, "peer/seed-0": slower},
                          "vllm": {"draftsmith/seed-0": figures, "peer/seed-0": peer}})
    assert (f"| draftsmith | 0 | 2.000 [{low:.3f}, {high:.3f}] | - | 0.600 / 0.300 / 0.100 / "
            "0.000 | 2/3 | 100 s | 6 | 322 / 340 |" in table)
    row = next(line for line in table.splitlines() if line.startswith("| peer | 0 |"))
    difference = row.split(" | ")[3]  # every prompt accepts less than ours: below zero
    assert difference.startswith("-0.700 [") and difference.endswith("]")
    assert float(difference.split("[")[1].split(",")[1].rstrip("]")) < 0
    assert "| peer | ahead | 2.00x |" in table  # ours ahead in its one seed, twice as fast
    second = render_table({"trainers": {"peer/seed-1": trainer, "draftsmith/seed-0": trainer,
                                        "peer/seed-0": slower, "draftsmith/seed-1": trainer},
                           "vllm": {"draftsmith/seed-0": figures, "peer/seed-0": peer,
                                    "draftsmith/seed-1": figures, "peer/seed-1": figures}})
    assert "| peer | not resolved | 2.00x / 1.00x |" in second  # seed 1: the same head
    rows = [line.split(" | ")[:2] for line in second.splitlines()[2:6]]
    assert rows == [["| draftsmith", "0"], ["| peer", "0"], ["| draftsmith", "1"],
                    ["| peer", "1"]]  # seed by seed, ours first, whatever order they ran in
    assert second.endswith("Trained at commit unrecorded on unrecorded (4 runs); measured in "
                           "vLLM at commit unrecorded on unrecorded (4 heads).")
    where = {"commit": "abc1234", "hardware": "2 x CPU (avx2)"}
    third = render_table({"trainers": {"draftsmith/seed-0": {**trainer, **where},
                                       "peer/seed-0": {**slower, "commit": "def5678",
                                                       "hardware": "2 x CPU (avx2)"}},
                          "vllm": {"draftsmith/seed-0": {**figures, **where},
                                   "peer/seed-0": {**peer, **where}}})
    assert third.endswith("Trained at commit abc1234 on 2 x CPU (avx2) (1 run); commit def5678 "
                          "on 2 x CPU (avx2) (1 run); measured in vLLM at commit abc1234 on "
                          "2 x CPU (avx2) (2 heads).")
    json.dumps(figures)  # results.json holds it


SPECULATORS_LOG = """\
[14:03:46] INFO     train/loss_0=10.524, train/full_acc_0=0.003,  trainer.py:587
                    profile/fwd_ms=1.20e+04,
                    profile/step_ms=2.47e+04,
                    profile/tokens_per_s=147.037,
                    epoch=0, lr=0.002, global_step=1
[14:04:10] INFO     train/loss_0=9.1, profile/step_ms=500.0,
                    profile/tokens_per_s=1000.0, epoch=0, global_step=2
"""


def test_speculators_steps_are_timed_by_its_own_log():
    steps = speculators_steps(SPECULATORS_LOG)
    assert steps["optimizer_steps"] == 2
    assert steps["step_seconds"] == pytest.approx(24.7 + 0.5)
    assert steps["step_tokens"] == pytest.approx(147.037 * 24.7 + 500.0)
    assert steps["step_rates"] == pytest.approx([147.037, 1000.0])
    with pytest.raises(RuntimeError, match="no per-step timing"):
        speculators_steps("Traceback ...")


def test_the_peers_get_the_draft_vocabulary_of_our_exported_head(tmp_path):
    from safetensors.torch import save_file

    draft_ids = torch.tensor([0, 3, 4, 50, 95])
    d2t, t2d = vocab_maps(draft_ids, 96)
    save_file({"d2t": d2t, "t2d": t2d, "fc.weight": torch.zeros(2, 2)},
              str(tmp_path / "model.safetensors"))
    assert head_vocabulary(tmp_path).tolist() == draft_ids.tolist()


def test_a_dflash_drafter_gives_the_peer_no_vocabulary_but_its_mask_token(target, tmp_path):
    write_speculators_data(tmp_path, _examples(3, 0), _examples(1, 1), target, [1, 2, 3], None,
                           log=lambda *a: None)
    assert not list(tmp_path.glob("d2t-*.npy")) and not list(tmp_path.glob("t2d-*.npy"))
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["DFlashDraftModel"],
         "dflash_config": {"mask_token_id": 16, "target_layer_ids": [0, 1, 2]}}))
    assert head_mask_token(tmp_path) == 16


def _flags(kind_recipe: str, *overrides: str) -> tuple[dict, list[str]]:
    from recipe import load_config

    cfg = load_config(ROOT / "configs" / kind_recipe, list(overrides))
    kind = cfg.train.draft.partition(":")[0]
    flags = speculators_flags(cfg, kind, "/target", ROOT / "data", ROOT / "save", 0.96, 8,
                              [2, 15, 27], True, 2080, 16 if kind == "dflash" else None)
    values, key = {}, None
    for flag in flags:  # "--name v1 v2" -> {"name": ["v1", "v2"]}, a switch -> []
        if flag.startswith("--"):
            key = flag[2:]
            values[key] = []
        else:
            values[key].append(flag)
    return values, flags


def test_the_peers_eagle3_flags_carry_the_recipes_settings():
    flags, _ = _flags("smollm2-135m-eagle3.yaml")
    assert flags["speculator-type"] == ["eagle3"] and flags["num-layers"] == ["1"]
    assert flags["target-layer-ids"] == ["2", "15", "27"]
    assert flags["draft-vocab-size"] == ["8192"]
    assert (flags["ttt-steps"], flags["ttt-step-loss-decay"]) == (["7"], ["0.8"])
    assert flags["no-norm-before-residual"] == [] and flags["no-norm-output"] == []
    assert (flags["lr"], flags["epochs"], flags["total-seq-len"]) == (["0.002"], ["8"], ["2080"])
    assert flags["hidden-states-dtype"] == ["bfloat16"]
    assert "block-size" not in flags and "mask-token-id" not in flags


def test_the_peers_dflash_flags_carry_the_recipes_blocks_layers_and_loss_weights():
    flags, _ = _flags("smollm2-135m-dflash.yaml", "train.position_decay=0.7")
    assert flags["speculator-type"] == ["dflash"]
    assert flags["num-layers"] == ["2"] and flags["full-attention-indices"] == ["0", "1"]
    assert flags["block-size"] == ["5"]  # the known token and the recipe's 4 masks
    assert flags["mask-token-id"] == ["16"] and flags["max-anchors"] == ["2080"]
    gamma = float(flags["dflash-decay-gamma"][0])
    assert math.exp(-1 / gamma) == pytest.approx(0.7, abs=1e-6)  # its weight of mask j+1 / j
    assert flags["per-position-loss-weight"] == ["fixed-exp-decay"]
    assert flags["loss-fn"] == ["kl_div"] and "draft-vocab-size" not in flags
    assert flags["lr"] == ["0.001"] and flags["scheduler-warmup-steps"] == ["4"]


def test_our_step_rates_come_from_the_logs_running_totals(tmp_path):
    log = tmp_path / "log.jsonl"
    entries = [{"optimizer_step": 0, "held_out_loss": 3.0},  # an evaluation: no rate
               {"optimizer_step": 1, "tokens": 1000, "tokens_per_s": 100.0},  # 10 s
               {"optimizer_step": 2, "tokens": 3000, "tokens_per_s": 200.0},  # 15 s in all
               {"optimizer_step": 3, "tokens": 3500, "tokens_per_s": 175.0}]  # 20 s in all
    log.write_text("".join(json.dumps(e) + "\n" for e in entries))
    assert our_step_rates(log) == pytest.approx([100.0, 400.0, 100.0])


def test_specforge_data_holds_each_training_row_with_the_normed_last_state(target, tmp_path):
    train = _examples(5, 0)
    draft_ids = torch.tensor([2, 5, 9, 40, 77])
    write_specforge_data(tmp_path, train, target, [1, 2, 3], draft_ids, torch.float32,
                         log=lambda *a: None)
    files = sorted((tmp_path / "train").glob("*.ckpt"))
    assert [f.name for f in files] == [f"{i:06d}.ckpt" for i in range(5)]  # its sorted order
    for f, e in zip(files, train):
        row = torch.load(f, weights_only=True)
        T = len(e.input_ids)
        assert row["input_ids"].tolist() == e.input_ids
        assert row["loss_mask"].tolist() == e.loss_mask
        out = target.model(input_ids=torch.tensor([e.input_ids]), output_hidden_states=True)
        assert row["hidden_state"].shape == (1, T, 64)
        assert row["hidden_state"].dtype == torch.bfloat16  # its target head's dtype
        torch.testing.assert_close(row["hidden_state"][0].float(), out.last_hidden_state[0],
                                   atol=2e-2, rtol=2e-2)  # after the final norm
        assert row["aux_hidden_state"].shape == (1, T, 3 * 64)
        assert row["aux_hidden_state"].dtype == torch.float32
        torch.testing.assert_close(row["aux_hidden_state"][0, :, 64:128], out.hidden_states[2][0])
    maps = torch.load(tmp_path / "vocab_mapping.pt", weights_only=True)
    assert target_ids(torch.arange(5), maps["d2t"]).tolist() == draft_ids.tolist()
    assert maps["t2d"].nonzero().flatten().tolist() == draft_ids.tolist()

    stamp = files[0].stat().st_mtime_ns
    torch.save({"input_ids": torch.tensor([1, 2])}, files[1])  # another conversation's row
    write_specforge_data(tmp_path, train[:3], target, [1, 2, 3], draft_ids, torch.float32,
                         log=lambda *a: None)
    assert files[0].stat().st_mtime_ns == stamp  # kept
    assert torch.load(files[1], weights_only=True)["input_ids"].tolist() == train[1].input_ids
    assert len(list((tmp_path / "train").glob("*.ckpt"))) == 3  # the larger set's rows gone


def test_specforge_reads_the_target_through_an_index_of_its_one_file(tmp_path):
    from safetensors.torch import save_file

    source = tmp_path / "model"
    source.mkdir()
    (source / "config.json").write_text("{}")
    save_file({"model.embed_tokens.weight": torch.zeros(4, 2), "model.norm.weight": torch.ones(2)},
              str(source / "model.safetensors"))
    folder = specforge_target(str(source), tmp_path / "specforge-target")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {"model.embed_tokens.weight": "model.safetensors",
                                   "model.norm.weight": "model.safetensors"}
    assert (folder / "config.json").resolve() == (source / "config.json").resolve()
    assert specforge_target(str(source), folder) == folder  # made again over its own links


def test_specforge_run_config_carries_the_recipes_settings(tmp_path):
    import yaml

    from recipe import ConfigError, load_config

    target_folder = tmp_path / "target"
    target_folder.mkdir()
    (target_folder / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "hidden_size": 576, "vocab_size": 49152,
         "num_hidden_layers": 30, "tie_word_embeddings": True, "dtype": "float32"}))
    cfg = load_config(ROOT / "configs" / "smollm2-135m-eagle3.yaml", [])
    path = specforge_run(cfg, target_folder, tmp_path / "data", tmp_path / "run", 8, 184,
                         [2, 15, 27], True)
    run = yaml.safe_load(path.read_text())
    t = run["training"]
    assert (t["strategy"], t["num_epochs"], t["batch_size"], t["ttt_length"]) == \
        ("eagle3", 8, 4, 7)
    assert (t["learning_rate"], t["max_grad_norm"], t["lr_scheduler"]) == (0.002, 1.0, "cosine")
    assert t["warmup_ratio"] == pytest.approx(10 / (8 * 46))  # the recipe's warmup steps
    assert run["model"]["torch_dtype"] == "bfloat16"
    assert run["model"]["lm_head_key"] == "model.embed_tokens.weight"  # tied in SmolLM2
    assert run["data"]["hidden_states_path"] == str(tmp_path / "data" / "train")
    draft = json.loads((tmp_path / "run" / "draft_config.json").read_text())
    assert draft["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (draft["num_hidden_layers"], draft["draft_vocab_size"]) == (1, 8192)
    assert draft["tie_word_embeddings"] is False and "dtype" not in draft
    assert draft["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]

    other = load_config(ROOT / "configs" / "smollm2-135m-eagle3.yaml", ["train.position_decay=0.7"])
    with pytest.raises((ConfigError, ValueError), match="position_decay"):
        specforge_run(other, target_folder, tmp_path / "data", tmp_path / "run", 8, 184,
                      [2, 15, 27], True)


def test_specforge_steps_come_from_the_entry_points_step_log(tmp_path):
    log = tmp_path / "steps.jsonl"
    rows = [{"tokens": 1000, "seconds": 10.0, "optimizer_stepped": True},
            {"tokens": 600, "seconds": 2.0, "optimizer_stepped": True}]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    steps = specforge_steps(log)
    assert steps["optimizer_steps"] == 2
    assert (steps["step_seconds"], steps["step_tokens"]) == (12.0, 1600)
    assert steps["step_rates"] == pytest.approx([100.0, 300.0])
    log.write_text("")
    with pytest.raises(RuntimeError, match="no optimizer step"):
        specforge_steps(log)


def test_specforge_cpu_loss_is_the_soft_label_cross_entropy_of_its_kernel():
    from benchmarks.peer_entry.specforge_cpu import TorchLogSoftmaxLoss

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 7, generator=g, requires_grad=True)
    target_p = torch.softmax(torch.randn(2, 3, 7, generator=g), -1)
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])[..., None]
    loss = TorchLogSoftmaxLoss.apply(logits, target_p, mask)
    expected = sum(-(target_p[b, t] * torch.log_softmax(logits[b, t], -1)).sum()
                   for b in range(2) for t in range(3) if mask[b, t]) / 6  # mean over B * T
    torch.testing.assert_close(loss, expected)
    loss.backward()
    assert logits.grad[0, 1].abs().sum() == 0  # a masked position gets no gradient


def test_a_peer_run_appends_to_its_log_and_a_failure_shows_its_end(tmp_path, monkeypatch):
    import sys

    import benchmarks.peers as peers

    entry = tmp_path / "entry.py"
    entry.write_text("import os, sys\nprint('args', sys.argv[1:], os.environ['EXTRA'])\n"
                     "sys.exit(int(sys.argv[1]))\n")
    monkeypatch.setitem(peers.PEER_ENTRY, "specforge", entry)
    log = tmp_path / "run" / "train.log"
    seconds = run_peer("specforge", Path(sys.executable), ["0"], log, "its trainer",
                       {"EXTRA": "x"})
    assert seconds > 0 and "args ['0'] x" in log.read_text()
    with pytest.raises(RuntimeError, match=r"(?s)its trainer failed \(exit 3\).*args \['3'\] x"):
        run_peer("specforge", Path(sys.executable), ["3"], log, "its trainer", {"EXTRA": "x"})
    assert log.read_text().count("args") == 2  # appended


def test_a_run_is_written_as_a_dated_study_with_its_settings(tmp_path, monkeypatch):
    import benchmarks.side_by_side as side_by_side

    monkeypatch.setattr(side_by_side, "ROOT", tmp_path)
    results = {"config": "configs/r.yaml", "train_conversations": 354, "epochs": 1,
               "cpu": "2 x CPU", "torch_threads": 2, "questions": 20, "max_new_tokens": 256,
               "k": 4, "kind": "dflash"}
    doc = side_by_side.write_docs(results, "new table", ["--epochs", "1"], today="2026-12-07")
    assert doc == tmp_path / "docs" / "results" / "2026-12-07-side-by-side-r-354-1-epochs.md"
    text = doc.read_text()
    assert text.startswith("# Side by side: configs/r.yaml, 354 training conversations, 1 epoch\n")
    assert "2 x CPU; 2 torch threads; commit" in text and "new table" in text
    assert "DFlash, matched:" in text and "DFlash, not matched:" in text
    variant = side_by_side.write_docs({**results, "variant": "lr", "overrides": ["x=1"]},
                                      "table", [], today="2026-12-07")
    assert variant.name.endswith("-1-epochs-lr.md") and doc.read_text() == text


def test_ours_is_placed_where_its_trainer_recorded_it(tmp_path):
    from benchmarks.side_by_side import trained_where
    from runfolder import write_train_record

    assert trained_where(tmp_path) == {}  # no finished draft: nothing to say
    write_train_record(tmp_path, {"optimizer_steps": 4, "commit": "abc1234",
                                  "hardware": "2 x CPU (avx2)"})
    assert trained_where(tmp_path) == {"commit": "abc1234", "hardware": "2 x CPU (avx2)"}
