"""Speed measurement with a fake clock: methods interleaved round by round, speedups per round
against that round's baseline, quartiles and a verdict that says when noise makes it uncertain."""

import pytest

from eval.speculative import Run, measure, quantile, schedule, speedup_stats


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _runners(clock, seconds: dict[str, list[float]], calls: list):
    """Fake methods: method m in round r takes seconds[m][r] and writes 10 tokens a prompt."""
    def make(name):
        def run(prompts):
            calls.append((name, tuple(map(tuple, prompts))))
            clock.now += seconds[name][sum(c[0] == name for c in calls) - 1]
            return Run([[0] * 10 for _ in prompts])
        return run
    return {name: make(name) for name in seconds}


def test_the_schedule_rotates_so_no_method_always_runs_first():
    order = schedule(["a", "b", "c"], 4)
    assert order == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert {o[0] for o in order} == {"a", "b", "c"}


def test_every_method_runs_every_round_on_that_rounds_prompts():
    clock, calls = FakeClock(), []
    rounds = [[[1]], [[2], [3]], [[4]]]
    measured = measure(_runners(clock, {"target": [1, 1, 1], "spec": [1, 1, 1]}, calls),
                       rounds, clock, log=lambda *a, **k: None)
    assert [c[1] for c in calls] == [((1,),), ((1,),), ((2,), (3,)), ((2,), (3,)), ((4,),),
                                     ((4,),)]
    assert [c[0] for c in calls] == ["target", "spec", "spec", "target", "target", "spec"]
    assert measured["target"].tokens_per_s == [10.0, 20.0, 10.0]
    assert measured["spec"].outputs == [[0] * 10] * 4


def test_a_noisy_round_moves_the_median_speedup_by_nothing():
    """The baseline is slowed 5x in round 0 (another job on the machine): a single-pass timing
    would report the draft 10x faster; per-round ratios keep it at 2x."""
    clock = FakeClock()
    seconds = {"target": [5.0, 1.0, 1.0, 1.0, 1.0], "spec": [0.5] * 5}
    measured = measure(_runners(clock, seconds, []), [[[1]]] * 5, clock,
                       log=lambda *a, **k: None)
    result = speedup_stats(measured["spec"].tokens_per_s, measured["target"].tokens_per_s)
    assert result.median == pytest.approx(2.0) and result.verdict == "faster"
    assert (result.q25, result.q75, result.rounds) == (pytest.approx(2.0), pytest.approx(2.0), 5)
    whole_run = (sum(seconds["target"]) / sum(seconds["spec"]))
    assert whole_run == pytest.approx(3.6)  # what timing each method once in one pass says


@pytest.mark.parametrize(("ratios", "verdict"), [
    ([1.2, 1.1, 1.3, 1.05], "faster"), ([0.3, 0.35, 0.32, 0.4], "slower"),
    ([0.9, 1.1, 1.2, 0.8], "uncertain"), ([1.2, 1.3, 1.25, 0.5], "faster"),
])
def test_the_verdict_needs_three_quarters_of_the_rounds(ratios, verdict):
    assert speedup_stats(ratios, [1.0] * len(ratios)).verdict == verdict


def test_quantiles_interpolate_like_numpy():
    assert quantile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.25) == 2.0
    assert quantile([7.0], 0.75) == 7.0


def test_every_printed_speedup_carries_its_quartiles_and_verdict():
    from dataclasses import asdict

    from runfolder import speed_text

    speed = asdict(speedup_stats([0.5, 0.7, 3.0, 0.6], [1.0] * 4))
    assert speed_text(speed) == "0.65x (0.57-1.27, uncertain)"
    assert speed_text(speed, baseline=True) == "1.00x" and speed_text(None) == "-"
