"""Eval's estimate for `distill.py --plan`: our engine at batch 1, one process, each method over
eval.num_prompts x eval.max_new_tokens tokens."""

from __future__ import annotations

from plan.estimate import Sizing, StagePlan, dtype_bytes

EVAL_TOKENS_S = 30.0
"""Our engine at batch 1, per method (assumption, CPU or GPU: Python-driven steps)."""


def estimate(sizing: Sizing) -> StagePlan:
    cfg = sizing.cfg
    total, _ = sizing.target.parameters()
    tokens = cfg.eval.num_prompts * cfg.eval.max_new_tokens
    return StagePlan("eval", tokens, {}, {"target": total * dtype_bytes(cfg.model.dtype)},
                     tokens / EVAL_TOKENS_S * len(cfg.eval.methods),
                     f"assumed {EVAL_TOKENS_S:.0f} tokens/s per method at batch 1, one process")
