"""The target's fp32 matrix products on a CPU, on oneDNN's prepacked weights.

torch's fp32 `F.linear` on a CPU calls MKL's sgemm with the weight transposed. For the few rows
of a decoding step its time grows with the rows as if it read the weight once per row: on a
2-core AMD EPYC, Qwen2.5-Coder-0.5B's 151,936-token lm_head takes 41 ms at 1 row, 87 at 2, 130 at
3 and 85-98 from 4 to 9 rows (another kernel). That is the cost of verifying k drafted tokens.
oneDNN's `mkldnn_linear` on a weight converted once takes 19 ms at 1 row, 28 at 5 and 33 at 9;
a 1-token forward of the whole target drops from 155 to 82 ms (docs/evaluation.md has the
curves).

Plain decoding and speculative decoding run the same packed target, so a speedup compares like
with like. The products agree with `F.linear` to float rounding (1e-6 relative), not bit for
bit: greedy texts are compared, as always, against plain decoding on the same kernels.
"""

from __future__ import annotations

import torch
from torch import nn


class PackedLinear(nn.Module):
    """An nn.Linear (frozen, fp32) whose product runs on a oneDNN copy of its weight [N, K]."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.packed = linear.weight.detach().to_mkldnn()  # [N, K], opaque
            bias = linear.bias if linear.bias is not None else torch.zeros(self.out_features)
            self.packed_bias = bias.detach().float().to_mkldnn()  # [N]

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight [N, K], a copy (for readers such as a draft's head init)."""
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., K] fp32 -> [..., N] fp32."""
        flat = x.reshape(-1, x.shape[-1]).to_mkldnn()
        out = torch._C._nn.mkldnn_linear(flat, self.packed, self.packed_bias).to_dense()
        return out.view(*x.shape[:-1], self.out_features)


def packs(model: nn.Module) -> bool:
    """Whether pack_linears applies: fp32 weights on a CPU with oneDNN."""
    parameter = next(model.parameters(), None)
    return (parameter is not None and parameter.device.type == "cpu"
            and parameter.dtype == torch.float32 and torch.backends.mkldnn.is_available())


def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear of a frozen fp32 CPU model by a PackedLinear, in place; return how
    many. The dense weights are freed: read a packed layer's `weight` for a copy. Modules that
    others hold a reference to (a draft sharing the target's lm_head) keep their own layer."""
    if not packs(model):
        return 0
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PackedLinear(child))
                replaced += 1
    return replaced
