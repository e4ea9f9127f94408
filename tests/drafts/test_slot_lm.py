"""drafts/slot_lm.py: an independent draft's forward over a preallocated cache computes what the
HF forward through decoding/kv.py computes, for the architectures it takes, and its chains
(eager here, compiled in the slow test) decode exactly the target's output."""

import pytest
import torch

from decoding.engine import DecodeSettings, generate
from decoding.kv import CachedLM
from decoding.quantise import quantised_copy
from decoding.tree import ancestor_mask
from drafts.independent import ModelDraft
from drafts.pard import ParallelModelDraft
from drafts.slot_lm import FusedDecoder, SlotLM
from recipe import ConfigError
from tests.decoding.test_engine import _noisy_copy, _prompts, _tiny, _with_vocabulary
from tests.helpers import logged_chains, tiny_llama

VOCAB, EOS = 256, 2


def _qwen(family: str, seed: int = 0, **config):
    """A tiny random Qwen2 (biased q/k/v) or Qwen3 (q/k norms per head), GQA, head_dim 16."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(family, vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, max_position_embeddings=1024, initializer_range=0.2,
                               eos_token_id=EOS, pad_token_id=0, **config)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # biases and norm weights away from their zero / one init
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


MODELS = {"llama": lambda: tiny_llama(VOCAB, seed=0, eos_token_id=EOS, pad_token_id=0),
          "qwen2": lambda: _qwen("qwen2"), "qwen3": lambda: _qwen("qwen3")}


@pytest.mark.parametrize("family", sorted(MODELS))
@pytest.mark.parametrize("vocabulary", [None, list(range(3, VOCAB, 2))])
def test_slot_lm_computes_what_the_hf_forward_computes(family, vocabulary):
    """Left-padded prefill, an extension with holes, rejected slots (cut and holes), a token
    tree and its drop: SlotLM's logits equal CachedLM's (HF forward, DynamicCache) at every
    real position, over the whole vocabulary or a draft vocabulary's rows."""
    model = MODELS[family]()
    ids_ = None if vocabulary is None else torch.tensor(vocabulary)
    hf, slot = CachedLM(model, vocabulary=ids_), SlotLM(FusedDecoder(model, ids_))
    _, ids, mask = _prompts([5, 17, 9])
    g = torch.Generator().manual_seed(3)

    def same(a, b, valid):
        assert a.shape == b.shape
        assert torch.allclose(a[valid], b[valid], atol=1e-5), (a[valid] - b[valid]).abs().max()

    same(hf.prefill(ids, mask), slot.prefill(ids, mask), slice(None))
    tokens = torch.randint(3, VOCAB, (3, 3), generator=g)
    valid = torch.tensor([[True, False, True], [False, True, True], [True, True, True]])
    same(hf.extend(tokens, valid), slot.extend(tokens, valid), valid)
    for rejected in ([1, 0, 2], [1, 1, 1]):
        hf.reject_last(torch.tensor(rejected))
        slot.reject_last(torch.tensor(rejected))
        tokens = torch.randint(3, VOCAB, (3, 2), generator=g)
        valid = torch.ones(3, 2, dtype=torch.bool)
        same(hf.extend(tokens, valid), slot.extend(tokens, valid), valid)
    seen = ancestor_mask(torch.tensor([[-1, 0, 0, 1]] * 3))  # [B, N, N]
    tokens = torch.randint(3, VOCAB, (3, 4), generator=g)
    valid = torch.tensor([[True] * 4, [True] * 4, [True, True, False, False]])
    same(hf.extend_tree(tokens, seen.sum(-1) - 1, seen, valid),
         slot.extend_tree(tokens, seen.sum(-1) - 1, seen, valid), valid)
    hf.drop_tree(4)
    slot.drop_tree(4)
    tokens = torch.randint(3, VOCAB, (3, 1), generator=g)
    valid = torch.ones(3, 1, dtype=torch.bool)
    same(hf.extend(tokens, valid), slot.extend(tokens, valid), valid)
    assert torch.equal(hf.next_position, slot.next_position)


def _draft(target):
    """A noisy copy of the target with a draft vocabulary (right often, wrong sometimes)."""
    return _with_vocabulary(target, _noisy_copy(target))


