"""The parallel drafters (DFlash, PARD): block plans and masks, training forward = serving
forward, lossless greedy decoding, bad input refused."""

from __future__ import annotations

import pytest
import torch

from decoding.engine import generate
from drafts.dflash import DFlash, DFlashDraft, DFlashForTraining, DFlashHead
from drafts.dflash.head import check_aux_layers, check_fits_target
from drafts.parallel import (
    block_attention,
    block_plan,
    check_mask_token,
    pard_layout,
    pick_mask_token,
)
from drafts.pard import ParallelModelDraft, PardForTraining
from recipe import ConfigError, DecodeSettings
from tests.helpers import assert_same_state, greedy_chain_counts, target_hidden_of, tiny_llama

VOCAB, MASK, K = 50, 7, 3


def _lm(seed: int, layers: int):
    return tiny_llama(VOCAB, seed=seed, layers=layers, hidden=32, context=128)


@pytest.fixture(scope="module")
def target():
    return _lm(0, layers=4)


@pytest.fixture(scope="module")
def dflash(target):
    torch.manual_seed(1)
    head = DFlashHead.from_target(target, [1, 2, 3], 2, mask_token_id=MASK, block_size=K)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
    return head.eval()


def _batch():
    torch.manual_seed(2)
    ids = torch.randint(8, VOCAB, (2, 12))
    attention = torch.ones_like(ids)
    attention[1, 10:] = 0  # right padding, as training batches are
    pred = torch.zeros_like(ids, dtype=torch.bool)
    pred[0, 4:] = True
    pred[1, 5:10] = True
    return ids, attention, pred


def test_a_block_plan_starts_where_its_first_draft_position_is_scored():
    pred = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0]], dtype=torch.bool)
    plan = block_plan(pred, k=2)
    # row 0: starts s with pred[s+1]: 1, 2, 3; row 1: 0, 1 (padded with an invalid block)
    assert plan.starts[0].tolist() == [1, 2, 3]
    assert plan.valid.tolist() == [[True, True, True], [True, True, False]]
    # draft position 2 of start s is scored at s + 2: row 0 -> 3, 4 yes, 5 no
    assert plan.scored[1].tolist() == [[True, True, False], [True, False, False]]
    slots = plan.loss_rows(pred, decay=0.5)
    assert [s.count for s in slots] == [5, 3] and [s.weight for s in slots] == [1.0, 0.5]
    # rows index the N = 5 loss positions row-major: (0,2) (0,3) (0,4) (1,1) (1,2)
    assert slots[0].rows.tolist() == [0, 1, 2, 3, 4]
    assert slots[1].rows.tolist() == [1, 2, 4]
    assert slots[1].starts.tolist() == [[0, 1], [0, 2], [1, 0]]


def test_a_sampled_block_plan_is_a_seeded_subset_and_repeats():
    pred = torch.zeros(3, 40, dtype=torch.bool)
    pred[:, 10:] = True
    a, b = block_plan(pred, 3, per_row=5), block_plan(pred, 3, per_row=5)
    assert torch.equal(a.starts, b.starts) and a.starts.shape == (3, 5)
    assert bool(a.valid.all()) and bool((a.starts >= 9).all())
    assert len({tuple(r) for r in a.starts.tolist()}) > 1  # rows draw different starts
    other = pred.clone()
    other[0, 10] = False
    assert not torch.equal(block_plan(other, 3, per_row=5).starts, a.starts)


def test_block_attention_reads_grouped_kv_heads_as_their_repeated_copies():
    torch.manual_seed(1)
    q = torch.randn(2, 6, 3, 4, 8)  # 6 query heads over 2 kv heads
    kb, vb = torch.randn(2, 2, 3, 4, 8), torch.randn(2, 2, 3, 4, 8)
    kc, vc = torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    allowed = torch.rand(2, 3, 7) > 0.4
    grouped = block_attention(q, kb, vb, kc, vc, allowed)
    repeated = block_attention(q, *(x.repeat_interleave(3, 1) for x in (kb, vb, kc, vc)),
                               allowed)
    torch.testing.assert_close(grouped, repeated)
    assert grouped.shape == q.shape


def test_block_attention_is_non_causal_inside_a_block_and_blind_past_its_start():
    torch.manual_seed(0)
    q, kb, vb = (torch.randn(1, 2, 1, 4, 8) for _ in range(3))
    kc, vc = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    allowed = torch.tensor([[[True, True, True, False, False, False]]])  # context 0..2
    out = block_attention(q, kb, vb, kc, vc, allowed)
    later = vb.clone()
    later[:, :, :, 3] += 1.0  # the block's last slot
    assert not torch.allclose(block_attention(q, kb, later, kc, vc, allowed)[:, :, :, 0],
                              out[:, :, :, 0])  # slot 0 sees slot 3: non-causal
    future = vc.clone()
    future[:, :, 3:] += 100.0  # context past the start
    assert torch.equal(block_attention(q, kb, vb, kc, future, allowed), out)
    past = vc.clone()
    past[:, :, 2] += 1.0
    assert not torch.allclose(block_attention(q, kb, vb, kc, past, allowed), out)


