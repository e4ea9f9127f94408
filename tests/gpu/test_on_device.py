"""The device tier: what must hold on the accelerator the recipe runs on, with tiny random
models. The device comes from pytest's --device option (cpu by default: these tests run in the
fast tier on every CI machine; `python -m benchmarks.gpu_check --device cuda` runs them on a GPU):

    .venv/bin/python -m pytest -m gpu --device cuda

- the engine's greedy output equals the target's own for every draft kind, chains and trees;
- sampled output follows the target's distribution (the chi-square of tests/decoding/
  test_sampling.py) for every draft kind and for trees;
- one training step of every draft kind under bf16 autocast: finite, and its loss within
  BF16_TOLERANCE of the fp32 step's;
- the predicted-acceptance maths give on the device what they give on the CPU;
- a 1-process DistributedDataParallel step (NCCL on CUDA, gloo on CPU) moves the weights as a
  plain step does.
Nothing here needs datasets, vLLM, DeepSpeed or gguf, nor the embedded target.
"""

from __future__ import annotations

import math

import pytest
import torch

from decoding.engine import DecodeSettings, generate
from drafts.vocabulary import DraftVocabulary
from tests.decoding.test_sampling import (
    KINDS,
    NEW_TOKENS,
    ROWS,
    VOCAB,
    _batch,
    _draft,
    _tiny,
    pit_p_value,
)
from tests.helpers import free_port, tiny_llama

pytestmark = pytest.mark.gpu

BF16_TOLERANCE = 0.01
"""Relative: one step's loss under bf16 autocast against fp32's on these tiny models (measured
2e-5 to 1.1e-4 for the five kinds on a 2-core Xeon with AMX; bf16
keeps 8 bits of mantissa, so larger models stray more); a wrong loss (a layer skipped, an
overflow) is off by far more. The gradient norm is held to 10x that."""


CPU_ROWS = 400
"""Rows of the sampling test on a CPU, where tests/decoding/test_sampling.py already runs the
same draws at ROWS: enough to fail a wrong rule, at a fifth of the time."""


def on(device: torch.device, draft):
    """The draft built on the CPU, with every module, tensor and draft vocabulary it holds moved
    to device, also those its parts hold (an LM draft's model sits in its KV-cache wrapper,
    its draft vocabulary's ids beside it). A loaded draft is built on its device instead."""
    moved = {}

    def move(value):
        if id(value) in moved:
            return moved[id(value)]
        moved[id(value)] = value
        if isinstance(value, (torch.nn.Module, torch.Tensor, DraftVocabulary)):
            moved[id(value)] = value.to(device)
        elif type(value).__module__.partition(".")[0] in ("drafts", "decoding") \
                and hasattr(value, "__dict__"):
            for name, part in vars(value).items():
                setattr(value, name, move(part))
        return moved[id(value)]

    return move(draft)


@pytest.fixture(scope="module")
def target(device):
    return _tiny(0).to(device)


def drafted(kind: str, device: torch.device):
    """test_sampling's draft of this kind, built beside a CPU copy of the target, on device."""
    return on(device, _draft(kind, _tiny(0)))


def often_right(kind: str, device: torch.device):
    """An LM draft (independent or PARD) that is the target with noise on its head: accepted
    often and rejected sometimes, so that greedy decoding on the device runs both its accept and
    its rollback (test_sampling's tiny LMs are never right)."""
    from drafts.independent import ModelDraft
    from drafts.pard import ParallelModelDraft

    model = _tiny(0)
    with torch.no_grad():
        noise = torch.randn(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(1))
        model.lm_head.weight.add_(noise, alpha=0.5)
    if kind.endswith("draft vocabulary"):  # as test_sampling's: q is 0 on tokens 4 and 7
        model.config.draft_vocabulary = [0, 1, 2, 3, 5, 6]
    draft = (ModelDraft(model) if kind.startswith("independent")
             else ParallelModelDraft(model, mask_id=7))
    return on(device, draft)


CHAINS = [(kind, False, False, 0) for kind in KINDS]
TREES = [("independent", True, False, 0), ("medusa", True, False, 0), ("dflash", True, False, 0),
         ("eagle3", True, False, 8), ("eagle3", True, True, 8), ("prompt lookup", True, True, 0)]
"""(draft kind, tree, n-gram branch, dynamic tree nodes): test_sampling's and test_tree's."""


def _settings(tree: bool, ngram: bool, nodes: int, temperature: float = 0.0) -> DecodeSettings:
    filtered = {"top_p": 0.9, "top_k": 6} if temperature > 0 else {}
    return DecodeSettings(max_new_tokens=NEW_TOKENS, k=3, temperature=temperature, tree=tree,
                          tree_width=2, ngram_branch=ngram, tree_nodes=nodes, **filtered)


def _tensors(value, seen: set, path: str = "draft"):
    """(path, tensor) of every parameter, buffer and tensor a draft reaches through its
    attributes."""
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, torch.nn.Module):
        for name, tensor in [*value.named_parameters(), *value.named_buffers()]:
            yield f"{path}.{name}", tensor
    elif hasattr(value, "__dict__"):
        for name, part in vars(value).items():
            yield from _tensors(part, seen, f"{path}.{name}")


@pytest.mark.parametrize("kind", KINDS)
def test_the_drafts_moved_to_the_device_hold_nothing_elsewhere(kind):
    """Else a kind's device tests stop at a device mismatch (an LM draft's model inside its
    KV-cache wrapper, a draft vocabulary's ids) rather than test it: moved to 'meta' here."""
    draft = on(torch.device("meta"), _draft(kind, _tiny(0)))
    assert [path for path, tensor in _tensors(draft, set()) if tensor.device.type != "meta"] == []


