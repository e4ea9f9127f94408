"""Integration tier: stage-1 generation with the real embedded SmolLM2-135M target."""

import json

import pytest
import torch

from assets.chat import render, render_text
from assets.prompts import load_sharegpt
from assets.target import end_of_turn_ids, load_target, resolve_target
from decoding.hf import generate_replies
from recipe import GenerationConfig, ModelConfig

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def target(smollm2_tokenizer):
    model = load_target(resolve_target(ModelConfig()), "float32", torch.device("cpu"))
    return model, smollm2_tokenizer


def _prompts(tokenizer, n):
    conversations, _ = load_sharegpt()
    prompts = []
    for conv in conversations:
        ids = render(tokenizer, [{"role": "user", "content": conv.user_turns[0]}], True)
        if 20 <= len(ids) <= 160:
            prompts.append(ids)
        if len(prompts) == n:
            return prompts


def test_batched_greedy_equals_one_by_one_in_fp32(target):
    model, tok = target
    prompts = _prompts(tok, 6)
    assert len({len(p) for p in prompts}) > 1  # left padding is really exercised
    gen = GenerationConfig(max_new_tokens=48, temperature=0.0, batch_size=6)
    eos = end_of_turn_ids(model, tok)
    batched = generate_replies(model, prompts, gen, eos, tok.pad_token_id)
    alone = [generate_replies(model, [p], gen, eos, tok.pad_token_id)[0] for p in prompts]
    for b, a in zip(batched, alone):
        assert b.token_ids == a.token_ids and b.finished == a.finished


def test_real_target_reply_is_masked_as_the_template_says(target, tmp_path):
    from accelerate import Accelerator

    from distill import load_distilled, run_distill
    from recipe import load_config
    from tests.helpers import write_jsonl

    model, tok = target
    prompts = write_jsonl(tmp_path / "p.jsonl", [
        {"id": "hi", "messages": [{"role": "user", "content": "Say hello in one word."},
                                  {"role": "assistant", "content": "ignored"},
                                  {"role": "user", "content": "Now in French."}]}])
    cfg = load_config(None, [f"data.sources=[{prompts}]", f"run.output_dir={tmp_path / 'out'}",
                             "data.held_out_fraction=0.0", "generation.max_new_tokens=40",
                             "generation.backend=hf"])  # vLLM's rows: test_vllm_backend.py
    run_distill(cfg, Accelerator(cpu=True))
    row = load_distilled(tmp_path / "out")["train"][0]
    messages = json.loads(row["messages"])
    assert tok.decode(row["input_ids"]) == render_text(tok, messages, False)
    masked = tok.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m])
    expected = "".join(m["content"] + ("<|im_end|>" if reason == "stop" else "")
                       for m, reason in zip([m for m in messages if m["role"] == "assistant"],
                                            row["finish_reasons"]))
    assert masked == expected and row["num_turns"] == 2
    assert "stop" in row["finish_reasons"]  # the real target ends a short answer itself
