"""Int8 weights for a draft's matrix products: each output row of a weight stored as int8 with
its own scale (weight-only quantisation, scale = the row's largest |w| / 127), multiplied on bf16
activations by torch._weight_int8pack_mm. A draft's step on a CPU reads its weights from memory
again after every target forward, so a GEMV's cost is its weight's bytes: a quarter of fp32's.
Speculative decoding stays lossless: verification reads the quantised draft's own q."""

from __future__ import annotations

import copy

import torch
from torch import nn


class Int8Linear(nn.Module):
    """nn.Linear's forward over a weight [N, K] kept as int8 rows and bf16 scales [N]."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("qweight", qweight)  # [N, K] int8
        self.register_buffer("scale", scale)  # [N] bf16
        self.register_buffer("bias", bias)  # [N] or None

    @classmethod
    def quantise(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        """A weight [N, K] (and bias [N]) -> the layer with its rows in int8."""
        with torch.no_grad():
            scale = weight.float().abs().amax(1).clamp(min=1e-12) / 127  # [N]
            rows = (weight.float() / scale[:, None]).round().clamp(-127, 127)
            return cls(rows.to(torch.int8), scale.to(torch.bfloat16),
                       None if bias is None else bias.detach().clone())

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., K] -> [..., N] in x's dtype."""
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        out = torch._weight_int8pack_mm(flat, self.qweight, self.scale)
        out = out.view(*x.shape[:-1], -1).to(x.dtype)
        return out if self.bias is None else out + self.bias.to(x.dtype)

    def rows(self, ids: torch.Tensor) -> Int8Linear:
        """The layer restricted to output rows ids [n] (a draft vocabulary's head)."""
        return Int8Linear(self.qweight[ids].contiguous(), self.scale[ids],
                          None if self.bias is None else self.bias[ids])

    def dequantised(self) -> torch.Tensor:
        """The weight [N, K] the products compute with, in fp32 (for tests and checks)."""
        return self.qweight.float() * self.scale.float()[:, None]


def int8_copy(module: nn.Module, skip: tuple[str, ...] = ()) -> nn.Module:
    """A copy of module whose nn.Linear layers are Int8Linear, but those whose own name is in
    skip (layers whose fp weight other code reads); module itself is left as it was."""
    quantised = copy.deepcopy(module)
    for name, child in list(quantised.named_modules()):
        parent, _, own = name.rpartition(".")
        if isinstance(child, nn.Linear) and own not in skip:
            setattr(quantised.get_submodule(parent), own,
                    Int8Linear.quantise(child.weight, child.bias))
    return quantised.eval()
