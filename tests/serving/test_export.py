"""Export: the folder vLLM loads, the method written out, bad drafts refused before writing."""

import json

import pytest
import torch

from drafts.medusa import MedusaHeads
from recipe import ConfigError, load_config
from serving.export import export_draft
from tests.helpers import assert_same_state, tiny_llama


def _cfg(tiny_target, tmp_path):
    return load_config(None, [f"model.target={tiny_target}", f"run.output_dir={tmp_path / 'run'}"])


def _heads(tiny_target, folder, num_heads=3):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_target)
    MedusaHeads.from_target(target, num_heads=num_heads).save_pretrained(folder)
    return folder


def test_medusa_export_writes_vllm_layout_and_the_method(tiny_target, tmp_path):
    draft = _heads(tiny_target, tmp_path / "run" / "train" / "draft")
    result = export_draft(_cfg(tiny_target, tmp_path), k=2)
    assert result.folder == tmp_path / "run" / "export" / "medusa"
    config = json.loads((result.folder / "config.json").read_text())
    assert config["model_type"] == "medusa" and config["num_heads"] == 3
    speculative = json.loads((result.folder / "vllm_speculative_config.json").read_text())
    assert speculative == {"method": "medusa", "model": str(result.folder.resolve()),
                           "num_speculative_tokens": 2}
    assert '"method": "medusa"' in result.command and str(tiny_target) in result.command
    assert (result.folder / "config.yaml").is_file()
    card = (result.folder / "README.md").read_text()
    assert result.command in card and "Not measured yet" in card
    assert not (result.folder / "eval_results.json").exists()
    reloaded = MedusaHeads.from_pretrained(result.folder)
    original = MedusaHeads.from_pretrained(draft)
    assert_same_state(reloaded.state_dict(), original.state_dict())


def test_more_tokens_than_heads_is_refused_and_nothing_is_written(tiny_target, tmp_path):
    _heads(tiny_target, tmp_path / "run" / "train" / "draft", num_heads=2)
    with pytest.raises(ConfigError, match="uninitialised weights. Export with --k <= 2"):
        export_draft(_cfg(tiny_target, tmp_path), k=3)
    assert not (tmp_path / "run" / "export").exists()


def test_heads_or_drafts_for_another_target_are_refused(tiny_target, tmp_path):

    MedusaHeads(32, 1000, num_heads=2).save_pretrained(tmp_path / "heads")
    with pytest.raises(ConfigError, match="hidden size 32 and predict 1000 tokens"):
        export_draft(_cfg(tiny_target, tmp_path), k=2, draft_folder=tmp_path / "heads")
    tiny_llama(1000, layers=1, hidden=32, heads=2, kv_heads=1).save_pretrained(tmp_path / "lm")
    with pytest.raises(ConfigError, match="1000 tokens, the target's"):
        export_draft(_cfg(tiny_target, tmp_path), k=2, draft_folder=tmp_path / "lm")
    with pytest.raises(ConfigError, match="holds no trained draft"):
        export_draft(_cfg(tiny_target, tmp_path), k=2)


def test_heads_sharing_the_targets_lm_head_are_exported_once_and_compute_the_same(
        tiny_target, tmp_path):
    from safetensors import safe_open

    draft = _heads(tiny_target, tmp_path / "run" / "train" / "draft")  # lm_heads = target's
    separate = MedusaHeads.from_pretrained(draft)
    assert separate.shared_lm_head  # found identical on load
    result = export_draft(_cfg(tiny_target, tmp_path), k=3)
    config = json.loads((result.folder / "config.json").read_text())
    assert config["original_lm_head"] is True and config["num_heads"] == 3
    with safe_open(str(result.folder / "model.safetensors"), "pt") as f:
        assert sorted(k for k in f.keys() if k.startswith("lm_heads")) == ["lm_heads.0.weight"]
    shared = MedusaHeads.from_pretrained(result.folder)
    torch.manual_seed(0)
    for block in shared.blocks:
        torch.nn.init.normal_(block.layers[0].weight, std=0.1)
    unshared = MedusaHeads(shared.hidden_size, shared.vocab_size, 3)
    unshared.blocks.load_state_dict(shared.blocks.state_dict())
    for head in unshared.lm_heads:
        head.weight.data.copy_(shared.lm_heads[0].weight)
    hidden = torch.randn(5, shared.hidden_size)
    torch.testing.assert_close(shared(hidden), unshared(hidden))
    torch.testing.assert_close(shared.head_logits(2, hidden), unshared.head_logits(2, hidden))