@pytest.mark.parametrize("kind,tree,ngram,nodes", CHAINS + TREES,
                         ids=[f"{k}-{'tree' if t else 'chain'}{'+ngram' if g else ''}"
                              for k, t, g, _ in CHAINS + TREES])
def test_greedy_speculation_equals_the_targets_greedy_on_the_device(target, device, kind, tree,
                                                                   ngram, nodes):
    _, ids, mask = _batch(16)
    ids, mask = ids.to(device), mask.to(device)
    plain = generate(target, ids, mask, DecodeSettings(max_new_tokens=NEW_TOKENS), {VOCAB + 1})
    lm = kind.startswith(("independent", "pard"))
    draft = often_right(kind, device) if lm else drafted(kind, device)
    speculated = generate(target, ids, mask, _settings(tree, ngram, nodes), {VOCAB + 1}, draft)
    assert speculated.tokens == plain.tokens
    accepted = sum(s.accepted for s in speculated.stats)
    assert accepted > 0  # accepted drafts compared too
    if lm and not tree:  # and rejected ones: the draft's cache rolled back on the device
        assert accepted < sum(s.drafted for s in speculated.stats)


@pytest.mark.parametrize("kind,tree,ngram,nodes", CHAINS + TREES[:4],
                         ids=[f"{k}-{'tree' if t else 'chain'}" for k, t, _, _ in
                              CHAINS + TREES[:4]])
def test_sampling_on_the_device_keeps_the_targets_distribution(target, device, kind, tree,
                                                               ngram, nodes):
    prompts, ids, mask = _batch(ROWS if device.type != "cpu" else CPU_ROWS)
    settings = _settings(tree, ngram, nodes, temperature=1.0)
    out = generate(target, ids.to(device), mask.to(device), settings, {VOCAB + 1},
                   drafted(kind, device), generator=torch.Generator(device).manual_seed(3))
    assert all(len(t) == NEW_TOKENS for t in out.tokens)
    assert pit_p_value(_tiny(0), prompts, out.tokens, settings) > 1e-3  # computed on the CPU


def _train_step(kind: str, device: torch.device, precision: str) -> tuple[float, float]:
    """One step of the training loop's own step (benchmarks.gpu_check.training_steps) for
    this kind on a tiny 64-token target, under accelerate with mixed_precision=precision ->
    (loss per token, gradient norm)."""
    from accelerate import Accelerator

    from benchmarks.gpu_check import kind_overrides, training_examples, training_steps
    from tests.helpers import reset_accelerate

    reset_accelerate()
    accelerator = Accelerator(cpu=device.type == "cpu", mixed_precision=precision)
    target = tiny_llama(64, seed=1, layers=2, hidden=64, init=0.05).to(accelerator.device)
    run = training_steps(kind_overrides(kind, target.config), target,
                         training_examples(64, 4, 40), accelerator, steps=1)
    reset_accelerate()
    return run["losses"][0], run["grad_norms"][0]


@pytest.mark.parametrize("kind", ["independent", "medusa", "eagle3", "dflash", "pard"])
def test_a_training_step_under_bf16_autocast_matches_fp32(device, kind):
    loss, norm = _train_step(kind, device, "bf16")
    loss32, norm32 = _train_step(kind, device, "no")
    assert math.isfinite(loss) and math.isfinite(norm) and norm > 0, (loss, norm)
    assert loss != loss32  # autocast did compute in bf16
    assert loss == pytest.approx(loss32, rel=BF16_TOLERANCE), (loss, loss32)
    assert norm == pytest.approx(norm32, rel=10 * BF16_TOLERANCE), (norm, norm32)


def test_predicted_acceptance_is_the_same_on_the_device(device):
    from decoding.acceptance import chained_acceptance, match_probability

    g = torch.Generator().manual_seed(0)
    p, q = torch.randn(64, 200, generator=g), torch.randn(64, 200, generator=g)
    valid = torch.rand(64, generator=g) > 0.2
    on_cpu = match_probability(p, q)
    on_device = match_probability(p.to(device), q.to(device))
    assert torch.allclose(on_device.cpu(), on_cpu, atol=1e-5)
    a, valid = on_cpu.reshape(4, 16), valid.reshape(4, 16)  # [B, T] per-position acceptance
    sums, n = chained_acceptance(a, valid, 4)
    device_sums, device_n = chained_acceptance(a.to(device), valid.to(device), 4)
    assert n > 0 and device_n == n and torch.allclose(device_sums.cpu(), sums, atol=1e-6)
    short = chained_acceptance(a[:, :3].to(device), valid[:, :3].to(device), 4)[0]  # no window
    assert (short + device_sums).device == device_sums.device  # pooled with the others


def test_a_one_process_ddp_step_moves_the_weights_as_a_plain_step(device):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    backend = "nccl" if device.type == "cuda" else "gloo"
    plain, wrapped = tiny_llama(32, seed=2).to(device), tiny_llama(32, seed=2).to(device)
    ids = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(0)).to(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        ddp = DistributedDataParallel(wrapped.train(), device_ids=[device.index or 0]
                                      if device.type == "cuda" else None)
        for model in (plain.train(), ddp):
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    for a, b in zip(plain.parameters(), wrapped.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)
