"""Integration tier, in real vLLM: an exported independent draft reproduces our engine's
acceptance inside vLLM, and a corrupted export makes the validation fail."""

import pytest
import torch

from recipe import load_config
from serving.export import export_draft
from serving.validate import validate

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def run(tmp_path_factory, smollm2_tokenizer):
    """A run folder whose trained draft is the target's first 28 of 30 layers, exported, k=3."""
    from assets.target import load_target, resolve_target
    from recipe import ModelConfig
    from train.draft_init import layer_truncated

    out = tmp_path_factory.mktemp("validate") / "run"
    target = load_target(resolve_target(ModelConfig()), "float32", torch.device("cpu"))
    draft = out / "train" / "draft"
    layer_truncated(target, 28).save_pretrained(draft)
    smollm2_tokenizer.save_pretrained(draft)
    cfg = load_config("configs/smollm2-135m-independent.yaml", [
        f"run.output_dir={out}", "eval.num_prompts=2", "eval.max_new_tokens=24"])
    return cfg, export_draft(cfg, k=3)


def test_vllm_accepts_what_our_engine_accepts(run):
    cfg, exported = run
    result = validate(cfg, exported.folder, enforce_eager=True)
    assert result.method == "draft_model" and result.k == 3
    assert result.tau_ours > 1.5  # a draft that is often right, so agreement means something
    assert result.ok, (result.tau_ours, result.tau_vllm)
    assert result.identical_vllm_texts == 2 and result.identical_to_our_engine == 2


def test_a_corrupted_export_fails_the_validation(run, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    cfg, exported = run
    broken = tmp_path / "broken"
    shutil.copytree(exported.folder, broken)
    weights = load_file(str(broken / "model.safetensors"))
    # the kind of bug an exporter makes: decoder layers written in the wrong order
    renamed = {}
    for name, tensor in weights.items():
        parts = name.split(".")
        if parts[:2] == ["model", "layers"]:
            parts[2] = str(27 - int(parts[2]))
        renamed[".".join(parts)] = tensor
    save_file(renamed, str(broken / "model.safetensors"), metadata={"format": "pt"})
    result = validate(cfg, broken, enforce_eager=True)
    assert not result.ok and result.tau_vllm < result.tau_ours
    assert result.identical_vllm_texts == 2  # lossless all the same: only the speed suffers
