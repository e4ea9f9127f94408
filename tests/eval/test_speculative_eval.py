"""The eval command end to end on a tiny target with SmolLM2's tokenizer."""

import json

import pytest
import torch

from decoding.acceptance import measured_acceptance as acceptance
from decoding.engine import RequestStats
from drafts.independent import layer_truncated
from eval.speculative import compare, evaluate
from recipe import ConfigError, load_config
from tests.helpers import (
    chat_records,
    greedy_lm_proposer,
    reference_tau,
    save_tiny_llama,
    tiny_llama,
    write_jsonl,
)


@pytest.fixture(scope="module")
def peaked_target(tmp_path_factory, smollm2_tokenizer):
    """2 layers, 64 dims, peaked logits (no near-ties for greedy argmax)."""
    return save_tiny_llama(tmp_path_factory.mktemp("peaked"), smollm2_tokenizer, context=512,
                           bos_token_id=1, eos_token_id=2, pad_token_id=2,
                           tie_word_embeddings=True)


def _cfg(target, tmp_path, *extra):
    prompts = write_jsonl(tmp_path / "p.jsonl", chat_records(3))
    return load_config(None, [f"model.target={target}", f"run.output_dir={tmp_path / 'run'}",
                              f"eval.prompts={prompts}", "eval.max_new_tokens=12", *extra])


@pytest.mark.slow  # a whole eval run: every method, interleaved rounds
def test_eval_reports_every_method_and_stays_lossless(peaked_target, tmp_path):
    cfg = _cfg(peaked_target, tmp_path, "eval.draft=self", "eval.k=3")
    report = evaluate(cfg, torch.device("cpu"))
    methods = report["methods"]
    assert list(methods) == ["target", "hf_generate", "speculative", "hf_assisted",
                             "prompt_lookup"]
    for name in ("hf_generate", "speculative", "hf_assisted", "prompt_lookup"):
        assert methods[name]["identical_to_target"] == 3, name
    assert methods["speculative"]["tau"] == pytest.approx(4.0)  # self-draft: k+1
    assert methods["speculative"]["alpha"] == [1.0, 1.0, 1.0]
    out = tmp_path / "run" / "eval"
    assert json.loads((out / "results.json").read_text())["draft"] == "target as its own draft"
    assert "| speculative | 4.00 |" in (out / "report.md").read_text()
    assert (out / "alpha_k.png").stat().st_size > 0 and (out / "throughput.png").is_file()


@pytest.mark.slow  # a whole eval run: every method, interleaved rounds
def test_layer_truncated_draft_and_compare(peaked_target, tmp_path, capsys):
    cfg = _cfg(peaked_target, tmp_path, "eval.draft=layer-truncated:1",
               "eval.methods=[target, speculative]")
    report = evaluate(cfg, torch.device("cpu"))
    spec = report["methods"]["speculative"]
    assert spec["identical_to_target"] == 3
    assert spec["tau"] == pytest.approx(reference_tau(cfg, lambda target: greedy_lm_proposer(layer_truncated(target, 1))))
    result = compare(cfg, "Hello there", torch.device("cpu"))
    assert result["identical"] and "texts are identical" in capsys.readouterr().out


def test_drafts_on_int4_weights_are_measured_lossless(peaked_target, tmp_path):
    """eval.draft_weights=int4 drafts on int4 weights (an EAGLE-3 head, and an independent draft
    beside it): the report says so, greedy output is still the target's; a kind that cannot is
    refused before anything generates."""
    from transformers import AutoModelForCausalLM

    from drafts.eagle3 import Eagle3Head

    target = AutoModelForCausalLM.from_pretrained(peaked_target)
    Eagle3Head.from_target(target, [0, 1, 1], torch.arange(0, target.config.vocab_size, 3)
                           ).save_pretrained(tmp_path / "head")
    cfg = _cfg(peaked_target, tmp_path, f"eval.draft={tmp_path / 'head'}", "eval.k=3",
               "eval.draft_weights=int4", "eval.methods=[target, speculative]",
               "eval.compare_drafts=[layer-truncated:1]")
    report = evaluate(cfg, torch.device("cpu"))
    assert report["draft"].endswith("on int4 weights")
    assert report["methods"]["speculative"]["identical_to_target"] == 3
    assert report["methods"]["speculative:layer-truncated:1"]["identical_to_target"] == 3
    with pytest.raises(ConfigError, match="prompt-lookup draft, and only eagle3, dspark, dflash, pard, "
                                          "independent drafts run on quantised weights: set "
                                          "eval.draft_weights=model"):
        evaluate(_cfg(peaked_target, tmp_path, "eval.draft=prompt-lookup",
                      "eval.draft_weights=int4"), torch.device("cpu"))
    written = json.loads((tmp_path / "run" / "eval" / "results.json").read_text())
    assert written["draft"] == report["draft"]  # the refused run wrote nothing over it


def test_tree_and_hybrid_modes_are_measured_as_their_own_methods(peaked_target, tmp_path):
    cfg = _cfg(peaked_target, tmp_path, "eval.draft=layer-truncated:1", "eval.k=3",
               "eval.methods=[target, speculative, prompt_lookup]",
               "eval.modes=[chain, tree, hybrid]", "eval.tree_width=2")
    report = evaluate(cfg, torch.device("cpu"))
    methods = report["methods"]
    assert list(methods) == ["target", "speculative", "speculative+tree", "speculative+hybrid",
                             "prompt_lookup"]
    for name in ("speculative+tree", "speculative+hybrid"):
        assert methods[name]["identical_to_target"] == 3, name
    # a tree holds the chain: it accepts at least as much, here more through alternatives
    assert methods["speculative+tree"]["tau"] >= methods["speculative"]["tau"]
    assert methods["speculative+tree"]["accepted_alternative"] > 0
    text = (tmp_path / "run" / "eval" / "report.md").read_text()
    assert "the chain plus 2 alternatives per draft position" in text


