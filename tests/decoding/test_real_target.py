"""Integration tier: the engine on the real SmolLM2-135M target and MT-bench questions."""

import pytest
import torch

from assets.chat import render
from assets.prompts import load_mtbench
from assets.target import end_of_turn_ids, load_target, resolve_target
from decoding.engine import DecodeSettings, generate, left_pad
from drafts.eagle3 import Eagle3Draft, Eagle3Head, default_aux_layers
from drafts.independent import ModelDraft, layer_truncated
from drafts.medusa import MedusaDraft
from drafts.prompt_lookup import PromptLookupDraft
from recipe import ModelConfig
from tests.helpers import fit_medusa_heads

pytestmark = pytest.mark.integration
NEW_TOKENS = 32
QUESTIONS = 5  # one left-padded batch


@pytest.fixture(scope="module")
def setup(smollm2_tokenizer):
    target = load_target(resolve_target(ModelConfig()), "float32", torch.device("cpu"))
    conversations, _ = load_mtbench()
    prompts = [render(smollm2_tokenizer, [{"role": "user", "content": c.user_turns[0]}], True)
               for c in conversations[:QUESTIONS]]
    eos = end_of_turn_ids(target, smollm2_tokenizer)
    reference = []
    for p in prompts:  # the target's own greedy output, transformers' generate, no padding
        out = target.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=int),
                              max_new_tokens=NEW_TOKENS, do_sample=False,
                              eos_token_id=sorted(eos), pad_token_id=2)
        reference.append(out[0, len(p):].tolist())
    return target, prompts, eos, reference


def _medusa(target, prompts, reference):
    """Heads fitted briefly to the target's answers (lm_heads kept the target's), so that they
    are right at times and the equality covers accepted tokens."""
    return MedusaDraft(fit_medusa_heads(target, [p + r for p, r in zip(prompts, reference)],
                                        num_heads=4, steps=5, lr=1e-2, train_lm_heads=False))


def _eagle3(target):
    """An untrained head over half the vocabulary, on vLLM's default aux layers [2, 15, 27]."""
    torch.manual_seed(0)
    head = Eagle3Head.from_target(target, default_aux_layers(30), torch.arange(0, 49152, 2))
    return Eagle3Draft(head.eval(), target.get_input_embeddings())


TREE = {"tree": True, "tree_nodes": 12, "ngram_branch": True}  # dynamic EAGLE-2 + n-gram


@pytest.mark.parametrize("draft_kind,tree", [
    ("layer-truncated", False), ("prompt lookup", False), ("medusa", False), ("eagle3", True)])
def test_greedy_speculation_equals_target_on_mtbench_questions(setup, draft_kind, tree):
    """Batched (left-padded) greedy decoding equals the target's own. An EAGLE-3 head's chains
    on the real target, one prompt at a time, are held to the target's texts (and to vLLM's) by
    tests/serving/test_validate_vllm.py."""
    target, prompts, eos, reference = setup
    draft = {"layer-truncated": lambda: ModelDraft(layer_truncated(target, 4)),
             "prompt lookup": lambda: PromptLookupDraft(target.config.vocab_size),
             "medusa": lambda: _medusa(target, prompts, reference),
             "eagle3": lambda: _eagle3(target)}[draft_kind]()
    outputs, accepted = [], 0
    for b in range(0, len(prompts), 5):  # batches of 5, left-padded
        ids, mask = left_pad(prompts[b : b + 5], 2, torch.device("cpu"))
        settings = DecodeSettings(max_new_tokens=NEW_TOKENS, k=4, **(TREE if tree else {}))
        gen = generate(target, ids, mask, settings, eos, draft)
        outputs += gen.tokens
        accepted += sum(s.accepted for s in gen.stats)
    for row, (got, want) in enumerate(zip(outputs, reference)):
        assert got == want, f"MT-bench question {row}"
    assert accepted > 0  # the equality covers accepted draft tokens, not only rejections
