"""The k schedulers: the per-step heuristic and the time-window scheduler."""

import copy
import time

import pytest

from decoding.engine import DecodeSettings, generate
from decoding.schedule import StepRecord, WindowScheduler, best_k, heuristic_k
from drafts.independent import ModelDraft
from tests.decoding.test_engine import EOS, _drafts, _prompts, _reference, _tiny


def test_heuristic_grows_after_a_full_acceptance_and_shrinks_otherwise():
    assert heuristic_k(4, [4, 4], 8) == 6
    assert heuristic_k(7, [7], 8) == 8
    assert heuristic_k(4, [4, 2], 8) == 3
    assert heuristic_k(1, [0], 8) == 1


def test_best_k_follows_acceptance_and_costs():
    # every token accepted and a free draft: draft as much as allowed
    assert best_k([1.0], draft_per_token=1e-6, verify=0.05, k_max=8) == 8
    # nothing accepted: one token, the least wasted draft time
    assert best_k([0.0], draft_per_token=0.01, verify=0.05, k_max=8) == 1
    # a draft as slow as the target with 50 % acceptance: (1 + .5) / 2 beats (1.75) / 3
    assert best_k([0.5], draft_per_token=0.05, verify=0.05, k_max=8) == 1
    # a cheap draft with 80 % acceptance: E[tokens](k) / (1 + 0.1 k) peaks near k = 4..5
    k = best_k([0.8], draft_per_token=0.005, verify=0.05, k_max=8)
    rates = {j: (1 + sum(0.8 ** i for i in range(1, j + 1))) / (0.05 + 0.005 * j)
             for j in range(1, 9)}
    assert k == max(rates, key=rates.get)


def test_the_window_keeps_only_recent_steps_and_conditions_on_the_previous_position():
    window = WindowScheduler(window_ms=100, k_max=8)
    # an old step where nothing was accepted, then recent steps where everything was
    window.record(StepRecord(0.0, 2, [0, 0], 0.001, 0.05))
    for t in (0.5, 0.55, 0.6):
        window.record(StepRecord(t, 2, [2, 2], 0.001, 0.05))
    assert len(window.steps) == 3  # the step at 0.0 is out of the 100 ms window
    assert window.next_k(2) == 8
    window = WindowScheduler(window_ms=100, k_max=8)
    # position 2 accepted whenever position 1 was: conditional acceptance 1.0 at j=2
    window.record(StepRecord(0.0, 4, [1, 1], 0.0001, 0.05))
    assert window.next_k(2) == best_k([0.25, 1.0], 0.0001 / 2, 0.05, 8)


def test_window_policy_is_lossless_and_grows_k_with_a_perfect_draft():
    target = _tiny(0)
    prompts, ids, mask = _prompts([6, 11])
    settings = DecodeSettings(max_new_tokens=60, k=1, adaptive_k=True, k_max=7,
                              adaptive_policy="window", window_ms=1000)
    # k grows only when a verify costs more than a draft token (module docstring): on a tiny
    # model both are overhead and their order is noise, so the target's forward is made 5 ms
    # dearer than its copy's (the draft), as a target is dearer than its draft in real use
    draft = ModelDraft(copy.deepcopy(target))
    slower = target.register_forward_pre_hook(lambda module, args: time.sleep(0.005))
    try:
        out = generate(target, ids, mask, settings, {EOS}, draft)
    finally:
        slower.remove()
    for row, prompt in enumerate(prompts):
        assert out.tokens[row] == _reference(target, prompt, 60)
    assert max(out.k_used) > 1, out.k_used
    out = generate(target, ids, mask, settings, {EOS}, _drafts(target)["other"])
    for row, prompt in enumerate(prompts):
        assert out.tokens[row] == _reference(target, prompt, 60)


def test_a_bad_policy_is_refused():
    from recipe import ConfigError

    with pytest.raises(ConfigError, match="adaptive_policy"):
        DecodeSettings(adaptive_k=True, adaptive_policy="sometimes")
