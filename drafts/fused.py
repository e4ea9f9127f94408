"""Inference forms the drafts' engines share: rotary tables, products fused over one input,
RMSNorm in one call, and compiled step functions (eval.draft_compile) that say what to do when
they cannot compile."""

from __future__ import annotations

import os
import re
import types
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from decoding.quantise import QUANTISED
from recipe import ConfigError, cache_root


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm (and Qwen's): normalised in fp32, scaled by the weight in x's dtype."""
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def fuse_linears(linears: list[nn.Module]):
    """Linears over one input -> one product whose output is theirs concatenated: nn.Linear
    weights (and biases, zeros where a layer has none) stacked, or quantised layers of one
    format with their rows stacked (decoding/quantise.py: each row keeps its quantisation)."""
    for form in QUANTISED:
        if all(type(linear) is form for linear in linears):
            biases = [linear.bias for linear in linears]
            bias = None if all(b is None for b in biases) else torch.cat([
                torch.zeros(linear.out_features, dtype=torch.float32,
                            device=linear.scale.device) if b is None else b.float()
                for linear, b in zip(linears, biases)])
            return form.cat(linears, bias)
    if not all(isinstance(linear, nn.Linear) for linear in linears):
        raise TypeError("fuse_linears: nn.Linear layers or quantised layers of one format, "
                        f"not a mix: {[type(linear).__name__ for linear in linears]}")
    with torch.no_grad():
        weight = torch.cat([linear.weight for linear in linears])
        biases = [linear.bias for linear in linears]
        bias = None if all(b is None for b in biases) else torch.cat([
            torch.zeros_like(linear.weight[:, 0]) if b is None else b
            for linear, b in zip(linears, biases)])
    return partial(F.linear, weight=weight, bias=bias)


class RotaryTable:
    """positions -> rotary cos, sin from a model's rotary embedding (HF's rotary_emb(x,
    positions), its attention scaling included), read from a table of positions that at least
    doubles when outgrown, except for rope types that rescale with the length."""

    def __init__(self, rotary: nn.Module, head_dim: int):
        self.rotary = rotary
        self.table = None if "dynamic" in str(getattr(rotary, "rope_type", "")) else (
            torch.zeros(0, head_dim), torch.zeros(0, head_dim))

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, limit: int):
        """positions [B, t], all below limit -> cos, sin [B, 1, t, d] in x's dtype."""
        if self.table is None:
            cos, sin = self.rotary(x, positions)
        else:
            if limit > len(self.table[0]):
                length = max(2 * len(self.table[0]), limit, 256)
                every = torch.arange(length, device=x.device)[None]
                self.table = tuple(t[0] for t in self.rotary(x.float(), every))
            cos, sin = (t[positions] for t in self.table)
        return cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)


class CompiledSteps:
    """A draft's step functions compiled with torch.compile (fullgraph; inductor's C++ wrapper
    on a CPU, which runs the kernels without Python between them), by name. A function's first
    call compiles it; a failure there (no C++ compiler, an operator inductor cannot lower) is a
    ConfigError that says what to do. Inductor's code is cached under the draftsmith cache
    unless TORCHINDUCTOR_CACHE_DIR says otherwise."""

    def __init__(self, device: torch.device, what: str):
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))
        self.options = {"cpp_wrapper": True} if device.type == "cpu" else {}
        self.what = what  # "the EAGLE-3 head's", for messages
        self._compiled: dict = {}
        self._ran: set[str] = set()  # functions that compiled and ran once

    def __contains__(self, name: str) -> bool:
        return name in self._compiled

    def add(self, name: str, function, fixed: bool = False) -> None:
        """fixed: function is a bound method, and what it reaches through its object (a
        FusedDecoder's weights, modules and settings) never changes while this CompiledSteps
        lives. Then only its arguments and torch's global state are checked before each call,
        and it runs a copy of the method's code of its own: dynamo keeps compiled code per code
        object, and without guards on the object nothing would tell another object's compiled
        code from this one's."""
        options = self.options
        if fixed:
            options = {**options, "guard_filter_fn": guards_on_arguments}
            method = function.__func__
            own = types.FunctionType(method.__code__.replace(), method.__globals__,
                                     method.__name__, method.__defaults__, method.__closure__)
            function = types.MethodType(own, function.__self__)
        self._compiled[name] = torch.compile(function, fullgraph=True, options=options)

    def __call__(self, name: str, *args):
        if name in self._ran:
            return self._compiled[name](*args)
        try:
            out = self._compiled[name](*args)
        except Exception as error:
            from torch._dynamo.exc import BackendCompilerFailed, Unsupported
            from torch._inductor.exc import InductorError

            if not isinstance(error, BackendCompilerFailed | InductorError | Unsupported):
                raise
            raise ConfigError(
                f"eval.draft_compile=true: torch.compile could not compile {self.what} "
                f"{name} step ({type(error).__name__}: {str(error).splitlines()[0][:300]}). "
                "Inductor needs a C++ compiler on a CPU (g++, or $CXX) and Triton on a GPU; "
                "install it, or set eval.draft_compile=false to draft eager.") from error
        self._ran.add(name)
        return out


def guards_on_arguments(entries) -> list[bool]:
    """torch.compile's guard filter for a fixed bound method (CompiledSteps.add): dynamo guards
    every object a compiled function reaches and checks them all before each call (~470 guards
    for a 6-layer decoder's step, ~30 of them on its arguments); this keeps the guards on the
    arguments, their shapes and torch's global state, and drops those on the method's object
    (self) and on module globals (imports)."""
    return [not (re.match(r"self\b", entry.name) or entry.is_global) for entry in entries]


def mark_capacity_dynamic(keys: list[torch.Tensor], values: list[torch.Tensor],
                          mask: torch.Tensor) -> None:
    """A cache's whole buffers (drafts.slots.SlotKV: keys, values [B, kv, capacity, d], mask
    [B, capacity]) with their capacity a dynamic dimension: it doubles as a generation grows,
    and one compilation serves every capacity."""
    for buffer in keys + values:
        torch._dynamo.maybe_mark_dynamic(buffer, 2)
    torch._dynamo.maybe_mark_dynamic(mask, 1)