@pytest.mark.parametrize("weights, k", [("model", 1), ("model", 4), ("int8", 4), ("int4", 4)])
def test_slot_lm_chains_decode_the_targets_output(weights, k):
    """ModelDraft over SlotLM with its greedy chains run eager (the compiled functions' code):
    the chains are the CachedLM draft's, token for token, and greedy output is the target's;
    dynamic trees and sampled chains, run over the same cache, do as the CachedLM draft
    does."""
    target = MODELS["llama"]()
    _, ids, mask = _prompts([5, 17, 9])
    model = _draft(target)
    if weights != "model":
        model = quantised_copy(model, weights)
    plain = generate(target, ids, mask, DecodeSettings(max_new_tokens=32), {EOS}).tokens
    runs = {}
    for lm in ("cached", "slot"):
        draft = ModelDraft(model, compile=lm == "slot")
        if lm == "slot":
            assert isinstance(draft.lm, SlotLM)
            draft.lm.steps = None  # eager
        chains = logged_chains(draft)
        out = generate(target, ids, mask, DecodeSettings(max_new_tokens=32, k=k), {EOS},
                       draft)
        assert out.tokens == plain, (lm, k)
        runs[lm] = chains, sum(s.accepted for s in out.stats)
        tree = generate(target, ids, mask, DecodeSettings(max_new_tokens=24, k=k, tree=True,
                                                          tree_nodes=6), {EOS}, draft)
        assert tree.tokens == [row[:24] for row in plain], (lm, k, "tree")
        runs[lm, "tree"] = sum(s.accepted for s in tree.stats)
        sampled = generate(target, ids, mask, DecodeSettings(max_new_tokens=16, k=k,
                                                             temperature=1.0), {EOS}, draft,
                           torch.Generator().manual_seed(0))
        runs[lm, "sampled"] = sampled.tokens
    assert runs["slot"][1] == runs["cached"][1] > 0
    assert runs["slot", "tree"] == runs["cached", "tree"]
    assert runs["slot", "sampled"] == runs["cached", "sampled"]
    # quantised products take bf16 activations: a fused product may round them differently
    atol = 1e-4 if weights == "model" else 5e-2
    for (tokens, logits), (hf_tokens, hf_logits) in zip(runs["slot"][0], runs["cached"][0]):
        assert torch.equal(tokens, hf_tokens)
        assert torch.allclose(logits, hf_logits, atol=atol)


def test_a_chain_with_non_finite_logits_is_drafted_again_eager():
    """A greedy chain over SlotLM is one call (SlotLM.chain); where its logits are not finite
    (a NaN in the head), the cache goes back to what it was and the eager loop drafts the chain
    with its uniform fallback: the same chains, failure counts and output as over CachedLM."""
    target = MODELS["llama"]()
    _, ids, mask = _prompts([5, 17, 9])
    model = _tiny(5)
    model.lm_head.weight.data[0, 0] = float("nan")
    plain = generate(target, ids, mask, DecodeSettings(max_new_tokens=24), {EOS}).tokens
    runs = {}
    for lm in ("cached", "slot"):
        draft = ModelDraft(model, compile=lm == "slot")
        if lm == "slot":
            draft.lm.steps = None  # eager
            chain, calls = draft.lm.chain, []
            draft.lm.chain = lambda *args: calls.append(args) or chain(*args)
        chains = logged_chains(draft)
        out = generate(target, ids, mask, DecodeSettings(max_new_tokens=24, k=4), {EOS}, draft)
        assert out.tokens == plain, lm
        assert all(s.draft_failures == 1 for s in out.stats), lm
        runs[lm] = chains
    assert len(calls) == 1  # the first chain; once a row failed, chains run eager
    assert len(runs["slot"]) == len(runs["cached"]) > 3
    for (tokens, logits), (hf_tokens, hf_logits) in zip(runs["slot"], runs["cached"]):
        assert torch.equal(tokens, hf_tokens)
        assert torch.allclose(logits, hf_logits, atol=1e-4, equal_nan=True)


def _pard_chains(target, model, compile: bool | None, k: int = 4):
    """A PARD draft (mask id 7) over CachedLM (compile False), SlotLM run eager (None) or
    compiled (True) -> its greedy output on three left-padded prompts and its chains."""
    _, ids, mask = _prompts([5, 17, 9])
    draft = ParallelModelDraft(model, 7, compile=bool(compile))
    chains, start = logged_chains(draft), draft.start

    def eager(*args, **kwargs):
        start(*args, **kwargs)
        draft.lm.steps = None

    if compile is None:
        draft.start = eager
    out = generate(target, ids, mask, DecodeSettings(max_new_tokens=32, k=k), {EOS}, draft)
    return out.tokens, chains


def test_pard_drafts_over_a_slot_lm_propose_what_they_propose_over_hf():
    target = MODELS["llama"]()
    _, ids, mask = _prompts([5, 17, 9])
    plain = generate(target, ids, mask, DecodeSettings(max_new_tokens=32), {EOS}).tokens
    model = _noisy_copy(target)
    cached, slot = _pard_chains(target, model, False), _pard_chains(target, model, None)
    assert cached[0] == slot[0] == plain
    assert len(cached[1]) == len(slot[1]) > 5
    for (tokens, logits), (hf_tokens, hf_logits) in zip(slot[1], cached[1]):
        assert torch.equal(tokens, hf_tokens)
        assert torch.allclose(logits, hf_logits, atol=1e-4)


