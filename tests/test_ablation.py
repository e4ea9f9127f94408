"""The ablation benchmark's own pieces (benchmarks/ablation.py): arms from the command line and
the table. Training and vLLM are the benchmark's job, not a test's."""

import pytest

from benchmarks.ablation import Arm, arm_row, parse_arm, render_table
from recipe import ConfigError


def test_an_arm_is_a_name_then_its_overrides():
    assert parse_arm("eagle31 train.eagle3.fc_norm=true 'train.loss=0.5*fkl+0.5*tvd'") == Arm(
        "eagle31", ("train.eagle3.fc_norm=true", "train.loss=0.5*fkl+0.5*tvd"))
    assert parse_arm("fkl") == Arm("fkl", ())
    for bad, why in [("train.loss=fkl", "give a name first"), ("", "give a name first"),
                     ("a/b train.loss=fkl", "give a name first"),
                     ("lk train.loss", "is not a key=value")]:
        with pytest.raises(ConfigError, match=why):
            parse_arm(bad)


def _vllm(drafts, accepted):
    return {"tau": 1 + sum(accepted) / sum(drafts), "tau_interval": [1.0, 2.0],
            "identical_texts": len(drafts), "prompts": len(drafts),
            "per_prompt": {"drafts": drafts, "accepted": accepted}}


def test_each_arm_is_paired_with_the_baseline_of_its_seed_and_the_table_says_so():
    record = {"optimizer_steps": 40, "tokens": 8000, "train_seconds": 100.0, "commit": "abc1234",
              "hardware": "2 x Some CPU (avx2)",
              "after": {"tau": 1.1, "greedy_tau": 1.2, "walk_tau": 1.15}}
    base = _vllm([10] * 6, [2, 3, 2, 3, 2, 3])
    better = _vllm([10] * 6, [6, 7, 6, 7, 6, 7])  # +0.4 on every prompt
    rows = [arm_row("fkl", 0, record, base, None), arm_row("lk", 0, record, better, base),
            arm_row("fkl", 1, record, base, None), arm_row("lk", 1, record, better, base)]
    assert "difference" not in rows[0]
    difference, low, high = rows[1]["difference"]
    assert difference == pytest.approx(0.4) and low == pytest.approx(0.4) == high
    assert rows[1]["tokens_per_second"] == 80.0
    table = render_table(rows, "fkl")
    assert "| lk | 0 | 1.100 / 1.200 / 1.150 | 1.650 [1.000, 2.000] | +0.400 [+0.400, +0.400]" \
        in table
    assert "| lk | ahead |" in table and "| fkl |" not in table.split("over every seed")[1]
    assert "commit abc1234 on 2 x Some CPU (avx2)" in table
    unrecorded = {k: v for k, v in record.items() if k not in ("commit", "hardware")}
    assert arm_row("fkl", 0, unrecorded, base, None)["commit"] == "unrecorded"


def test_a_head_is_measured_again_only_when_its_weights_changed(tmp_path):
    from benchmarks.side_by_side import head_identity

    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "config.json").write_text("{}")
    first = head_identity(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"weights")  # the same export written again
    assert head_identity(tmp_path) == first
    (tmp_path / "model.safetensors").write_bytes(b"trained again")
    assert head_identity(tmp_path) != first and list(first) == ["model.safetensors"]


def test_a_study_of_each_split_is_its_own_file(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from benchmarks import ablation

    monkeypatch.setattr(ablation, "ROOT", tmp_path)
    results = {"config": "configs/r.yaml", "arms": [["fkl", "train.loss=fkl"]], "shared": [],
               "seeds": [0, 1], "cpu": "2 x CPU",
               "setting": {"split": "report", "k": 4, "max_new_tokens": 128}}
    picked = [SimpleNamespace(id="mtbench:81")]
    report = ablation.write_docs(results, "report table", [], picked, today="2026-12-07")
    select = ablation.write_docs({**results, "setting": {**results["setting"], "split": "select"}},
                                 "select table", [], picked, today="2026-12-07")
    assert report.name == "2026-12-07-ablation-r.md"
    assert select.name == "2026-12-07-ablation-r-select.md"
    assert "report table" in report.read_text() and "select split" in select.read_text()
