"""read_job under hostile bodies: thousands of seeded random requests, each mixing valid fields,
wrong types, out-of-range numbers, unknown fields, nested junk and huge values. Every one is a
job or a 4xx HTTPError naming a field; none raises anything else (which the server would answer
500)."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from recipe import load_config
from serving.request import HTTPError, Limits, read_job
from serving.served import Served

FIELDS = ["model", "messages", "prompt", "temperature", "top_p", "top_k", "max_tokens",
          "max_completion_tokens", "stop", "seed", "n", "stream", "stream_options", "user",
          "speculative_decoding", "draft_model", "max_speculative_tokens", "return_token_ids",
          "stop_token_ids", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs",
          "logit_bias", "parallel_tool_calls", "best_of", "functions", "\x00", ""]


def junk(rng: random.Random, depth: int = 0):
    """A random JSON value: every type, edge numbers, long strings, control tokens, nesting."""
    choices = [None, True, False, 0, 1, -1, 2**63, -(2**63) - 1, 1e308, -0.0, 0.5, 3, 17, 1024,
               "", "x", "<|im_start|>system", "é" * 300, "a" * 5000, "first", "self", "ngram"]
    if depth < 3:
        choices += [[], {}, [junk(rng, depth + 1) for _ in range(rng.randrange(4))],
                    {rng.choice(FIELDS): junk(rng, depth + 1) for _ in range(rng.randrange(3))},
                    [{"role": rng.choice(["user", "system", "assistant", "tool", 3]),
                      "content": junk(rng, depth + 1)} for _ in range(rng.randrange(3))]]
    return rng.choice(choices)


@pytest.fixture(scope="module")
def served(tiny_target, tmp_path_factory):
    cfg = load_config(None, [f"model.target={tiny_target}",
                             f"run.output_dir={tmp_path_factory.mktemp('run')}"])
    return Served(cfg, {"first": "layer-truncated:1"}, torch.device("cpu"))


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
def test_random_bodies_give_a_job_or_a_4xx_and_nothing_else(served, chat):
    rng, loop = random.Random(0), asyncio.new_event_loop()
    limits, outcomes = Limits(), {"job": 0, "4xx": 0}
    try:
        for _ in range(1500):
            body = {name: junk(rng) for name in rng.sample(FIELDS, rng.randrange(1, 6))}
            if rng.random() < 0.5:  # often a valid core, so that later checks are reached
                body.update({"messages": [{"role": "user", "content": "hi"}]} if chat
                            else {"prompt": "hi"})
                body.setdefault("max_tokens", 4)
            if rng.random() < 0.05:
                body = junk(rng)  # not even an object
            try:
                read_job(body, chat, served, limits, loop)
                outcomes["job"] += 1
            except HTTPError as e:
                assert 400 <= e.status < 500 and e.message, (body, e.status)
                outcomes["4xx"] += 1
    finally:
        loop.close()
    assert outcomes["job"] > 10 and outcomes["4xx"] > 500, outcomes  # both paths exercised
