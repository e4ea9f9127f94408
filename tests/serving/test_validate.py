"""The validation's verdict without vLLM: every way an export can disagree with the trained draft
fails it, with a message naming the reason."""

import re

import pytest
import torch

from serving.validate import verdict

GOOD = dict(tau_ours=1.5, tau_engine=1.5, alpha_ours=[0.4, 0.1], alpha_engine=[0.4, 0.1],
            drafts_engine=100, identical_engine_texts=10, prompts=10, tolerance=0.05)


def test_an_export_that_agrees_passes():
    assert verdict(**GOOD) == []
    assert verdict(**{**GOOD, "tau_engine": 1.5 * 1.049, "alpha_engine": [0.449, 0.051]}) == []


@pytest.mark.parametrize(("change", "message"), [
    ({"drafts_engine": 0, "tau_engine": 1.0, "alpha_engine": [0.0, 0.0]}, "vLLM drafted nothing"),
    ({"drafts_engine": 0}, "vLLM drafted nothing"),
    ({"tau_engine": 1.6}, r"tau 1.600 differs from ours 1.500 by 6.7 %"),
    ({"alpha_engine": [0.4, 0.2]}, r"alpha_2 0.200 \(vLLM\) vs 0.100 \(ours\)"),
    ({"alpha_engine": [0.4]}, "1 positions in vLLM, 2 in ours"),
    ({"identical_engine_texts": 9}, "differ from its texts without it on 1 of 10 prompts"),
])
def test_each_disagreement_fails_and_says_which(change, message):
    failures = verdict(**{**GOOD, **change})
    assert failures and any(re.search(message, f) for f in failures), failures


def test_an_engine_run_is_reused_only_for_the_same_weights_prompts_and_settings(tmp_path):
    from serving.engines.vllm import cached_run

    calls = []

    def fake_vllm(request, cache):  # what vllm_worker.py returns, counting engine starts
        calls.append(request)
        return {"run": {"tokens": [[len(calls)]], "seconds": 1.0}}

    target, draft = tmp_path / "target", tmp_path / "draft"
    for folder in (target, draft):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"weights")
    request = {"target": str(target), "dtype": "float32", "prompts": [[1, 2]],
               "max_new_tokens": 8, "stop_token_ids": [2], "enforce_eager": True}
    speculative = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    first, reused = cached_run(request, None, tmp_path / "cache", fake_vllm)
    assert not reused and first["tokens"] == [[1]] and calls[0]["runs"] == {"run": None}
    again, reused = cached_run(request, None, tmp_path / "cache", fake_vllm)
    assert reused and again == first and len(calls) == 1
    _, reused = cached_run(request, speculative, tmp_path / "cache", fake_vllm)
    assert not reused and calls[1]["runs"] == {"run": speculative}
    for change in ({"prompts": [[1, 3]]}, {"max_new_tokens": 9}, {"temperature": 0.7}):
        _, reused = cached_run({**request, **change}, None, tmp_path / "cache", fake_vllm)
        assert not reused
    _, reused = cached_run(request, {**speculative, "num_speculative_tokens": 4},
                           tmp_path / "cache", fake_vllm)
    assert not reused
    (draft / "model.safetensors").write_bytes(b"retrained")  # the draft's weights changed
    _, reused = cached_run(request, speculative, tmp_path / "cache", fake_vllm)
    assert not reused
    _, reused = cached_run(request, None, tmp_path / "cache", fake_vllm)
    assert reused and len(calls) == 7
    # a greedy validation asks for the target alone alongside: one worker, then a cache hit
    other = {**request, "max_new_tokens": 12}
    fake_vllm = _fake_vllm_of_runs(calls)
    with_draft, reused = cached_run(other, speculative, tmp_path / "cache", fake_vllm,
                                    alongside=(None,))
    assert not reused and calls[-1]["runs"] == {"run": speculative, "alongside1": None}
    alone, reused = cached_run(other, None, tmp_path / "cache", fake_vllm)
    assert reused and len(calls) == 8 and alone != with_draft
    _, reused = cached_run(other, speculative, tmp_path / "cache", fake_vllm, alongside=(None,))
    assert reused and len(calls) == 8