def test_a_pard_mask_sees_its_prefix_and_the_masks_before_it_only():
    ids = torch.tensor([[10, 11, 12, 13, 14, 0]])
    attention = torch.tensor([[1, 1, 1, 1, 1, 0]])
    pred = torch.tensor([[0, 1, 1, 1, 1, 0]], dtype=torch.bool)
    plan = block_plan(pred, k=3)  # starts 0, 1, 2, 3
    tokens, positions, mask = pard_layout(ids, attention, plan, 3, MASK)
    assert tokens[0, 6:].tolist() == [MASK] * 8
    assert positions[0, 6:].tolist() == [2, 3, 3, 4, 4, 5, 5, 6]  # start s: s+2, s+3
    second = mask[0, 0, 6 + 2 * 2 + 1]  # start 2's second mask, at position 5
    assert second.nonzero()[:, 0].tolist() == [0, 1, 2, 3, 6 + 4, 6 + 5]  # x_0..x_3, its masks
    assert mask[0, 0, :6, 6:].sum() == 0  # no real token sees a mask
    assert mask[0, 0, :, 5].sum() == 0  # the padded position is no one's key


class _Greedy:
    temperature, top_p, top_k = 1.0, 1.0, 0  # propose's q at T=1, compared as log-probs


def _check_same_distributions(logits, slots, q, row, start):
    offset = 0
    for j, slot in enumerate(slots, 1):
        rows = logits[offset:offset + slot.count]
        offset += slot.count
        i = ((slot.starts[:, 0] == row) & (slot.starts[:, 1] == start)).nonzero()[0, 0]
        torch.testing.assert_close(torch.log_softmax(rows[i], -1), torch.log(q[0, j - 1]),
                                   atol=1e-5, rtol=0)


def test_dflash_trains_on_exactly_what_it_serves(target, dflash):
    ids, attention, pred = _batch()
    wrapped = DFlashForTraining(dflash, 0.8, 0)
    with torch.no_grad():
        logits = wrapped(ids, attention, pred, target_hidden_of(target, ids, dflash.aux_layers))
    slots = wrapped.loss_rows(pred)
    assert logits.shape[0] == sum(s.count for s in slots)
    start = 5  # the engine after the prompt x_0..x_5 with x_6 pending
    draft = DFlashDraft(dflash, target.get_input_embeddings())
    with torch.no_grad():
        prompt = target(ids[:1, :start + 1], output_hidden_states=True).hidden_states
    draft.start(ids[:1, :start + 1], attention[:1, :start + 1], ids[:1, start + 1], prompt)
    _, q = draft.propose(K, _Greedy, None)
    _check_same_distributions(logits, slots, q, 0, start)


@pytest.mark.parametrize("vocabulary", [None, [0, 2, 3, 5, 8, 9, 11, 20, 33, 41, 49]])
def test_pard_trains_on_exactly_what_it_serves(vocabulary):
    lm = _lm(5, layers=2)
    lm.config.draft_vocabulary = vocabulary  # its head scores these alone, in both
    ids, attention, pred = _batch()
    wrapped = PardForTraining(lm, K, 0.8, 0, MASK)
    with torch.no_grad():
        logits = wrapped.expand(wrapped(ids, attention, pred))
    slots = wrapped.loss_rows(pred)
    assert logits.shape[0] == sum(s.count for s in slots)
    draft = ParallelModelDraft(lm, MASK)
    draft.start(ids[:1, :6], attention[:1, :6], ids[:1, 6])
    _, q = draft.propose(K, _Greedy, None)
    _check_same_distributions(logits, slots, q, 0, 5)


@pytest.mark.parametrize("kind", ["dflash", "dflash from the target", "pard", "pard k=1",
                                  "pard from the target"])
def test_parallel_drafts_keep_greedy_output_identical(target, dflash, kind):
    """Random drafters exercise rejection; a DFlash drafter starting as the target's own layer
    and the target as a PARD draft (its first token always right, its mask positions seldom)
    exercise partial acceptance, so the equality covers accepted tokens too."""
    torch.manual_seed(3)
    ids = torch.randint(8, VOCAB, (3, 9))
    attention = torch.ones_like(ids)
    attention[0, :4] = 0  # left padding
    k = 1 if kind == "pard k=1" else K
    settings = DecodeSettings(max_new_tokens=24, k=k)
    if kind == "dflash":
        draft = DFlashDraft(dflash, target.get_input_embeddings())
    elif kind == "dflash from the target":
        torch.manual_seed(1)
        head = DFlashHead.from_target(target, [1, 2, 3], 2, mask_token_id=MASK, block_size=K)
        draft = DFlashDraft(head.eval(), target.get_input_embeddings())
    else:
        draft = ParallelModelDraft(target if kind != "pard" else _lm(5, layers=2), MASK)
    plain = generate(target, ids, attention, settings, set())
    spec = generate(target, ids, attention, settings, set(), draft)
    assert spec.tokens == plain.tokens
    accepted, drafted = sum(s.accepted for s in spec.stats), sum(s.drafted for s in spec.stats)
    if kind == "pard k=1":  # the target drafting for itself: every token accepted
        assert all(s.tau == 2.0 for s in spec.stats)
    if kind.endswith("from the target"):
        assert 0 < accepted < drafted, (accepted, drafted)  # both paths ran
    if kind == "pard from the target":  # and the counts are what decoding alone gives
        for row in range(3):
            prompt = ids[row][attention[row].bool()].tolist()
            want = greedy_chain_counts(target, _pard_proposer(target), prompt, K, 24)
            assert (spec.stats[row].steps, spec.stats[row].accepted) == want, row


