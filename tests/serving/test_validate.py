"""The validation's verdict without vLLM: every way an export can disagree with the trained draft
fails it, with a message naming the reason."""

import re

import pytest

from serving.validate import verdict

GOOD = dict(tau_ours=1.5, tau_vllm=1.5, alpha_ours=[0.4, 0.1], alpha_vllm=[0.4, 0.1],
            drafts_vllm=100, identical_vllm_texts=10, prompts=10, tolerance=0.05)


def test_an_export_that_agrees_passes():
    assert verdict(**GOOD) == []
    assert verdict(**{**GOOD, "tau_vllm": 1.5 * 1.049, "alpha_vllm": [0.449, 0.051]}) == []


@pytest.mark.parametrize(("change", "message"), [
    ({"drafts_vllm": 0, "tau_vllm": 1.0, "alpha_vllm": [0.0, 0.0]}, "vLLM drafted nothing"),
    ({"drafts_vllm": 0}, "vLLM drafted nothing"),
    ({"tau_vllm": 1.6}, r"tau 1.600 differs from ours 1.500 by 6.7 %"),
    ({"alpha_vllm": [0.4, 0.2]}, r"alpha_2 0.200 \(vLLM\) vs 0.100 \(ours\)"),
    ({"alpha_vllm": [0.4]}, "1 positions in vLLM, 2 in ours"),
    ({"identical_vllm_texts": 9}, "differ from its texts without it on 1 of 10 prompts"),
])
def test_each_disagreement_fails_and_says_which(change, message):
    failures = verdict(**{**GOOD, **change})
    assert failures and any(re.search(message, f) for f in failures), failures
