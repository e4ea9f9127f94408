"""The DSpark drafter: the Markov head trained on what it serves, the confidence head's loss,
lossless decoding with and without adaptive verification, its folder in vLLM's layout."""

from __future__ import annotations

import json

import pytest
import torch

from decoding.engine import generate
from decoding.steps import confident_prefix
from drafts import registry
from drafts.dspark import DSpark, DSparkDraft, DSparkForTraining, DSparkHead
from recipe import ConfigError, DecodeSettings, TrainConfig
from recipe.config import DSparkConfig
from tests.helpers import assert_same_state, target_hidden_of, tiny_llama

VOCAB, MASK, K, RANK = 50, 7, 3, 8


@pytest.fixture(scope="module")
def target():
    return tiny_llama(VOCAB, seed=0, layers=4, hidden=32, context=128)


def _head(target, seed=1, scale=0.3):
    torch.manual_seed(seed)
    head = DSparkHead.from_target(target, [1, 2, 3], 2, mask_token_id=MASK, block_size=K,
                                  markov_rank=RANK)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, scale)
    return head.eval()


@pytest.fixture(scope="module")
def dspark(target):
    return _head(target)


class _Greedy:
    temperature, top_p, top_k = 0.0, 1.0, 0


def test_a_fresh_dspark_drafter_starts_as_the_dflash_drafter_it_extends(target):
    """The Markov projection and the confidence head start at zero: no bias, confidence 0.5."""
    head = DSparkHead.from_target(target, [1, 2, 3], 1, mask_token_id=MASK, block_size=K,
                                  markov_rank=RANK)
    base, hidden = torch.randn(4, VOCAB), torch.randn(4, 32)
    logits, confidence = head.markov(base, hidden, torch.tensor([3, 9, 11, 40]))
    assert torch.equal(logits, base) and torch.equal(confidence, torch.zeros(4))
    assert head.markov_head.markov_w1.weight.std() > 0  # else w2 would get no gradient


def test_dspark_trains_on_exactly_what_it_serves(target, dspark):
    """The engine's greedy proposal after a prompt, written into the data after it: the
    training forward's rows for that block (teacher-forced on those very tokens) are the
    logits and confidences the engine drew them from."""
    torch.manual_seed(2)
    prompt = torch.randint(8, VOCAB, (1, 7))  # x_0..x_5, x_6 pending
    draft = DSparkDraft(dspark, target.get_input_embeddings())
    with torch.no_grad():
        states = target(prompt[:, :6], output_hidden_states=True).hidden_states
        draft.start(prompt[:, :6], torch.ones_like(prompt[:, :6]), prompt[:, 6], states)
        tokens, _ = draft.propose(K, _Greedy, None)
    ids = torch.cat([prompt, tokens, torch.randint(8, VOCAB, (1, 2))], 1)  # [1, 12]
    pred = torch.zeros_like(ids, dtype=torch.bool)
    pred[0, 3:] = True
    wrapped = DSparkForTraining(dspark, 0.8, 0, confidence_weight=1.0)
    with torch.no_grad():
        logits = wrapped(ids, torch.ones_like(ids), pred, target_hidden_of(target, ids, dspark.aux_layers))
    runs = wrapped.loss_rows(pred)
    offset = 0
    for j, run in enumerate(runs):
        i = (run.starts[:, 1] == 5).nonzero()[0, 0]  # the block after x_5 (x_6 its anchor)
        torch.testing.assert_close(logits[offset + i], draft.scores[0, j], atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.sigmoid(wrapped.confidence[offset + i]),
                                   draft.confidence[0, j], atol=1e-5, rtol=0)
        offset += run.count


def test_the_confidence_loss_is_the_cross_entropy_against_greedy_acceptance(target, dspark):
    wrapped = DSparkForTraining(dspark, 0.8, 0, confidence_weight=0.5)
    wrapped.confidence = torch.tensor([2.0, -1.0, 0.0])
    q = [torch.tensor([[0.0, 3.0], [5.0, 1.0]]), torch.tensor([[1.0, 0.0]])]
    p = [torch.tensor([[0.0, 1.0], [0.0, 1.0]]), torch.tensor([[2.0, 0.0]])]
    # accepted: 1, 0, 1 -> softplus(-2) + softplus(-1) + softplus(0), halved
    want = 0.5 * sum(torch.nn.functional.softplus(torch.tensor(x)) for x in (-2.0, -1.0, 0.0))
    torch.testing.assert_close(wrapped.auxiliary_loss(q, p), want)


