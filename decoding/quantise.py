"""Quantised weights for a draft's matrix products (weight-only; activations in bf16). A draft's
step on a CPU reads its weights from memory again after every target forward, and at one token
a product's cost is its weight's bytes. Speculative decoding stays lossless: verification reads
the quantised draft's own q; only acceptance may move, and is measured.

- int8 (Int8Linear): each output row as int8 with its own scale (the row's largest |w| / 127),
  multiplied by torch._weight_int8pack_mm.
- int4 (Int4Linear): each row in groups of GROUP inputs, 16 levels from the group's least to its
  largest weight (a scale and a zero per group), multiplied by
  torch._weight_int4pack_mm_for_cpu: half int8's bytes, on CPUs only. A layer whose inputs are
  not a multiple of GROUP keeps int8 rows.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from recipe import ConfigError

GROUP = 32  # int4: one scale and zero per GROUP inputs of a row


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

    @classmethod
    def cat(cls, linears: list[Int8Linear], bias: torch.Tensor | None) -> Int8Linear:
        """Layers over one input -> one whose rows are theirs stacked (each keeps its scale)."""
        return cls(torch.cat([linear.qweight for linear in linears]),
                   torch.cat([linear.scale for linear in linears]), bias)

    def dequantised(self) -> torch.Tensor:
        """The weight [N, K] the products compute with, in fp32 (for tests and checks)."""
        return self.qweight.float() * self.scale.float()[:, None]


class Int4Linear(nn.Module):
    """nn.Linear's forward over a weight [N, K] kept as 4-bit levels q in 0..15 per group of
    GROUP inputs, w = (q - 8) * scale + zero with bf16 scale and zero [N, K / GROUP]. Buffers:
    the levels two to a byte, row by row (what rows and cat read), and the same in the CPU
    kernel's layout with its [K / GROUP, N', 2] scales and zeros, N' = N rounded up to 16."""

    def __init__(self, levels: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 bias: torch.Tensor | None = None):
        """levels [N, K] uint8 in 0..15; scale, zero [N, K / GROUP] bf16; bias [N] or None."""
        super().__init__()
        if levels.device.type != "cpu":
            raise ConfigError(f"int4 draft weights run on a CPU kernel "
                              f"(torch._weight_int4pack_mm_for_cpu), not on {levels.device}: "
                              "set eval.draft_weights=int8 or model.")
        n, k = levels.shape
        self.register_buffer("packed", levels[:, 0::2] | levels[:, 1::2] << 4)  # [N, K/2]
        self.register_buffer("scale", scale)
        self.register_buffer("zero", zero)
        self.register_buffer("bias", bias)
        pad = -n % 16  # the kernel packs rows in blocks of 16: padded rows compute zeros
        padded = torch.cat([levels, levels.new_full((pad, k), 8)]).to(torch.int32)
        self.register_buffer("kernel_weight",
                             torch._convert_weight_to_int4pack_for_cpu(padded, 1))
        scale_zero = torch.stack([scale, zero], -1)  # [N, K/GROUP, 2]
        scale_zero = torch.cat([scale_zero, scale_zero.new_zeros(pad, k // GROUP, 2)])
        self.register_buffer("kernel_scale_zero", scale_zero.transpose(0, 1).contiguous())

    @classmethod
    def quantise(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int4Linear:
        """A weight [N, K], K a multiple of GROUP (and bias [N]) -> the layer in int4 groups."""
        n, k = weight.shape
        with torch.no_grad():
            groups = weight.float().view(n, k // GROUP, GROUP)
            low, high = groups.amin(-1), groups.amax(-1)  # [N, K/GROUP]
            scale = ((high - low) / 15).clamp(min=1e-8)
            zero = (low + 8 * scale).to(torch.bfloat16)  # rounded as the kernel reads it
            scale = scale.to(torch.bfloat16)
            # levels for the rounded scale and zero: w ~ (q - 8) * scale + zero
            q = (groups - zero.float()[..., None]) / scale.float()[..., None] + 8
            levels = q.round().clamp(0, 15).to(torch.uint8).view(n, k)
            return cls(levels, scale, zero, None if bias is None else bias.detach().clone())

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    def levels(self) -> torch.Tensor:
        """[N, K] uint8 in 0..15."""
        return torch.stack([self.packed & 15, self.packed >> 4], -1).flatten(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., K] -> [..., N] in x's dtype."""
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        out = torch._weight_int4pack_mm_for_cpu(flat, self.kernel_weight, GROUP,
                                                self.kernel_scale_zero)
        out = out[:, :self.out_features].reshape(*x.shape[:-1], -1).to(x.dtype)
        return out if self.bias is None else out + self.bias.to(x.dtype)

    def rows(self, ids: torch.Tensor) -> Int4Linear:
        """The layer restricted to output rows ids [n] (a draft vocabulary's head)."""
        return Int4Linear(self.levels()[ids], self.scale[ids], self.zero[ids],
                          None if self.bias is None else self.bias[ids])

    @classmethod
    def cat(cls, linears: list[Int4Linear], bias: torch.Tensor | None) -> Int4Linear:
        """Layers over one input -> one whose rows are theirs stacked (each keeps its groups)."""
        return cls(torch.cat([linear.levels() for linear in linears]),
                   torch.cat([linear.scale for linear in linears]),
                   torch.cat([linear.zero for linear in linears]), bias)

    def dequantised(self) -> torch.Tensor:
        """The weight [N, K] the products compute with, in fp32 (for tests and checks)."""
        n, k = self.packed.shape[0], 2 * self.packed.shape[1]
        q = self.levels().float().view(n, k // GROUP, GROUP) - 8
        return (q * self.scale.float()[..., None] + self.zero.float()[..., None]).view(n, k)


QUANTISED = (Int8Linear, Int4Linear)


def quantise_linear(weight: torch.Tensor, bias: torch.Tensor | None, weights: str):
    """A weight [N, K] (and bias) -> its layer in format weights ('int8' or 'int4'; an int4
    layer whose K is not a multiple of GROUP is int8)."""
    if weights == "int4" and weight.shape[1] % GROUP == 0:
        return Int4Linear.quantise(weight, bias)
    return Int8Linear.quantise(weight, bias)


def quantised_copy(module: nn.Module, weights: str, skip: tuple[str, ...] = ()) -> nn.Module:
    """A copy of module whose nn.Linear layers are quantised to weights ('int8' or 'int4'), but
    those whose own name is in skip (layers whose fp weight other code reads); module itself is
    left as it was."""
    quantised = copy.deepcopy(module)
    for name, child in list(quantised.named_modules()):
        parent, _, own = name.rpartition(".")
        if isinstance(child, nn.Linear) and own not in skip:
            setattr(quantised.get_submodule(parent), own,
                    quantise_linear(child.weight, child.bias, weights))
    return quantised.eval()
