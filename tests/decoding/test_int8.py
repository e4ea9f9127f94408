"""Int8 weights for drafts (decoding.int8): the quantised product, a model's linears swapped in a
copy, and a draft vocabulary's rows of an int8 head."""

import torch
from torch import nn

from decoding.int8 import Int8Linear, int8_copy
from decoding.kv import CachedLM
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


def test_a_quantised_copy_swaps_the_linears_and_leaves_the_model_alone():
    model = tiny_llama(64, seed=0, layers=2).eval()
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    before = model(ids).logits
    quantised = int8_copy(model, skip=("o_proj",))
    kinds = {name.rpartition(".")[2]: type(m) for name, m in quantised.named_modules()}
    assert kinds["q_proj"] is Int8Linear and kinds["lm_head"] is Int8Linear
    assert kinds["o_proj"] is nn.Linear  # skipped by name
    assert not any(isinstance(m, Int8Linear) for m in model.modules())
    assert torch.equal(model(ids).logits, before)
    after = quantised(ids).logits
    assert 0 < (after - before).abs().max() < 0.1 * before.abs().max()
    vocabulary = torch.tensor([1, 5, 9, 60])  # a draft vocabulary's head: the int8 rows
    lm = CachedLM(quantised, vocabulary=vocabulary)
    last = lm.prefill(ids, torch.ones_like(ids))
    assert torch.allclose(last, after[:, -1, vocabulary], atol=1e-5)