def test_the_model_card_carries_the_measured_eval_of_this_draft(tiny_target, tmp_path):
    from eval.speculative import evaluate
    from tests.helpers import chat_records, write_jsonl

    _heads(tiny_target, tmp_path / "run" / "train" / "draft", num_heads=2)
    prompts = write_jsonl(tmp_path / "p.jsonl", chat_records(2))
    cfg = load_config(None, [f"model.target={tiny_target}", f"run.output_dir={tmp_path / 'run'}",
                             "eval.draft=trained", f"eval.prompts={prompts}", "eval.k=2",
                             "eval.max_new_tokens=6", "eval.methods=[target, speculative]"])
    report = evaluate(cfg, torch.device("cpu"))
    result = export_draft(cfg, k=2)
    card = (result.folder / "README.md").read_text()
    tau = report["methods"]["speculative"]["tau"]
    assert f"| speculative | {tau:.2f} |" in card and "| target | - |" in card
    speed = report["methods"]["speculative"]["speed"]
    assert (f"{speed['median']:.2f}x ({speed['q25']:.2f}-{speed['q75']:.2f}, {speed['verdict']})"
            in card), "the card's speedup lacks its quartiles and verdict"
    assert ((result.folder / "eval_results.json").read_text()
            == (tmp_path / "run" / "eval" / "results.json").read_text())
    assert card.startswith("---\nbase_model: ") and "train.draft=medusa" not in card


def _eagle3(tiny_target, folder, aux=(0, 1, 1), vocab=300):
    from transformers import AutoModelForCausalLM

    from drafts.eagle3 import Eagle3Head

    target = AutoModelForCausalLM.from_pretrained(tiny_target)
    ids = torch.arange(0, 3 * vocab, 3)  # every third target token
    head = Eagle3Head.from_target(target, list(aux), ids)
    head.save_pretrained(folder)
    return head


