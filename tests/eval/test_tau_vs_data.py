"""Fast tier: the tau-vs-data report reads each point's subset, timings and taus."""

import json

import pytest
import yaml

from eval.tau_vs_data import log_fit, main
from runfolder import TRAIN_RECORD
from tests.helpers import write_six_conversations


def test_log_fit_recovers_gain_per_decade():
    a, b = log_fit([10, 100, 1000], [1.3, 1.6, 1.9])
    assert a == pytest.approx(1.0) and b == pytest.approx(0.3)


def _run(root, name, max_conversations, tau):
    run = root / name
    write_six_conversations(run)
    (run / "train" / "draft").mkdir(parents=True)
    (run / "train" / "draft" / "config.yaml").write_text(
        yaml.safe_dump({"train": {"max_conversations": max_conversations}}))
    (run / "train" / "draft" / TRAIN_RECORD).write_text(json.dumps(
        {"optimizer_steps": 3, "train_seconds": 50.0,
         "after": {"tau": tau - 0.1, "greedy_tau": tau}}))
    (run / "features").mkdir()
    (run / "features" / "manifest.json").write_text(json.dumps({"dump_seconds": 7.0}))
    return run


def test_report_reads_every_point(tmp_path, capsys):
    small, big = _run(tmp_path, "small", 2, 1.1), _run(tmp_path, "big", None, 1.4)
    results = {"draft": f"{big / 'train' / 'draft'} (EAGLE-3, draft vocabulary 512)", "num_prompts": 10, "methods": {
        "speculative": {"tau": 1.5, "speedup": 0.5, "identical_to_target": 10},
        "speculative+hybrid": {"tau": 2.1, "speedup": 0.7, "identical_to_target": 10},
        "speculative:small": {"tau": 1.2}, "prompt_lookup": {"tau": 1.66}}}
    (tmp_path / "results.json").write_text(json.dumps(results))
    assert main(["--runs", f"{big},{small}", "--eval", str(tmp_path / "results.json"),
                 "--stage1-tokens-per-s", "10", "--out", str(tmp_path / "out")]) == 0
    points = json.loads((tmp_path / "out" / "tau_vs_data.json").read_text())
    assert [p["conversations"] for p in points] == [2, 5]
    assert [p["generated_tokens"] for p in points] == [30, 150]  # c0, c1 / c0..c4
    assert [p["stage1_seconds"] for p in points] == [3.0, 15.0]
    assert points[0]["measured"] == {"chain": {"tau": 1.2, "speedup": None, "identical": None,
                                               "prompts": 10}}
    assert points[1]["measured"]["hybrid"]["tau"] == 2.1
    assert (tmp_path / "out" / "tau_vs_data.png").stat().st_size > 0
    assert "| 5 | 150 | 15 | 7 | 50 (3) | 1.300 / 1.400 | 1.50 | 2.10 |" in capsys.readouterr().out
