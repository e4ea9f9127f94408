"""Run real vLLM on token-id prompts, in its own process, and report texts and spec-decode counters.

    python -m serving.vllm_run REQUEST.json RESULT.json

REQUEST: {"target": folder, "dtype": "float32", "prompts": [[ids]], "max_new_tokens": n,
"stop_token_ids": [...], "runs": {"<name>": speculative_config or null}, "enforce_eager": bool,
optionally "temperature", "top_p", "top_k", "seed" (prompt i sampled with seed + i)}.
Each run starts one vLLM engine (all prompts batched), then frees it. vLLM starts its workers
with spawn, so this module runs as __main__ (serving/validate.py calls it as a subprocess).
RESULT: {"<name>": {"tokens": [[ids]], "seconds": s, "drafts", "draft_tokens", "accepted",
"accepted_per_position"}}.
"""

from __future__ import annotations

import json
import sys
import time

COUNTERS = {"vllm:spec_decode_num_drafts": "drafts",
            "vllm:spec_decode_num_draft_tokens": "draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "accepted",
            "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_per_position"}


def run(request: dict) -> dict:
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
                  enforce_eager=request.get("enforce_eager", False))
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        result = {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "seconds": seconds}
        for metric in llm.get_metrics():
            if metric.name in COUNTERS:
                value = getattr(metric, "values", None)
                result[COUNTERS[metric.name]] = (list(value) if value is not None
                                                 else metric.value)
        results[name] = result
        del llm
    return results


if __name__ == "__main__":
    request_path, result_path = sys.argv[1:3]
    with open(request_path) as f:
        request = json.load(f)
    result = run(request)
    with open(result_path, "w") as f:
        json.dump(result, f)
