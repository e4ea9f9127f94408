"""Benchmark: stage-1 generation throughput, batch 1 vs the recipe's batch size.

    .venv/bin/python -m eval.bench_generation --config configs/smollm2-135m-independent.yaml

The same ShareGPT first turns are generated one at a time and then in left-padded batches
(greedy, the recipe's dtype); tokens/s counts the tokens the target actually wrote (up to its
end-of-turn token), so padding and finished rows in a batch cost time but add no tokens.
"""

from __future__ import annotations

import argparse
import time

import torch

from assets.chat import render
from assets.prompts import load_sharegpt
from assets.target import end_of_turn_ids, load_target, load_tokenizer, resolve_target
from decoding.hf import generate_replies
from recipe import load_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/smollm2-135m-independent.yaml")
    parser.add_argument("--prompts", type=int, default=16, help="prompts generated each way")
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    args, overrides = parser.parse_known_args()
    cfg = load_config(args.config, overrides)
    gen = cfg.generation

    target = resolve_target(cfg.model)
    tokenizer = load_tokenizer(target, cfg.model.chat_template_kwargs)
    model = load_target(target, cfg.model.dtype, torch.device("cpu"))
    eos = end_of_turn_ids(model, tokenizer)
    conversations, _ = load_sharegpt()
    prompts = []
    for conv in conversations:
        ids = render(tokenizer, [{"role": "user", "content": conv.user_turns[0]}], True)
        if len(ids) <= args.max_prompt_tokens:
            prompts.append(ids)
        if len(prompts) == args.prompts:
            break
    prompts.sort(key=len)  # as stage 1 batches them

    def run(batch_size: int) -> tuple[int, float]:
        generate_replies(model, prompts[:1], gen, eos, tokenizer.pad_token_id)  # warm-up
        start, tokens = time.perf_counter(), 0
        for b in range(0, len(prompts), batch_size):
            replies = generate_replies(model, prompts[b : b + batch_size], gen, eos,
                                       tokenizer.pad_token_id)
            tokens += sum(len(r.token_ids) for r in replies)
        return tokens, time.perf_counter() - start

    print(f"target {target.name} ({cfg.model.dtype}), {len(prompts)} ShareGPT prompts of "
          f"{len(prompts[0])}-{len(prompts[-1])} tokens, max_new_tokens={gen.max_new_tokens}, "
          f"{'greedy' if not gen.do_sample else f'T={gen.temperature}'}, "
          f"{torch.get_num_threads()} threads")
    results = {}
    for batch_size in (1, gen.batch_size):
        tokens, seconds = run(batch_size)
        results[batch_size] = tokens / seconds
        print(f"batch {batch_size:3d}: {tokens} tokens in {seconds:.1f} s = "
              f"{tokens / seconds:.1f} tokens/s")
    print(f"speedup of batch {gen.batch_size} over batch 1: "
          f"{results[gen.batch_size] / results[1]:.2f}x")


if __name__ == "__main__":
    main()
