"""benchmarks/weight_formats.py: the int4 product it times computes x @ W^T with W quantised
to 4 bits in groups of 32 inputs (so its figure is that of a real product)."""

import torch

from benchmarks.weight_formats import GROUP, int4_product


def test_the_int4_product_is_the_product_with_the_dequantised_weight():
    torch.manual_seed(0)
    weight, x = torch.randn(96, 128), torch.randn(1, 128)
    groups = weight.view(96, 128 // GROUP, GROUP)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=1e-8)
    dequantised = (((groups - low) / scale).round() * scale + low).view(96, 128)
    out = int4_product(weight)(x.to(torch.bfloat16)).float()
    expected = x @ dequantised.t()
    assert torch.allclose(out, expected, atol=0.05 * expected.abs().max())
    assert not torch.allclose(out, x @ weight.t(), atol=1e-3)  # it is quantised
