"""Benchmark: stage-1 throughput with the transformers backend vs the vLLM backend.

    .venv/bin/python -m eval.bench_distill_backends --config configs/smollm2-135m-independent.yaml \
        [--prompts 32] [section.key=value ...]

Runs the whole stage 1 (the recipe's prompts, turns, batch size and dtype) once per backend into
fresh folders under the cache, and prints for each: tokens the target wrote, generation tokens/s
(the generation loop alone) and the stage's wall time including model load or vLLM's engine
start; then whether both backends wrote the same conversations (ids, tokens, loss masks).
"""

from __future__ import annotations

import argparse
import shutil
import time


def main() -> None:
    import pyarrow.parquet as pq
    from accelerate import Accelerator

    from distill import run_distill
    from distill.shards import shard_files
    from recipe import cache_root, load_config

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/smollm2-135m-independent.yaml")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--backends", default="hf,vllm")
    args, overrides = parser.parse_known_args()
    rows, lines = {}, []
    for backend in args.backends.split(","):
        out = cache_root() / "bench" / f"distill-{backend}"
        shutil.rmtree(out, ignore_errors=True)
        cfg = load_config(args.config, [*overrides, f"run.output_dir={out}",
                                        f"data.max_prompts={args.prompts}",
                                        f"generation.backend={backend}"])
        start = time.perf_counter()
        summary = run_distill(cfg, Accelerator(cpu=True))
        wall = time.perf_counter() - start
        rows[backend] = sorted((r for p in shard_files(out / "data")
                                for r in pq.read_table(p).to_pylist()), key=lambda r: r["id"])
        lines.append(f"| {backend} | {summary.generated_now} | {summary.generated_tokens} | "
                     f"{summary.generated_tokens / summary.generation_seconds:.1f} | "
                     f"{wall:.0f} |")
        gen = cfg.generation
    print(f"\nstage 1, {args.prompts} ShareGPT prompts, max_turns {cfg.data.max_turns}, "
          f"{gen.max_new_tokens} new tokens per turn, batch {gen.batch_size}, {cfg.model.dtype}, "
          f"T={gen.temperature}")
    print("| backend | conversations | tokens written | generation tokens/s | stage wall s |")
    print("|---|---|---|---|---|")
    print("\n".join(lines))
    if len(rows) == 2:
        a, b = rows.values()
        keys = ("id", "input_ids", "loss_mask")
        same = sum(all(x[k] == y[k] for k in keys) for x, y in zip(a, b))
        print(f"identical conversations (ids, tokens, loss masks): {same}/{max(len(a), len(b))}")


if __name__ == "__main__":
    main()
