"""Quantised weights for drafts (decoding.quantise): the int8 and int4 products, a model's linears
swapped in a copy, and a draft vocabulary's rows of a quantised head."""

import pytest
import torch
from torch import nn

from decoding.kv import CachedLM
from decoding.quantise import GROUP, Int4Linear, Int8Linear, quantised_copy
from drafts.fused import fuse_linears
from recipe import ConfigError
from tests.helpers import tiny_llama


def test_an_int8_product_stays_close_to_the_fp32_one_and_its_rows_are_its_own():
    torch.manual_seed(0)
    weight, bias, x = torch.randn(48, 64), torch.randn(48), torch.randn(3, 5, 64)
    layer = Int8Linear.quantise(weight, bias)
    exact = x @ weight.T + bias
    assert layer.qweight.dtype == torch.int8 and layer.qweight.abs().max() == 127
    error = (layer(x) - exact).abs().max() / exact.abs().max()
    assert 0 < error < 0.03  # quantised, and close
    computed = x @ layer.dequantised().T + bias  # what it computes, up to bf16 activations
    assert (layer(x) - computed).abs().max() < 0.01 * computed.abs().max()
    ids = torch.tensor([3, 0, 47])
    assert torch.allclose(layer.rows(ids)(x), layer(x)[..., ids])


def test_an_int4_product_computes_with_its_groups_levels():
    torch.manual_seed(0)
    weight, bias, x = torch.randn(40, 96), torch.randn(40), torch.randn(3, 5, 96)  # 40: padded
    layer = Int4Linear.quantise(weight, bias)
    levels = layer.levels()
    assert levels.shape == (40, 96) and levels.min() == 0 and levels.max() == 15
    dequantised = layer.dequantised()
    # each group's weights lie within half a level of the group's own grid
    step = layer.scale.float().repeat_interleave(GROUP, 1)
    assert ((dequantised - weight).abs() <= 0.5 * step + 1e-2 * weight.abs()).all()
    exact = x @ weight.T + bias
    error = (layer(x) - exact).abs().max() / exact.abs().max()
    assert 0 < error < 0.12  # 16 levels: coarser than int8, still close
    computed = x @ dequantised.T + bias  # what it computes, up to bf16 activations
    assert (layer(x) - computed).abs().max() < 0.01 * computed.abs().max()
    ids = torch.tensor([3, 0, 39])
    assert torch.allclose(layer.rows(ids)(x), layer(x)[..., ids])
    assert torch.equal(layer.rows(ids).dequantised(), dequantised[ids])


@pytest.mark.parametrize("form", [Int8Linear, Int4Linear])
def test_fused_quantised_layers_compute_what_each_computes(form):
    torch.manual_seed(1)
    layers = [form.quantise(torch.randn(n, 64), None if n == 24 else torch.randn(n))
              for n in (24, 40)]
    fused, x = fuse_linears(layers), torch.randn(2, 64)
    assert type(fused) is form
    assert torch.allclose(fused(x), torch.cat([layer(x) for layer in layers], -1), atol=1e-6)
    with pytest.raises(TypeError, match="not a mix"):
        fuse_linears([Int8Linear.quantise(torch.randn(8, 64)), layers[0]] if form is Int4Linear
                     else [Int4Linear.quantise(torch.randn(16, 64)), layers[0]])


def test_int4_weights_stay_on_a_cpu_and_narrow_inputs_stay_int8():
    levels = torch.zeros(16, 64, dtype=torch.uint8, device="meta")
    scale = torch.ones(16, 2, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ConfigError, match="set eval.draft_weights=int8"):
        Int4Linear(levels, scale, scale)
    model = nn.Sequential(nn.Linear(64, 16), nn.Linear(16, 8))  # the second reads 16 inputs
    quantised = quantised_copy(model, "int4")
    assert [type(m) for m in quantised] == [Int4Linear, Int8Linear]


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_a_quantised_copy_swaps_the_linears_and_leaves_the_model_alone(weights):
    model = tiny_llama(64, seed=0, layers=2).eval()
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    before = model(ids).logits
    quantised = quantised_copy(model, weights, skip=("o_proj",))
    form = {"int8": Int8Linear, "int4": Int4Linear}[weights]
    kinds = {name.rpartition(".")[2]: type(m) for name, m in quantised.named_modules()}
    assert kinds["q_proj"] is form and kinds["lm_head"] is form
    assert kinds["o_proj"] is nn.Linear  # skipped by name
    assert not any(isinstance(m, form) for m in model.modules())
    assert torch.equal(model(ids).logits, before)
    after = quantised(ids).logits
    bound = {"int8": 0.1, "int4": 0.5}[weights]  # 16 levels: coarse, compounding over layers
    assert 0 < (after - before).abs().max() < bound * before.abs().max()
    vocabulary = torch.tensor([1, 5, 9, 60])  # a draft vocabulary's head: the quantised rows
    lm = CachedLM(quantised, vocabulary=vocabulary)
    last = lm.prefill(ids, torch.ones_like(ids))
    assert torch.allclose(last, after[:, -1, vocabulary], atol=1e-5)