def test_compiled_code_is_kept_per_model_and_made_again_when_its_weights_change():
    """compiled_lm's fused weights are copies and its compiled steps check only their arguments
    (drafts.fused.guards_on_arguments): a model trained further, or another draft vocabulary,
    gets a new FusedDecoder and new steps (nothing compiles here: steps compile when called)."""
    from drafts.independent import compiled_lm

    model = MODELS["llama"]()
    first = compiled_lm(model, None)
    assert compiled_lm(model, None).steps is first.steps
    assert compiled_lm(model, None).decoder is first.decoder
    with torch.no_grad():
        model.get_decoder().layers[0].mlp.down_proj.weight.mul_(1.5)  # trained in place
    trained = compiled_lm(model, None)
    assert trained.steps is not first.steps and trained.decoder is not first.decoder
    vocabulary = compiled_lm(model, torch.arange(0, VOCAB, 2))
    assert vocabulary.steps is not trained.steps
    assert vocabulary.decoder.head.out_features == VOCAB // 2
    assert compiled_lm(model, torch.arange(0, VOCAB, 2)).steps is vocabulary.steps


def test_slot_lm_refuses_what_it_cannot_run_exactly():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(ConfigError, match="gpt2 model: set eval.draft_compile=false"):
        FusedDecoder(gpt2)
    sliding = _qwen("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0)
    with pytest.raises(ConfigError, match="sliding window.*eval.draft_compile=false"):
        FusedDecoder(sliding)


@pytest.mark.slow  # inductor compiles a chain and PARD's extension (minutes on 2 CPU cores)
def test_compiled_chains_draft_what_the_eager_draft_drafts():
    """eval.draft_compile for an independent draft: a greedy chain is one compiled call, and
    the chains propose what the CachedLM draft proposes (the same tokens, logits
    within rounding) over left-padded rows (holes) and a row whose cache outgrows its first
    capacity; output stays the target's; a later engine run reuses the compiled code. The
    same for a PARD draft's compiled extension."""
    target = MODELS["llama"]()
    _, ids, mask = _prompts([5, 120, 8])
    model = _draft(target)
    plain = generate(target, ids, mask, DecodeSettings(max_new_tokens=160), {EOS}).tokens
    runs = {}
    for compile in (False, True):
        draft = ModelDraft(model, compile=compile)
        chains = logged_chains(draft)
        out = generate(target, ids, mask, DecodeSettings(max_new_tokens=160, k=4), {EOS}, draft)
        assert out.tokens == plain, compile
        runs[compile] = chains
        if compile:
            assert draft.lm.slots.capacity > 256  # the long row grew the cache
            steps = draft.lm.steps
            assert "chain 4" in steps
            again = ModelDraft(model, compile=True)
            generate(target, ids, mask, DecodeSettings(max_new_tokens=4, k=4), {EOS}, again)
            assert again.lm.steps is steps
    assert len(runs[True]) == len(runs[False]) > 10
    for (tokens, logits), (eager_tokens, eager_logits) in zip(runs[True], runs[False]):
        assert torch.equal(tokens, eager_tokens)
        assert torch.allclose(logits, eager_logits, atol=1e-4)
    # a PARD draft: its extension (pending tokens and masks) is one compiled call
    cached, compiled = _pard_chains(target, model, False), _pard_chains(target, model, True)
    assert cached[0] == compiled[0]
    assert len(cached[1]) == len(compiled[1]) > 5
    for (tokens, logits), (eager_tokens, eager_logits) in zip(compiled[1], cached[1]):
        assert torch.equal(tokens, eager_tokens)
        assert torch.allclose(logits, eager_logits, atol=1e-4)


@pytest.mark.slow  # inductor compiles a chain (about a minute on 2 CPU cores)
def test_a_compiled_chain_on_int4_weights_drafts_what_its_eager_code_drafts():
    """Inductor lowers the int4 product (torch's CPU kernel) inside the one-call chain: the
    compiled chains are the eager chain code's, token for token, and output is the target's."""
    target = MODELS["llama"]()
    _, ids, mask = _prompts([5, 17, 9])
    model = quantised_copy(_draft(target), "int4")
    plain = generate(target, ids, mask, DecodeSettings(max_new_tokens=32), {EOS}).tokens
    runs = {}
    for eager in (True, False):
        draft = ModelDraft(model, compile=True)
        if eager:
            draft.lm.steps = None
        runs[eager] = logged_chains(draft)
        out = generate(target, ids, mask, DecodeSettings(max_new_tokens=32, k=4), {EOS}, draft)
        assert out.tokens == plain, eager
    assert "chain 4" in draft.lm.steps
    assert len(runs[True]) == len(runs[False]) > 3
    for (tokens, logits), (eager_tokens, eager_logits) in zip(runs[False], runs[True]):
        assert torch.equal(tokens, eager_tokens)
        assert torch.allclose(logits, eager_logits, atol=5e-2)
