"""Stage-1 data from the tiny target, written once per session and copied into each test."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from recipe import load_config
from tests.helpers import chat_records, recipe_path, write_jsonl


def tiny_overrides(tiny_target: Path, prompts: Path, out: Path) -> list[str]:
    return [f"model.target={tiny_target}", f"data.sources=[{prompts}]", f"run.output_dir={out}",
            "data.max_prompts=null", "data.max_prompt_tokens=null", "data.held_out_fraction=0.25",
            "generation.max_new_tokens=24", "generation.top_k_logprobs=8", "generation.backend=hf",
            "train.draft=layer-truncated:1",
            "train.micro_batch_size=2", "train.gradient_accumulation_steps=2",
            "train.max_steps=6", "train.warmup_steps=1", "train.learning_rate=3e-3",
            "train.save_every=3", "train.eval_every=3", "train.eval_k=3",
            "train.mixed_precision=no"]


@pytest.fixture(scope="session")
def tiny_stage1(tiny_target, tmp_path_factory) -> tuple[Path, Path]:
    """(prompts file, a run folder holding complete stage-1 data of 16 conversations)."""
    from accelerate import Accelerator

    from distill import run_distill

    root = tmp_path_factory.mktemp("tiny_stage1")
    prompts = write_jsonl(root / "prompts.jsonl", chat_records(16))
    out = root / "run"
    run_distill(load_config(recipe_path("smollm2-135m-independent"),
                            tiny_overrides(tiny_target, prompts, out)), Accelerator(cpu=True))
    _reset_accelerate()
    return prompts, out


@pytest.fixture
def tiny_run(tiny_target, tiny_stage1, tmp_path):
    """-> function(*overrides) giving a Config whose run folder holds a copy of the data."""
    prompts, source = tiny_stage1
    out = tmp_path / "run"
    shutil.copytree(source, out)

    def make(*overrides: str):
        return load_config(recipe_path("smollm2-135m-independent"),
                           tiny_overrides(tiny_target, prompts, out) + list(overrides))
    return make


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each test builds its own Accelerator; accelerate keeps process-wide singletons."""
    yield
    _reset_accelerate()


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
