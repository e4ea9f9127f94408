"""Fast tier: the tau-against-CPU-hours report adds stage 1, the feature dump and the training
seconds up to each held-out evaluation."""

import json

import pytest
import yaml

from eval.tau_vs_hours import main
from runfolder import TRAIN_RECORD
from tests.helpers import write_six_conversations


def _run(root, log):
    run = root / "large"
    write_six_conversations(run)  # c0..c3 trained on (max_conversations 4), c5 held out
    (run / "train" / "draft").mkdir(parents=True)
    (run / "train" / "config.yaml").write_text(yaml.safe_dump(
        {"train": {"max_conversations": 4, "micro_batch_size": 2,
                   "gradient_accumulation_steps": 1}}))
    (run / "train" / "log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in log))
    (run / "features").mkdir()
    (run / "features" / "manifest.json").write_text(json.dumps({"dump_seconds": 400.0}))
    return run


def _eval(step, greedy):
    return {"optimizer_step": step, "held_out": {"tau": greedy - 0.1, "greedy_tau": greedy}}


def _step(step, tokens, tokens_per_s):
    return {"optimizer_step": step, "loss": 1.0, "tokens": tokens, "tokens_per_s": tokens_per_s}


def test_each_held_out_evaluation_is_a_point_at_the_hours_spent_by_then(tmp_path, capsys):
    # steps of 900 s each (tokens and tokens/s are the totals so far, resumes included)
    run = _run(tmp_path, [_eval(0, 1.0), _step(1, 900, 1.0), _step(2, 1800, 1.0),
                          _eval(2, 1.2), _step(3, 2700, 1.0), _step(4, 3600, 1.0),
                          _eval(4, 1.3)])
    (run / "train" / "draft" / TRAIN_RECORD).write_text(
        json.dumps({"optimizer_steps": 4}))
    results = {"draft": f"{run / 'train' / 'draft'} (EAGLE-3)", "num_prompts": 10,
               "methods": {"speculative": {"tau": 1.25, "alpha": [0.2]},
                           "speculative+hybrid": {"tau": 1.7}, "prompt_lookup": {"tau": 1.6}}}
    (tmp_path / "results.json").write_text(json.dumps(results))
    assert main(["--run", str(run), "--stage1-tokens-per-s", "0.05", "--eval",
                 str(tmp_path / "results.json"), "--out", str(tmp_path / "out")]) == 0
    result = json.loads((tmp_path / "out" / "tau_vs_hours.json").read_text())
    # stage 1: c0..c3 and the held-out c5 generated 10+20+30+40+60 tokens at 0.05 tokens/s
    assert result["stage1_seconds"] == pytest.approx(3200.0)
    assert [p["optimizer_step"] for p in result["points"]] == [0, 2, 4]
    assert [p["epochs"] for p in result["points"]] == [0.0, 1.0, 2.0]  # 2 conversations a step
    assert [p["hours"] for p in result["points"]] == pytest.approx([1.0, 1.5, 2.0])
    assert result["measured"] == {"chain": {"tau": 1.25, "alpha": [0.2], "prompts": 10,
                                            "optimizer_step": 4},
                                  "hybrid": {"tau": 1.7, "alpha": None, "prompts": 10,
                                             "optimizer_step": 4}}
    assert "| 4 | 2.00 | 2.00 | 1.200 / 1.300 |" in capsys.readouterr().out
    assert (tmp_path / "out" / "tau_vs_hours.png").stat().st_size > 0


def test_measured_stage_1_seconds_replace_the_estimate(tmp_path):
    run = _run(tmp_path, [_eval(0, 1.0), _step(1, 100, 10.0), _eval(1, 1.1)])
    assert main(["--run", str(run), "--stage1-seconds", "7200", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "tau_vs_hours.json").read_text())
    assert [p["hours"] for p in result["points"]] == pytest.approx([2.0 + 400 / 3600,
                                                                    2.0 + 410 / 3600])
    assert result["measured"] == {}  # not trained to the end yet


def test_a_log_without_its_steps_is_refused(tmp_path):
    run = _run(tmp_path, [_eval(0, 1.0), _eval(5, 1.1)])
    with pytest.raises(ValueError, match="optimizer_step 5 without that step's entry"):
        main(["--run", str(run), "--stage1-seconds", "1", "--out", str(tmp_path)])


def test_the_walk_is_a_column_where_the_log_has_it(tmp_path, capsys):
    older = _eval(0, 1.0)  # a log from before the walk: no walk_tau there
    newer = _eval(1, 1.2)
    newer["held_out"]["walk_tau"] = 1.1
    run = _run(tmp_path, [older, _step(1, 100, 10.0), newer])
    assert main(["--run", str(run), "--stage1-seconds", "3600", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "tau_vs_hours.json").read_text())
    assert [p["walk_tau"] for p in result["points"]] == [None, 1.1]
    out = capsys.readouterr().out
    assert "| 0 | 0.00 | 1.11 | 0.900 / 1.000 | - |" in out
    assert "| 1 | 0.50 | 1.11 | 1.100 / 1.200 | 1.100 |" in out