@pytest.mark.parametrize("override,message", [
    ("eval.modes=[chain, forest]", "eval.modes"), ("eval.tree=true", "eval.modes"),
    ("eval.tree_width=0", "tree_width")])
def test_bad_tree_settings_are_refused(peaked_target, tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(peaked_target, tmp_path, "eval.draft=self", override)


def test_draft_with_another_vocabulary_is_refused_before_generation(peaked_target, tmp_path):

    from drafts.independent import VocabMismatchError

    other = tmp_path / "other"
    tiny_llama(1000, layers=1, hidden=32, heads=2, kv_heads=1).save_pretrained(other)
    with pytest.raises(VocabMismatchError, match="1000 tokens"):
        evaluate(_cfg(peaked_target, tmp_path, f"eval.draft={other}"), torch.device("cpu"))


def test_acceptance_pools_requests():
    a = RequestStats(steps=4, drafted=8, accepted=5, drafted_per_position=[4, 4],
                     accepted_per_position=[3, 2])
    b = RequestStats(steps=2, drafted=4, accepted=0, drafted_per_position=[2, 2],
                     accepted_per_position=[0, 0])
    tau, alpha, rate = acceptance([a, b])
    assert tau == pytest.approx(1 + 5 / 6) and alpha == [0.5, 2 / 6] and rate == 5 / 12


@pytest.fixture
def medusa_folder(peaked_target, tmp_path):
    from transformers import AutoModelForCausalLM

    from drafts.medusa import MedusaHeads

    torch.manual_seed(1)
    target = AutoModelForCausalLM.from_pretrained(peaked_target)
    heads = MedusaHeads.from_target(target, num_heads=3, num_layers=1)
    for block in heads.blocks:  # not the identity, so the heads really differ from the target
        torch.nn.init.normal_(block.layers[0].weight, std=0.05)
    folder = tmp_path / "medusa"
    heads.save_pretrained(folder)
    return folder


@pytest.mark.slow  # a whole eval run: every method, interleaved rounds
def test_medusa_heads_and_an_independent_draft_in_one_run(peaked_target, medusa_folder,
                                                          tmp_path, capsys):
    cfg = _cfg(peaked_target, tmp_path, f"eval.draft={medusa_folder}", "eval.k=3",
               "eval.compare_drafts=[layer-truncated:1]", "eval.modes=[chain,tree]",
               "eval.tree_width=2", "eval.tree_paths=[[0],[1],[0,0],[0,1],[1,0],[0,0,0]]")
    report = evaluate(cfg, torch.device("cpu"))
    methods = report["methods"]
    assert "hf_assisted" not in methods and "hf_assisted skipped" in capsys.readouterr().out
    for name in ("speculative", "speculative:layer-truncated:1", "speculative+tree"):
        assert methods[name]["identical_to_target"] == 3, name
        assert len(methods[name]["alpha"]) == 3, name
    assert methods["speculative:layer-truncated:1"]["tau"] == pytest.approx(
        reference_tau(cfg, lambda target: greedy_lm_proposer(layer_truncated(target, 1))))
    assert methods["speculative+tree"]["tau"] >= methods["speculative"]["tau"]
    assert "Medusa, 3 heads" in report["draft"]
    assert "the static tree [[0], [1]" in (tmp_path / "run" / "eval" / "report.md").read_text()


def test_more_draft_tokens_than_medusa_heads_is_refused_before_generation(
        peaked_target, medusa_folder, tmp_path):
    from recipe import ConfigError

    with pytest.raises(ConfigError, match="eval.k=4 draft tokens, but .* has 3 heads"):
        evaluate(_cfg(peaked_target, tmp_path, f"eval.draft={medusa_folder}", "eval.k=4"),
                 torch.device("cpu"))
    with pytest.raises(ConfigError, match="tree_paths reach depth 4, but .* has 3 heads"):
        evaluate(_cfg(peaked_target, tmp_path, f"eval.draft={medusa_folder}", "eval.k=4",
                      "eval.modes=[tree]", "eval.tree_paths=[[0],[0,0],[0,0,0],[0,0,0,0]]"),
                 torch.device("cpu"))


def test_medusa_heads_of_another_target_are_refused(peaked_target, tmp_path):
    from drafts.medusa import MedusaHeads
    from recipe import ConfigError

    folder = tmp_path / "wrong"
    MedusaHeads(32, 1000, num_heads=2).save_pretrained(folder)
    with pytest.raises(ConfigError, match="heads only work on the target they were trained on"):
        evaluate(_cfg(peaked_target, tmp_path, f"eval.draft={folder}", "eval.k=2"),
                 torch.device("cpu"))


@pytest.mark.slow  # a whole eval run: every method, interleaved rounds
def test_a_seeded_sampling_eval_repeats_exactly(peaked_target, tmp_path):
    """Every method, transformers' included, at T > 0 with top-p and top-k: the same seed gives
    the same texts, and another seed other texts."""
    def texts(seed):
        cfg = _cfg(peaked_target, tmp_path, "eval.draft=layer-truncated:1", "eval.k=3",
                   "eval.temperature=0.8", "eval.top_p=0.9", "eval.top_k=20", f"run.seed={seed}")
        report = evaluate(cfg, torch.device("cpu"))
        assert set(report["methods"]) == {"target", "hf_generate", "speculative",
                                          "hf_assisted", "prompt_lookup"}
        return {name: r["texts"] for name, r in report["methods"].items()}

    first = texts(0)
    torch.manual_seed(123)  # whatever ran before must not matter
    assert texts(0) == first
    assert texts(1) != first
