"""The target's fp32 products on oneDNN's prepacked weights: the same products as F.linear."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from decoding.packed import PackedLinear, pack_linears, packs


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_product_equals_f_linear(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias)
    x = torch.randn(2, rows, 96)  # [B, T, K]
    out = PackedLinear(linear)(x)
    assert out.shape == (2, rows, 200)
    torch.testing.assert_close(out, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)


def test_packed_weight_reads_back_dense():
    linear = nn.Linear(16, 8)
    assert torch.equal(PackedLinear(linear).weight, linear.weight.detach())


def test_pack_linears_keeps_a_tiny_target_s_logits(tiny_target):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    ids = torch.randint(3, 1000, (2, 7))
    with torch.no_grad():
        before = model(ids).logits
        count = sum(type(m) is nn.Linear for m in model.modules())
        assert count > 0 and pack_linears(model) == count
        assert not any(type(m) is nn.Linear for m in model.modules())
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-4, atol=1e-4)


def test_pack_linears_leaves_bf16_alone():
    model = nn.Sequential(nn.Linear(8, 8)).to(torch.bfloat16)
    assert not packs(model) and pack_linears(model) == 0
    assert type(model[0]) is nn.Linear