def test_eagle3_export_writes_vllm_native_layout(tiny_target, tmp_path):
    from safetensors.torch import load_file

    from drafts.eagle3 import Eagle3Head

    head = _eagle3(tiny_target, tmp_path / "run" / "train" / "draft")
    result = export_draft(_cfg(tiny_target, tmp_path), k=3)
    assert result.folder == tmp_path / "run" / "export" / "eagle3" and result.method == "eagle3"
    config = json.loads((result.folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 1
    assert config["norm_before_residual"] is False and config["draft_vocab_size"] == 300
    assert config["tie_word_embeddings"] is False and config["hidden_size"] == 64
    # non-default aux layers for a 2-layer target: written where vLLM reads them
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 1]
    weights = load_file(str(result.folder / "model.safetensors"))
    assert weights["fc.weight"].shape == (64, 192)
    assert weights["midlayer.self_attn.q_proj.weight"].shape == (64, 128)
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
    assert not any(name.startswith(("model.", "rotary", "embed_tokens")) for name in weights)
    speculative = json.loads((result.folder / "vllm_speculative_config.json").read_text())
    assert speculative["method"] == "eagle3" and speculative["num_speculative_tokens"] == 3
    assert_same_state(Eagle3Head.from_pretrained(result.folder).state_dict(), head.state_dict())


def test_default_aux_layers_are_not_written(smollm2_tokenizer, tmp_path):

    from drafts.eagle3 import Eagle3Head

    target = tiny_llama(500, layers=8, hidden=32, heads=2, kv_heads=1)
    head = Eagle3Head.from_target(target, [2, 4, 5], torch.arange(100))
    config = head.config_dict()
    assert "eagle_aux_hidden_state_layer_ids" not in json.dumps(
        {k: v for k, v in config.items() if k != "draftsmith"})
    assert config["draftsmith"]["aux_layers"] == [2, 4, 5]


def test_eagle3_speculators_format(tiny_target, tmp_path):
    from safetensors.torch import load_file

    _eagle3(tiny_target, tmp_path / "run" / "train" / "draft")
    result = export_draft(_cfg(tiny_target, tmp_path), k=2, fmt="speculators")
    assert result.folder.name == "eagle3-speculators"
    config = json.loads((result.folder / "config.json").read_text())
    assert "model_type" not in config and config["speculators_model_type"] == "eagle3"
    assert config["norm_before_residual"] is False
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1
    weights = load_file(str(result.folder / "model.safetensors"))
    assert "layers.0.self_attn.q_proj.weight" in weights
    assert not any(name.startswith("midlayer.") for name in weights)
    # vLLM's own parser reads the folder (a missing vLLM fails here: install.sh installs it)
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    parsed = SpeculatorsConfig.extract_transformers_pre_trained_config(config)
    assert parsed["architectures"] == ["Eagle3LlamaForCausalLM"]
    assert parsed["norm_before_residual"] is False and parsed["draft_vocab_size"] == 300
    assert SpeculatorsConfig.extract_vllm_speculative_config(config) == {
        "method": "eagle3", "num_speculative_tokens": 2}


def test_a_head_whose_d2t_mismatches_t2d_is_neither_exported_nor_validated(tiny_target,
                                                                            tmp_path):
    from safetensors.torch import load_file, save_file

    from serving.validate import validate

    draft = tmp_path / "run" / "train" / "draft"
    _eagle3(tiny_target, draft)
    cfg = _cfg(tiny_target, tmp_path)
    exported = export_draft(cfg, k=2)
    for folder in (draft, exported.folder):
        weights = load_file(str(folder / "model.safetensors"))
        weights["d2t"][5] += 1  # one draft token now means another word
        save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ConfigError, match="does not map onto"):
        validate(cfg, "vllm", exported.folder)  # refused before vLLM starts
    with pytest.raises(ConfigError, match="does not map onto"):
        export_draft(cfg, k=2, out=tmp_path / "again")
    assert not (tmp_path / "again").exists()