def _fake_vllm_of_runs(calls):
    def fake(request, cache):  # one result per run asked for, each different
        calls.append(request)
        return {name: {"tokens": [[len(calls), i]], "seconds": 1.0}
                for i, name in enumerate(request["runs"])}
    return fake


def _steps_to_counters(steps: list[int], k: int) -> list[int]:
    """Accepted tokens per drafting step -> an engine's accepted-per-position counters."""
    return [sum(x > j for x in steps) for j in range(k)]


def test_the_tau_interval_covers_the_true_tau_95_percent_of_the_time():
    import random

    from decoding.acceptance import tau_interval

    rng = random.Random(0)
    probabilities = [0.3, 0.3, 0.2, 0.1, 0.1]  # X = 0..4 accepted, k = 4
    true_tau = 1 + sum(x * p for x, p in enumerate(probabilities))
    covered = 0
    for _ in range(1000):
        steps = rng.choices(range(5), probabilities, k=300)
        low, high = tau_interval(300, _steps_to_counters(steps, 4))
        covered += low <= true_tau <= high
    assert 0.93 <= covered / 1000 <= 0.97, covered


def test_the_design_effect_is_one_for_independent_steps_and_large_for_clustered_ones():
    import random

    from decoding.acceptance import design_effect
    from decoding.engine import RequestStats

    rng = random.Random(1)

    def request(steps):
        return RequestStats(steps=len(steps), accepted=sum(steps),
                            accepted_per_position=_steps_to_counters(steps, 3))

    independent = [design_effect([request(rng.choices(range(4), k=50)) for _ in range(20)])
                   for _ in range(50)]
    assert 0.9 <= sum(independent) / len(independent) <= 1.6  # >= 1 by construction
    # each request either accepts everything or nothing: its steps move together
    clustered = [request([3] * 50 if rng.random() < 0.5 else [0] * 50) for _ in range(20)]
    assert design_effect(clustered) > 10


def test_the_sampling_verdict_fails_only_when_intervals_are_apart():
    from serving.validate import sampling_verdict

    alpha = [(0.4, 0.5), (0.2, 0.3)]
    assert sampling_verdict((1.5, 1.7), (1.6, 1.8), alpha, alpha, drafts_engine=100) == []
    failures = sampling_verdict((1.5, 1.6), (1.7, 1.8), alpha, [(0.4, 0.5), (0.35, 0.4)], 100)
    assert any(f.startswith("tau: our 95 % interval [1.500, 1.600]") for f in failures)
    assert any(f.startswith("alpha_2") for f in failures) and len(failures) == 2
    assert "drafted nothing" in sampling_verdict((1, 1), (1, 1), [], [], 0)[0]


def test_the_first_divergence_of_two_texts():
    from serving.validate import first_divergence

    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # one stopped, the other went on


def test_llamacpps_trimmed_last_draft_is_not_counted_as_a_rejection():
    from serving.engines.llamacpp import per_request
    from serving.validate import pooled

    def counters(drafts, draft_tokens, accepted):  # llama-server's totals after a request
        return {"drafts": drafts, "draft_tokens": draft_tokens, "accepted_per_position": accepted}

    zero = counters(0, 0, [])
    # 6 steps at k=3, the last trimmed to 2 tokens (1 short): position 3 drafted 5 times
    request = per_request(counters(6, 17, [6, 6, 5]), zero, 3)
    assert request.drafted_per_position == [6, 6, 5]
    tau, alpha, steps = pooled([request], 3)
    assert alpha == [1.0, 1.0, 1.0] and steps == 6 and abs(tau - (1 + 17 / 6)) < 1e-12
    full = per_request(counters(10, 29, [8, 7, 5]), counters(6, 17, [6, 6, 5]), 3)
    assert full.drafted_per_position == [4, 4, 4] and full.accepted_per_position == [2, 1, 0]
    assert pooled([request, full], 3)[1] == [8 / 10, 7 / 10, 5 / 9]


