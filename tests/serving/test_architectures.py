"""Integration tier: targets of every architecture of assets/tiny.py, in real vLLM, one draft
kind each. For each, a tiny random-weight instance writes stage-1 data, a draft is trained on
it, exported, and validated greedy in vLLM: same tau and alpha_k as our engine, texts
unchanged, drafts accepted. The kind is the one the real recipes train, EAGLE-3, where vLLM
serves it for the architecture, else Medusa (Gemma-3: no SupportsEagle3; DeepSeek-V3: its MLA
cache pages do not fit an EAGLE-3 head's on CPU). On DeepSeek-V3 vLLM-CPU's own greedy text
changes with the draft where two tokens' logits are 0.015 apart (its MLA verification and
decoding paths round differently, over the 0.01 our tie rule forgives): that case asserts that
vLLM accepts the drafts, that every disagreement with our engine is a text or an acceptance
count that moved, and that such moves happened at recorded near-ties alone (a disagreement with
no near-tie recorded fails); its counts are not held to ours there. The whole matrix (every
architecture x kind x engine, stage 1 in vLLM) is `python -m benchmarks.architecture_matrix`'s
job (docs/architectures.md); the refusals it found are in tests/recipe/test_real_recipes.py."""

from __future__ import annotations

import json

import pytest

from recipe import load_config
from tests.helpers import chat_records, recipe_path, reset_accelerate, write_jsonl

pytestmark = pytest.mark.integration

CASES = [("llama3", "eagle3", []),
         ("qwen2.5", "eagle3", []),
         ("qwen3", "eagle3", []),
         ("qwen3-moe", "eagle3", []),
         ("mistral", "eagle3", []),
         ("gemma3", "medusa", []),
         ("gpt-oss", "eagle3", ["train.max_steps=120"]),  # its varied text takes longer to fit
         ("deepseek-v3", "medusa", [])]
VLLM_NEAR_TIES = {"deepseek-v3": 0.05}
"""Architecture -> the logit gap under which vLLM-CPU's texts may move: its MLA computes the
target a little differently from run to run, so its text with the draft can leave its text
without it, and the drafts it proposes can differ, where two candidates are that close. There
the counts are not held to ours (docs/architectures.md: DeepSeek-V3 is not validated)."""
TINY = ["data.max_prompts=null", "data.max_prompt_tokens=null", "data.held_out_fraction=0.1",
        "generation.max_new_tokens=32", "generation.backend=hf", "train.max_steps=40",
        "train.save_every=40", "train.eval_every=40", "train.micro_batch_size=4",
        "train.mixed_precision=no", "train.target_features=online", "eval.num_prompts=3",
        "eval.max_new_tokens=24"]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("arch") / "prompts.jsonl", chat_records(32))


@pytest.mark.parametrize(("architecture", "kind", "overrides"), CASES,
                         ids=[a for a, _, _ in CASES])
def test_vllm_serves_a_draft_for_a_target_of_this_architecture_as_our_engine_does(
        architecture, kind, overrides, prompts, smollm2_tokenizer, tmp_path):
    from accelerate import Accelerator

    from assets.tiny import build_tiny_target
    from distill import run_distill
    from drafts import check_target_config, check_train_config
    from serving.engines import check_target_served
    from serving.engines.vllm import VLLM
    from serving.export import export_draft
    from serving.validate import results_path, validate
    from train import train_draft

    target = build_tiny_target(architecture, tmp_path / "target", tokenizer=smollm2_tokenizer)
    recipe, draft = {"eagle3": ("smollm2-135m-eagle3", []),
                     "medusa": ("smollm2-135m-medusa", [])}[kind]
    cfg = load_config(recipe_path(recipe), [f"model.target={target}", f"data.sources=[{prompts}]",
                                            f"run.output_dir={tmp_path / 'run'}", *TINY, *draft,
                                            *overrides])
    checked = check_train_config(cfg.train)
    check_target_config(cfg, checked)
    check_target_served(cfg, checked)
    run_distill(cfg, Accelerator(cpu=True))
    reset_accelerate()
    train_draft(cfg, Accelerator(cpu=True))
    exported = export_draft(cfg, cfg.eval.k)
    engine = VLLM(enforce_eager=True)
    result = validate(cfg, engine, exported.folder)
    assert result.tau_ours > 1.1, result.tau_ours  # drafts accepted, so agreement means something
    if architecture in VLLM_NEAR_TIES and not result.ok:
        report = json.loads(results_path(cfg, engine).read_text())
        gaps = [d["logit_gap"] for d in report["text_differences"]
                + report["left_our_engine_text"] if d["logit_gap"] is not None]
        assert result.tau_engine > 1.1, result.tau_engine  # vLLM serves and accepts the drafts
        assert not [f for f in result.failures if not f.startswith((
            "vLLM's greedy texts with the draft differ", "where: ", "vLLM's tau",
            "per-position acceptance"))], result.failures
        assert gaps, ("vLLM disagrees with our engine, and no near-tie was recorded to explain "
                      f"it: {result.failures}")
        assert max(gaps) < VLLM_NEAR_TIES[architecture], gaps  # near ties only
        return
    assert result.ok, (result.tau_ours, result.tau_engine, result.failures)
    assert result.identical_engine_texts == result.prompts == 3
