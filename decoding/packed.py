"""The target's fp32 matrix products on a CPU, on oneDNN's prepacked weights.

torch's fp32 `F.linear` on a CPU calls MKL's sgemm with the weight transposed. For the few rows
of a decoding step its time grows with the rows as if it read the weight once per row: on a
2-core AMD EPYC, Qwen2.5-Coder-0.5B's 151,936-token lm_head takes 41 ms at 1 row, 87 at 2, 130 at
3 and 85-98 from 4 to 9 rows (another kernel). That is the cost of verifying k drafted tokens.
oneDNN's `mkldnn_linear` on a weight converted once takes 19 ms at 1 row, 28 at 5 and 33 at 9;
a 1-token forward of the whole target drops from 155 to 82 ms (docs/evaluation.md has the
curves).

Which kernel is faster depends on the CPU: MKL picks its sgemm kernels by vendor and shape, and
on a 2-core Intel Xeon (AVX512F, no AVX512-BF16) torch's own product verifies 2 tokens at 1.12x
one token where the packed one takes 1.72x. `tune_linears` (eval.target_linear=auto) keeps both
and times them once per weight shape and number of rows on the CPU it runs on; each product
then takes the faster (`TunedLinear`), at the cost of holding the weights twice.

Plain decoding and speculative decoding run the same target, so a speedup compares like with
like. The products agree with `F.linear` to float rounding (1e-6 relative), not bit for bit:
greedy texts are compared, as always, against plain decoding on the same kernels.
"""

from __future__ import annotations

import statistics
import time

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


def cpu_model() -> str:
    """This CPU's model name (/proc/cpuinfo's, as lscpu shows it), else the platform's."""
    import platform
    from pathlib import Path

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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


TUNED_ROWS = 12
"""Row counts 1..TUNED_ROWS are timed; a product of more rows takes the choice at TUNED_ROWS."""


class TunedLinear(nn.Module):
    """An nn.Linear (frozen, fp32) with both products at hand, torch's F.linear and oneDNN's
    packed one, taking for each number of rows the one that timed faster on this CPU."""

    def __init__(self, linear: nn.Linear, packed_for: list[bool]):
        super().__init__()
        self.dense, self.packed = linear, PackedLinear(linear)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_for = packed_for
        """[TUNED_ROWS + 1]: rows -> whether the packed product is the faster (index 0 unused)."""

    @property
    def weight(self) -> torch.Tensor:
        return self.dense.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.dense.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        return (self.packed if self.packed_for[min(rows, TUNED_ROWS)] else self.dense)(x)


def faster_kernels(linear: nn.Linear, repeats: int = 3) -> list[bool]:
    """For rows 1..TUNED_ROWS: whether oneDNN's packed product beats F.linear on this weight
    (median of repeats after one warm-up each) -> [TUNED_ROWS + 1] (index 0 unused)."""
    packed = PackedLinear(linear)
    choice = [False]
    with torch.no_grad():
        for rows in range(1, TUNED_ROWS + 1):
            x = torch.randn(rows, linear.in_features)
            times = {}
            for name, product in (("torch", linear), ("packed", packed)):
                runs = []
                for _ in range(repeats + 1):
                    start = time.perf_counter()
                    product(x)
                    runs.append(time.perf_counter() - start)
                times[name] = statistics.median(runs[1:])
            choice.append(times["packed"] < times["torch"])
    return choice


def tune_linears(model: nn.Module, known: dict | None = None) -> dict[tuple[int, int], list[bool]]:
    """Replace every nn.Linear of a frozen fp32 CPU model by a TunedLinear, in place, timing each
    distinct weight shape once (unless known, {(out, in): packed_for}, already holds it: the
    same CPU's earlier choice, so that runs repeat) -> {(out, in): packed_for}; {} where
    packs() says no."""
    if not packs(model):
        return {}
    choices: dict[tuple[int, int], list[bool]] = {
        shape: list(c) for shape, c in (known or {}).items() if len(c) == TUNED_ROWS + 1}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                shape = (child.out_features, child.in_features)
                if shape not in choices:
                    choices[shape] = faster_kernels(child)
                setattr(parent, name, TunedLinear(child, choices[shape]))
    return choices


def describe_choices(choices: dict[tuple[int, int], list[bool]]) -> str:
    """'896x896: packed at rows 1-2, torch at 3-12; ...' for a log line."""
    parts = []
    for (out, features), packed_for in choices.items():
        runs, start = [], 1
        for rows in range(2, TUNED_ROWS + 2):
            if rows > TUNED_ROWS or packed_for[rows] != packed_for[start]:
                end = rows - 1
                span = f"{start}" if end == start else f"{start}-{end}"
                runs.append(f"{'packed' if packed_for[start] else 'torch'} at {span}")
                start = rows
        parts.append(f"{out}x{features}: {', '.join(runs)}")
    return "; ".join(parts)