def _greedy_steps(target, draft, max_new_tokens, k, budget):
    """Greedy speculative decoding of deterministic next-token functions of the context, with
    draft lengths given by budget(tokens left) (0: a plain step) -> (accepted per drafting
    step, draft tokens, generated tokens)."""
    tokens, accepted, drafted = [target(())], [], 0
    while len(tokens) < max_new_tokens:
        d = budget(max_new_tokens - len(tokens))
        proposal = []
        for _ in range(d):
            proposal.append(draft(tuple(tokens + proposal)))
        n = 0
        while n < d and proposal[n] == target(tuple(tokens + proposal[:n])):
            n += 1
        new = proposal[:n] + [target(tuple(tokens + proposal[:n]))]
        tokens += new[:max_new_tokens - len(tokens)]
        if d:
            accepted.append(n)
            drafted += d
    return accepted, drafted, tokens


def test_our_steps_are_counted_as_llama_server_counts_them_near_max_new_tokens():
    """budgeted turns our engine's steps (k drafted at every step, the row cut at
    max_new_tokens) into llama-server's (at most n_remaining - 1 drafted, none with 1 token
    left): equal to a llama-server-like loop run on the same target and draft."""
    import random

    from serving.engines.llamacpp import budgeted, from_totals

    for seed in range(300):
        rng = random.Random(seed)
        k, max_new = rng.randint(1, 5), rng.randint(2, 24)
        agree = rng.random()

        def target(context, salt=seed):
            return hash((salt, context)) % 5

        def draft(context, salt=seed):
            true = target(context)
            return true if random.Random(hash((salt, -1, context))).random() < agree else 5

        ours, _, text = _greedy_steps(target, draft, max_new, k, lambda left: k)
        theirs, drafted, same = _greedy_steps(target, draft, max_new, k,
                                              lambda left: max(min(k, left - 1), 0))
        assert same == text
        assert budgeted(ours, max_new, k) == from_totals(
            len(theirs), _steps_to_counters(theirs, k), drafted, k)
    # by hand: k=3, 8 tokens: 1 + (3+1) + a trimmed 2-token draft, both accepted (+1) = 8
    assert budgeted([3, 3], 8, 3) == from_totals(2, [2, 2, 1], 5, 3)
    # a last token decoded without a draft is no step: 1 + 1 + 1 + (last, plain)
    assert budgeted([0, 0, 2], 4, 2) == from_totals(2, [0, 0], 3, 2)


@pytest.mark.parametrize(("values", "dtype", "replace_from", "replace_to"), [
    ([0.7, -1.0, 1.3], torch.float32, -1.0, 1.0),  # temperatures (greedy marked -1 -> 1)
    ([5, 0, 7], torch.int32, 0, 0),  # top-k
    ([0.9, 1.0, 0.5], torch.float64, 0, 0),  # top-p
])
def test_the_vllm_cpu_expand_fix_writes_each_requests_value_over_its_draft_tokens(
        values, dtype, replace_from, replace_to):
    """vllm_worker.py's replacement for vLLM-CPU's expand_kernel fallback: request i's
    value at positions cu[i-1]..cu[i]-1, in the output's own dtype (the fallback writes into an
    int64 copy and leaves the output as torch.empty made it)."""
    from serving.engines.vllm_worker import _expand_in_place

    cu = torch.tensor([2, 5, 6], dtype=torch.int32)  # 2, 3 and 1 draft tokens
    output = torch.full((6,), -7, dtype=dtype)
    _expand_in_place(output, torch.tensor(values, dtype=dtype), cu, replace_from, replace_to)
    fixed = [replace_to if v == replace_from else v for v in values]
    want = torch.tensor([fixed[0]] * 2 + [fixed[1]] * 3 + [fixed[2]], dtype=dtype)
    assert output.dtype == dtype and torch.equal(output, want)


