"""Benchmark: the target's verification cost, the time of one forward over k+1 new tokens.

    .venv/bin/python -m eval.bench_verify --config configs/smollm2-135m-independent.yaml

Speculation pays when tau tokens per forward outweigh how much slower a (k+1)-token forward is
than a 1-token one. Then the same for token trees (the chain plus w alternatives per position,
decoding/tree.py) by node count. Measured with a KV cache holding --context tokens of an MT-bench prompt,
batch 1, the recipe's dtype and eval.target_linear; each k is the median of --repeats forwards.

With --alpha (a draft's acceptance rate per draft position, as eval reports alpha_1..alpha_k)
and --draft-ms (its step), it prints what each chain length k predicts:
speedup(k) = (1 + alpha_1 + ... + alpha_k) / (verify ratio(k) + k x draft step / 1-token forward)
(decoding.acceptance.predicted_speedup), the table a recipe's eval.k is chosen from.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from assets.chat import render
from assets.prompts import load_mtbench
from assets.target import load_target, load_tokenizer, resolve_target
from decoding.acceptance import predicted_speedup
from decoding.kv import CachedLM
from decoding.tree import ancestor_mask, build_tree
from eval.speculative import pack_target
from recipe import load_config

PRODUCTS = {"torch": "torch F.linear", "packed": "packed oneDNN",
            "auto": "the faster of torch and packed oneDNN, by shape and rows"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/smollm2-135m-independent.yaml")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--k-max", type=int, default=8)
    parser.add_argument("--tree-depth", type=int, default=4)
    parser.add_argument("--tree-width-max", type=int, default=6)
    parser.add_argument("--alpha", type=lambda text: [float(a) for a in text.split(",")],
                        default=None, help="alpha_1,...,alpha_n of a draft, e.g. 0.5,0.3,0.2")
    parser.add_argument("--draft-ms", type=float, default=0.0,
                        help="the draft's step in ms, on the same CPU")
    args, overrides = parser.parse_known_args()
    cfg = load_config(args.config, overrides)
    resolved = resolve_target(cfg.model)
    tokenizer = load_tokenizer(resolved, cfg.model.chat_template_kwargs)
    target = load_target(resolved, cfg.model.dtype, torch.device("cpu"))
    products = pack_target(target, cfg.eval)
    conversations, _ = load_mtbench()
    text = " ".join(t for c in conversations for t in c.user_turns)
    prompt = render(tokenizer, [{"role": "user", "content": text}], True)[: args.context]
    ids = torch.tensor([prompt])
    print(f"target {resolved.name} ({cfg.model.dtype}, "
          f"{PRODUCTS[products]} products: eval.target_linear), "
          f"context {len(prompt)} tokens, batch 1, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    print("| k | tokens per forward | ms per forward | vs k=0 |")
    print("|---|---|---|---|")
    base = None
    ratios = []
    for k in range(0, args.k_max + 1):
        times = []
        for _ in range(args.repeats + 2):
            lm = CachedLM(target)
            lm.prefill(ids, torch.ones_like(ids))
            chunk = torch.tensor([prompt[-(k + 1):]])
            start = time.perf_counter()
            lm.extend(chunk, torch.ones_like(chunk, dtype=torch.bool))
            times.append(time.perf_counter() - start)
        ms = statistics.median(times[2:]) * 1000
        base = base or ms
        ratios.append(ms / base)
        print(f"| {k} | {k + 1} | {ms:.1f} | {ms / base:.2f}x |")

    if args.alpha:
        share = args.draft_ms / base
        print(f"\npredicted speedup of a chain of k: alpha {args.alpha}, draft step "
              f"{args.draft_ms:.1f} ms = {share:.3f} of a 1-token forward")
        print("| k | tau | verify ratio | predicted speedup |")
        print("|---|---|---|---|")
        for k in range(1, min(len(args.alpha), args.k_max) + 1):
            speedup = predicted_speedup(args.alpha[:k], ratios[k], share)
            print(f"| {k} | {1 + sum(args.alpha[:k]):.2f} | {ratios[k]:.2f} | {speedup:.2f}x |")

    # trees as the engine builds them (decoding/tree.py): a chain of --tree-depth with w
    # alternatives per position, one forward with the tree attention mask
    print(f"\ntree verification, depth {args.tree_depth}: the chain plus w alternatives per "
          "position")
    print("| w | nodes (root included) | ms per forward | vs k=0 |")
    print("|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for width in range(args.tree_width_max + 1):
        chain = torch.tensor([prompt[-args.tree_depth:]])
        alternatives = torch.randint(0, len(tokenizer), (1, args.tree_depth, width), generator=g)
        tree = build_tree(torch.tensor([prompt[-args.tree_depth - 1]]), chain,
                          alternatives if width else None)
        seen = ancestor_mask(tree.parents)
        times = []
        for _ in range(args.repeats + 2):
            lm = CachedLM(target)
            lm.prefill(ids, torch.ones_like(ids))
            start = time.perf_counter()
            lm.extend_tree(tree.tokens, tree.depth, seen, tree.valid)
            times.append(time.perf_counter() - start)
        ms = statistics.median(times[2:]) * 1000
        print(f"| {width} | {tree.size} | {ms:.1f} | {ms / base:.2f}x |")


if __name__ == "__main__":
    main()
