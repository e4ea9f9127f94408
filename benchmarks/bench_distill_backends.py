"""Benchmark: stage-1 throughput by backend and dtype, and the feature dump's, in one run.

    .venv/bin/python -m benchmarks.bench_distill_backends --config configs/smollm2-135m-eagle3.yaml \
        [--prompts 32] [--runs hf:float32,vllm:float32,vllm:bfloat16] [--vllm-batch 64] \
        [section.key=value ...]

Runs the whole stage 1 (the recipe's prompts, turns and max_new_tokens) once per backend:dtype
into fresh folders under the cache, and prints for each: tokens the target wrote, generation
tokens/s (the generation loop alone), the ratio to the first run, and the stage's wall time
including model load or vLLM's engine start (and its compilation); then how many conversations
each run wrote identically to the first (ids, tokens, loss masks: a dtype changes the data).
The hf backend runs the recipe's generation.batch_size, vllm --vllm-batch. With an EAGLE-3
recipe it then writes the offline features of the first run's data once and prints their
tokens/s and bytes per token.
"""

from __future__ import annotations

import argparse
import shutil
import time


def main() -> None:
    import pyarrow.parquet as pq
    import torch
    from accelerate import Accelerator

    from distill import run_distill
    from recipe import cache_root, load_config
    from runfolder import shard_files

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/smollm2-135m-eagle3.yaml")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--runs", default="hf:float32,vllm:float32,vllm:bfloat16",
                        help="backend:dtype pairs, the first one the reference")
    parser.add_argument("--vllm-batch", type=int, default=64)
    args, overrides = parser.parse_known_args()
    rows, lines, speeds, outs = {}, [], {}, {}
    for run in args.runs.split(","):
        backend, dtype = run.split(":")
        out = cache_root() / "bench" / f"distill-{backend}-{dtype}"
        shutil.rmtree(out, ignore_errors=True)
        batch = [f"generation.batch_size={args.vllm_batch}"] if backend == "vllm" else []
        cfg = load_config(args.config, [*overrides, f"run.output_dir={out}",
                                        f"data.max_prompts={args.prompts}",
                                        f"generation.backend={backend}", f"model.dtype={dtype}",
                                        *batch])
        start = time.perf_counter()
        summary = run_distill(cfg, Accelerator(cpu=True))
        wall = time.perf_counter() - start
        rows[run] = sorted((r for p in shard_files(out / "data")
                            for r in pq.read_table(p).to_pylist()), key=lambda r: r["id"])
        speeds[run] = summary.generated_tokens / summary.generation_seconds
        outs[run] = cfg
        first = next(iter(rows))
        keys = ("id", "input_ids", "loss_mask")
        same = sum(all(x[k] == y[k] for k in keys) for x, y in zip(rows[first], rows[run]))
        lines.append(f"| {backend} | {dtype} | {cfg.generation.batch_size} | "
                     f"{summary.generated_now} | {summary.generated_tokens} | {speeds[run]:.1f} | "
                     f"{speeds[run] / speeds[first]:.2f}x | {wall:.0f} | "
                     f"{same}/{len(rows[run])} |")
    gen = cfg.generation
    print(f"\nstage 1, {args.prompts} ShareGPT prompts, max_turns {cfg.data.max_turns}, "
          f"{gen.max_new_tokens} new tokens per turn, T={gen.temperature}, "
          f"{torch.get_num_threads()} threads")
    print("| backend | dtype | batch | conversations | tokens written | generation tokens/s | "
          "vs first | stage wall s | conversations identical to the first |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(lines))
    features(outs[next(iter(outs))])


def features(cfg) -> None:
    """The offline feature dump of a run's data (EAGLE-3 recipes): tokens/s, bytes per token."""
    from accelerate import Accelerator

    from assets.target import load_target, load_tokenizer, resolve_target
    from drafts.eagle3 import default_aux_layers
    from runfolder import run_folder
    from train.data import load_stage1
    from train.features import bytes_per_token, feature_cache

    if cfg.train.draft != "eagle3":
        print("(the recipe trains no EAGLE-3 head: no feature dump measured)")
        return
    target_ref = resolve_target(cfg.model)
    target = load_target(target_ref, cfg.model.dtype, Accelerator(cpu=True).device)
    tokenizer = load_tokenizer(target_ref)
    data = load_stage1(cfg, target_ref.fingerprint)
    examples = data.train + data.held_out
    aux = cfg.train.aux_layers or default_aux_layers(target.config.num_hidden_layers)
    shutil.rmtree(run_folder(cfg).features, ignore_errors=True)
    start = time.perf_counter()
    feature_cache(cfg, target, target_ref.fingerprint, examples, aux, tokenizer.pad_token_id,
                  log=lambda *a: None)
    seconds = time.perf_counter() - start
    tokens = sum(min(len(e.input_ids), cfg.train.max_seq_len) for e in examples)
    per_token = bytes_per_token(target.config.hidden_size, cfg.train.feature_dtype)
    print(f"\noffline features ({cfg.train.feature_dtype}, aux layers {aux} + the last hidden "
          f"state, micro-batch {cfg.train.micro_batch_size}, {cfg.model.dtype} target): "
          f"{tokens:,} tokens in {seconds:.1f} s = {tokens / seconds:.1f} tokens/s, "
          f"{per_token:,} bytes per token ({tokens * per_token / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
