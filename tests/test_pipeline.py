"""distill.py end to end (every stage that exists) on a tiny target."""

import json
import subprocess
import sys

import pytest

from runfolder import TRAIN_RECORD
from tests.helpers import ROOT, chat_records, recipe_path, write_jsonl

pytestmark = pytest.mark.slow  # launches distill.py / accelerate processes


@pytest.mark.parametrize(("recipe", "draft", "methods"), [
    ("smollm2-135m-independent", "layer-truncated:1", {"target", "speculative", "prompt_lookup"}),
    ("smollm2-135m-medusa", "medusa:2", {"target", "hf_generate", "speculative", "prompt_lookup"}),
    ("smollm2-135m-eagle3", "eagle3", {"target", "hf_generate", "speculative", "prompt_lookup"}),
])
def test_recipe_runs_every_stage(tiny_target, tmp_path, recipe, draft, methods):
    prompts = write_jsonl(tmp_path / "p.jsonl", chat_records(6))
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, str(ROOT / "distill.py"), "--config",
         recipe_path(recipe), f"model.target={tiny_target}",
         f"data.sources=[{prompts}]", f"run.output_dir={out}", "data.max_prompts=null",
         "data.max_prompt_tokens=null", "generation.max_new_tokens=8", "generation.backend=hf",
         f"eval.prompts={prompts}",
         "eval.num_prompts=2",
         "eval.max_new_tokens=8", "data.held_out_fraction=0.34", f"train.draft={draft}",
         "train.max_steps=2", "train.warmup_steps=0", "train.micro_batch_size=2",
         "train.eval_k=2", "eval.k=2",
         *(["train.aux_layers=[0,1,1]", "train.draft_vocab_size=512", "train.eagle3.ttt_steps=2"]
           if draft == "eagle3" else [])],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads((out / "manifest.json").read_text())["status"] == "complete"
    assert (out / "train" / "draft" / TRAIN_RECORD).is_file()
    report = json.loads((out / "eval" / "results.json").read_text())
    assert set(report["methods"]) == methods
    assert "| speculative |" in result.stdout
    speculative = json.loads((next((out / "export").glob("*")) /
                              "vllm_speculative_config.json").read_text())
    assert speculative["num_speculative_tokens"] == 2 and "[export]" in result.stdout