def test_confident_prefix_verifies_up_to_the_first_doubt_of_the_most_confident_row():
    confidence = torch.tensor([[0.9, 0.8, 0.2, 0.9], [0.9, 0.3, 0.9, 0.9]])
    assert confident_prefix(confidence, 0.5) == 2  # row 0: 2 tokens, row 1: 1
    assert confident_prefix(confidence, 0.95) == 0
    assert confident_prefix(confidence, 0.1) == 4


@pytest.mark.parametrize("confidence_min", [0.0, 0.5])
@pytest.mark.parametrize("seed", [1, 4])
def test_dspark_decoding_is_lossless_with_and_without_adaptive_verification(target, seed,
                                                                            confidence_min):
    """Greedy output equals plain decoding's, in a batch and for one prompt alone; with
    confidence_min some steps of the single prompt verify fewer than k tokens (the confidence
    head's weights are wide random ones, so its estimates straddle 0.5; a batch verifies the longest run
    any row wants)."""
    torch.manual_seed(3)
    ids = torch.randint(8, VOCAB, (3, 9))
    attention = torch.ones_like(ids)
    attention[0, :4] = 0  # left padding
    settings = DecodeSettings(max_new_tokens=24, k=K, confidence_min=confidence_min)
    head = _head(target, seed)
    with torch.no_grad():
        head.confidence_head.proj.weight.normal_(0, 2.0)
        head.confidence_head.proj.bias.zero_()
    draft = DSparkDraft(head, target.get_input_embeddings())
    plain = generate(target, ids, attention, DecodeSettings(max_new_tokens=24, k=K), set())
    spec = generate(target, ids, attention, settings, set(), draft)
    assert spec.tokens == plain.tokens
    one = generate(target, ids[1:2], attention[1:2], settings, set(), draft)
    assert one.tokens == plain.tokens[1:2]
    if confidence_min:
        assert 0 < min(one.k_used) < K or 0 == min(one.k_used) < max(one.k_used), one.k_used
        assert one.stats[0].drafted == sum(one.k_used) < K * one.stats[0].steps


def test_adaptive_verification_is_refused_for_a_draft_without_a_confidence_head(target):
    from drafts.dflash import DFlashDraft, DFlashHead

    head = DFlashHead.from_target(target, [1, 2, 3], 1, mask_token_id=MASK, block_size=K)
    ids = torch.randint(8, VOCAB, (1, 5))
    with pytest.raises(ValueError, match="no confidence head to verify by"):
        generate(target, ids, torch.ones_like(ids),
                 DecodeSettings(max_new_tokens=4, k=K, confidence_min=0.5), set(),
                 DFlashDraft(head.eval(), target.get_input_embeddings()))
    with pytest.raises(ConfigError, match=r"confidence_min=1.0 must be in \[0, 1\)"):
        DecodeSettings(confidence_min=1.0)


def test_a_saved_dspark_drafter_loads_as_it_was_in_vllms_layout(tmp_path, target, dspark):
    dspark.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"]
    assert (config["markov_rank"], config["sample_from_anchor"],
            config["enable_confidence_head"], config["confidence_head_with_markov"]) == (
        RANK, False, True, True)
    assert config["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": [0, 1, 2]}
    assert registry.kind_of(tmp_path).name == "dspark"
    loaded = DSpark().load(str(tmp_path), target, None, torch.float32, torch.device("cpu"))
    assert loaded.max_k == K
    assert_same_state(loaded.model.head.state_dict(), dspark.state_dict())
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    # vLLM's Qwen3DSparkForCausalLM.load_weights prefixes these with "model."
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
            "confidence_head.proj.weight", "confidence_head.proj.bias", "fc.weight"} <= names
    config["sample_from_anchor"] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="sample_from_anchor false"):
        DSparkHead.from_pretrained(tmp_path)


def test_dspark_settings_are_checked_and_its_keys_belong_to_it():
    kind = registry.check_train_config(TrainConfig(draft="dspark:2", loss="fkl", eval_k=4))
    assert kind.name == "dspark"
    with pytest.raises(ConfigError, match="train.dspark.markov_rank=0 must be >= 1"):
        registry.check_train_config(TrainConfig(draft="dspark", dspark=DSparkConfig(
            markov_rank=0), eval_k=4))
    with pytest.raises(ConfigError, match="read by \\['dspark'\\] drafts only"):
        registry.check_train_config(TrainConfig(draft="dflash", dspark=DSparkConfig(
            markov_rank=16), eval_k=4))
    with pytest.raises(ConfigError, match="write 'dspark' or 'dspark:<layers>'"):
        registry.check_train_config(TrainConfig(draft="dspark:x", eval_k=4))