def test_the_chat_mode_the_draft_learned_in_is_in_every_vllm_command(tiny_target, tmp_path):
    from serving.engines.vllm import VLLM

    _heads(tiny_target, tmp_path / "run" / "train" / "draft")
    cfg = load_config(None, [f"model.target={tiny_target}", f"run.output_dir={tmp_path / 'run'}",
                             "model.chat_template_kwargs={enable_thinking: false}"])
    result = export_draft(cfg, k=2)
    mode = """--default-chat-template-kwargs '{"enable_thinking": false}'"""
    assert result.command.endswith(mode)
    assert mode in (result.folder / "README.md").read_text()
    argv = VLLM().server_argv(cfg, "target", "127.0.0.1", 8000)
    assert argv[argv.index("--default-chat-template-kwargs") + 1] == '{"enable_thinking": false}'
    plain = load_config(None, [f"model.target={tiny_target}", f"run.output_dir={tmp_path / 'run'}"])
    assert "--default-chat-template-kwargs" not in VLLM().server_argv(plain, "t", "h", 1)


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_a_field_the_installed_vllm_would_not_read_is_refused_at_export(tiny_target, tmp_path,
                                                                        fmt):
    """Both EAGLE-3 layouts pass (every field is read by the pinned vLLM); a field vLLM never
    reads, or a top-level field its speculators converter drops, is named."""
    from serving.engines.vllm import check_vllm_reads, unread_fields

    _eagle3(tiny_target, tmp_path / "run" / "train" / "draft")
    result = export_draft(_cfg(tiny_target, tmp_path), k=2, fmt=fmt)  # checked on the way
    config = json.loads((result.folder / "config.json").read_text())
    assert unread_fields(config) == []
    layer = config["transformer_layer_config"] if fmt == "speculators" else config
    layer["norm_before_fcx"] = True  # read nowhere in vLLM
    expected = ["norm_before_fcx"]
    if fmt == "speculators":
        config["fc_norm_scale"] = 2.0  # top level: vLLM's converter does not carry it over
        expected = ["fc_norm_scale", "norm_before_fcx"]
    assert unread_fields(config) == expected
    (result.folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"would not read \['"):
        check_vllm_reads(result.folder)
    # a kind's own fields (PARD's trained positions) are read by us alone
    assert unread_fields({**config, "pard_trained_k": 3}, ours=("pard_trained_k",)) == expected


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_an_eagle31_head_round_trips_and_exports_the_fields_vllm_reads(tiny_target, tmp_path,
                                                                       fmt):
    """fc_norm and norm_output reach config.json (both layouts; the pinned vLLM reads them,
    which the export checks), the per-feature norms reach the weights as vLLM names them
    (model.fc_norm.<i> after its loader's prefix), and the head loads back as it was."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from drafts.eagle3 import Eagle3Head, most_frequent_ids

    target = AutoModelForCausalLM.from_pretrained(tiny_target)
    head = Eagle3Head.from_target(target, [0, 1, 1], most_frequent_ids(torch.ones(
        target.config.vocab_size), 300), fc_norm=True, norm_output=True)
    with torch.no_grad():
        head.fc_norm[1].weight.mul_(2.0)
    folder = tmp_path / "run" / "train" / "draft"
    head.save_pretrained(folder)
    loaded = Eagle3Head.from_pretrained(folder)
    assert loaded.norm_output and torch.equal(loaded.fc_norm[1].weight, head.fc_norm[1].weight)
    result = export_draft(_cfg(tiny_target, tmp_path), k=2, fmt=fmt)
    config = json.loads((result.folder / "config.json").read_text())
    assert config["fc_norm"] is True and config["norm_output"] is True
    state = load_file(str(result.folder / "model.safetensors"))
    assert [f"fc_norm.{i}.weight" in state for i in range(3)] == [True] * 3
    if fmt == "vllm":
        with pytest.raises(ConfigError, match=r"EAGLE 3.1 head \(fc_norm, norm_output\), and "
                                              r"llama.cpp .*reads norm_before_fc alone"):
            export_draft(_cfg(tiny_target, tmp_path), k=2, fmt="gguf")


def test_a_dspark_drafter_exports_in_vllms_layout_and_vllm_on_a_cpu_refuses_to_run_it(
        tiny_target, tmp_path):
    """The folder and the method vLLM 0.32 serves on a GPU (every config field one the pinned
    vLLM reads, which the export checks); on a CPU its V1 runner cannot run the method, which
    a validation run says before starting vLLM."""
    from transformers import AutoModelForCausalLM

    from drafts.dspark import DSparkHead
    from serving.engines.base import Exported
    from serving.engines.vllm import VLLM, gpu_available

    target = AutoModelForCausalLM.from_pretrained(tiny_target)
    head = DSparkHead.from_target(target, [1], 1, mask_token_id=16, block_size=3, markov_rank=8)
    head.save_pretrained(tmp_path / "run" / "train" / "draft")
    cfg = _cfg(tiny_target, tmp_path)
    result = export_draft(cfg, k=3)
    assert result.folder == tmp_path / "run" / "export" / "dspark" and result.method == "dspark"
    config = json.loads((result.folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["markov_rank"] == 8
    assert '"method": "dspark"' in result.command
    with pytest.raises(ConfigError, match="trained to fill blocks of 3 masks"):
        export_draft(cfg, k=4)
    if not gpu_available():
        exported = Exported(result.folder, "dspark", 3, {})
        with pytest.raises(ConfigError, match="V2 model runner alone"):
            VLLM().run(cfg, exported, str(tiny_target), [[1, 2]], cfg.eval, {0}, True)