@pytest.mark.parametrize(("alpha", "wald_at_most"), [(0.005, 0.85), (0.02, 0.96), (0.3, 0.96)])
def test_the_alpha_intervals_cover_a_small_true_alpha_95_percent_of_the_time(alpha,
                                                                            wald_at_most):
    """alpha_3 and alpha_4 are often a few accepted tokens in 600 steps: Wald's interval
    a +- z sqrt(a(1 - a)/n) covers ~80 % there (and [0, 0] when none was accepted), which is why
    the check uses Wilson's; the check needs ~95 % at every alpha."""
    import random

    from decoding.acceptance import alpha_intervals

    rng = random.Random(2)
    covered, wald, n = 0, 0, 600
    for _ in range(2000):
        c = sum(rng.random() < alpha for _ in range(n))
        (low, high), = alpha_intervals(n, [c])
        covered += low <= alpha <= high
        half = 1.96 * (c / n * (1 - c / n) / n) ** 0.5
        wald += c / n - half <= alpha <= c / n + half
    assert 0.93 <= covered / 2000 <= 0.975, covered
    assert wald / 2000 <= wald_at_most, wald  # 0.787 at alpha 0.005: Wald would not do


def test_an_alpha_never_accepted_still_has_an_upper_bound_and_the_design_effect_widens_it():
    from decoding.acceptance import alpha_intervals

    (low, high), = alpha_intervals(600, [0])
    assert low == 0.0 and 0.004 < high < 0.01  # Wilson's ~z^2 / (n + z^2)
    (_, wider), = alpha_intervals(600, [0], design_effect=2.0)
    assert wider > 1.5 * high


def test_the_root_cause_of_a_vllm_failure_is_its_first_exception_line():
    from serving.engines.vllm import root_cause

    logged = ("(EngineCore pid=7) INFO 12-02 10:00:01 [core.py:90] starting\n"
              "(EngineCore pid=7) ERROR 12-02 10:00:02 [core.py:700] EngineCore failed.\n"
              "(EngineCore pid=7) ERROR 12-02 10:00:02 [core.py:701] ValueError: No common "
              "block size for 128\n"
              "RuntimeError: Engine core initialization failed\n")
    assert root_cause(logged) == "ValueError: No common block size for 128"
    in_process = ("[rank0]: Traceback (most recent call last):\n"
                  "[rank0]:   File \"llm_base_proposer.py\", line 1698, in validate\n"
                  "[rank0]: AssertionError: All drafting layers should belong to the same kv "
                  "cache group\n")
    assert root_cause(in_process) == ("AssertionError: All drafting layers should belong to the "
                                      "same kv cache group")
    assert root_cause("Killed\n") == "see its log below"


def test_a_vllm_requests_counters_are_the_totals_growth_while_it_ran():
    from types import SimpleNamespace as Metric

    from serving.engines.vllm_worker import counters, grown

    class FakeLLM:  # vLLM's get_metrics(): counters as .value, per-position vectors as .values
        def __init__(self, drafts, per_position):
            self.metrics = [Metric(name="vllm:spec_decode_num_drafts", value=drafts),
                            Metric(name="vllm:spec_decode_num_accepted_tokens_per_pos",
                                   value=None, values=per_position),
                            Metric(name="vllm:num_requests_running", value=1)]

        def get_metrics(self):
            return self.metrics

    assert counters(FakeLLM(7, [5, 3])) == {"drafts": 7, "accepted_per_position": [5, 3]}
    before, after = counters(FakeLLM(7, [5, 3])), counters(FakeLLM(12, [9, 4]))
    assert grown(before, after) == {"drafts": 5, "accepted_per_position": [4, 1]}
    assert grown({}, before) == before  # the first request: no counters before it