def _pard_proposer(lm):
    """PARD's greedy proposal recomputed from scratch: one forward over the tokens so far and
    k - 1 mask tokens; the argmax at the last k positions."""
    @torch.no_grad()
    def propose(tokens, k):
        logits = lm(torch.tensor([tokens + [MASK] * (k - 1)])).logits[0]  # [T + k - 1, V]
        return logits[-k:].argmax(-1).tolist()
    return propose


def test_a_dflash_drafter_starts_from_the_target_or_at_random(target):
    """init 'target': layer i is the target's layer (highest aux layer) + i and fc passes that
    layer's input through; 'random': none of the target's layers; the lm_head is the target's
    either way; any other init is refused."""
    torch.manual_seed(3)
    copied = DFlashHead.from_target(target, [1, 2, 3], 1, mask_token_id=MASK, block_size=K)
    torch.manual_seed(3)
    fresh = DFlashHead.from_target(target, [1, 2, 3], 1, mask_token_id=MASK, block_size=K,
                                   init="random")
    source = target.model.layers[3]
    assert torch.equal(copied.layers[0].mlp.up_proj.weight, source.mlp.up_proj.weight)
    assert not torch.equal(fresh.layers[0].mlp.up_proj.weight, source.mlp.up_proj.weight)
    hidden = target.config.hidden_size
    assert torch.equal(copied.fc.weight[:, 2 * hidden:], torch.eye(hidden))
    assert not torch.equal(fresh.fc.weight[:, 2 * hidden:], torch.eye(hidden))
    for head in (copied, fresh):
        assert torch.equal(head.lm_head.weight, target.lm_head.weight)
    with pytest.raises(ConfigError, match="DFlash init 'copy': use 'random' or 'target'"):
        DFlashHead.from_target(target, [1, 2, 3], 1, mask_token_id=MASK, block_size=K,
                               init="copy")


def test_a_saved_dflash_drafter_loads_as_it_was(tmp_path, target, dflash):
    dflash.save_pretrained(tmp_path)
    loaded = DFlash().load(str(tmp_path), target, None, torch.float32, torch.device("cpu"))
    head = loaded.model.head
    assert loaded.max_k == K and head.mask_token_id == MASK and head.aux_layers == [1, 2, 3]
    assert_same_state(head.state_dict(), dflash.state_dict())
    config = (tmp_path / "config.json").read_text()
    assert '"target_layer_ids": [\n      0,\n      1,\n      2\n    ]' in config


def test_bad_parallel_input_is_refused(tmp_path, target, dflash, smollm2_tokenizer):
    with pytest.raises(ConfigError, match=r"outside the vocabulary \[0, 50\)"):
        check_mask_token(50, VOCAB)
    with pytest.raises(ConfigError, match=r"must lie in \[1, 3\]"):
        check_aux_layers([0, 2], 4)
    with pytest.raises(ConfigError, match="trained to fill blocks of 3 masks"):
        dflash.save_pretrained(tmp_path)
        DFlash().check_export(tmp_path, 4, (32, VOCAB))
    wide = _lm(0, layers=6)
    with pytest.raises(ConfigError, match="trained on a 4-layer target"):
        check_fits_target(DFlashHead.from_pretrained(tmp_path), wide)
    # the embedded tokenizer's highest unused special token; refused once the data holds it
    assert pick_mask_token(smollm2_tokenizer, 49152) == 16

    class Example:
        input_ids = [5, 16, 9]
    assert pick_mask_token(smollm2_tokenizer, 49152, [Example()]) == 15

    class Everything:
        input_ids = list(range(3, 17))
    with pytest.raises(ConfigError, match="no unused special token"):
        pick_mask_token(smollm2_tokenizer, 49152, [Everything()])


def test_a_pard_draft_with_another_vocabulary_is_refused(tmp_path, target):

    from drafts.independent import VocabMismatchError
    from drafts.pard import Pard

    other = tiny_llama(VOCAB + 10, layers=1, hidden=32)
    other.config.pard_token, other.config.pard_trained_k = MASK, K
    other.save_pretrained(tmp_path)
    with pytest.raises(VocabMismatchError, match="the draft's vocabulary has 60 tokens"):
        Pard().load(str(tmp_path), target, None, torch.float32, torch.device("cpu"))
