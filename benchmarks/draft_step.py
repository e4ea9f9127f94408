"""Benchmark: what one draft step costs, per draft kind, next to one target forward.

    .venv/bin/python -m benchmarks.draft_step [--kinds independent,medusa,eagle3,dflash,pard]
        [--k-max 8] [--new-tokens 48] [--prompts 2] [--dtype float32] [--profile-k 4]
        [--rounds 3]

A kind written <kind>@<N> (independent@8192) gets a draft vocabulary of N tokens: its head
scores N tokens (the first N ids: which ones does not change a step's cost); independent:<n>
drafts with the target's first n layers (train.draft=layer-truncated:<n>) instead of the
recipe's, e.g. independent:4@8192. <kind>+int8 runs the draft on int8 weights, +int4 on int4
weights (eval.draft_weights: decoding/quantise.py), e.g. eagle3+int8, independent@8192+int4;
+compile with compiled steps (eval.draft_compile; EAGLE-3, independent and PARD drafts), e.g.
eagle3+int8+compile, whose compilation runs before the timed steps.

Speculation pays only when the draft's step is cheap beside the target's forward: the speedup is
tau x t_forward / (t_draft_step + t_verify). For each kind, drafts in the shapes of the shipped
recipes (configs/smollm2-135m-<kind>.yaml: their draft, block size, draft vocabulary) are built
from the embedded target, untrained, and run by our engine greedy on MT-bench questions, batch
1, at k = 1..k-max (up to what the kind drafts). It prints per k the draft's milliseconds per
drafting step (the engine's own clock, decoding/engine.py) and its ratio to a 1-token target
forward measured the same way (a KV cache holding the question), as the median over --rounds
rounds, each of which measures every kind and k against its own target forward; then, at
--profile-k, torch.profiler's view of the draft steps: the operators that take the time, and the
share left to Python between them. The drafts are untrained: their products cost what a trained
draft's do, but they are rarely accepted, and the accept step (re-running the head or draft over
the accepted tokens, cropping its cache) does less work when little is accepted, so the figures
are lower bounds of a trained draft's step, and are printed as such. Writes
benchmarks/results/draft_step.json when --out is given.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from assets.chat import render
from assets.prompts import load_mtbench
from assets.target import end_of_turn_ids, load_target, load_tokenizer, resolve_target
from decoding.engine import DecodeSettings, generate
from decoding.kv import CachedLM
from drafts import engine_draft, load_draft
from recipe import ModelConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("independent", "medusa", "eagle3", "dflash", "pard")


def build_draft(kind: str, target, tokenizer, examples: list, folder: Path, dtype, device,
                weights: str = "model", compile: bool = False):
    """The recipe's draft of this kind, untrained, saved to folder and loaded as eval does."""
    from train.data import Example
    from train.loop import check_train_config

    kind, _, vocabulary = kind.partition("@")
    kind, _, layers = kind.partition(":")
    if layers and kind != "independent":
        raise SystemExit(f"--kinds {kind}:{layers}: a layer count is an independent draft's "
                         "(independent:4@8192).")
    cfg = load_config(ROOT / "configs" / f"smollm2-135m-{kind}.yaml", [])
    if kind == "independent":  # a spec, not a folder: the target's first layers
        spec = f"layer-truncated:{layers}" if layers else cfg.train.draft
        loaded = load_draft(spec, target, tokenizer, dtype, device, weights, compile)
        if vocabulary:
            loaded.model.config.draft_vocabulary = list(range(int(vocabulary)))
            loaded.name += f", draft vocabulary {vocabulary}"
        return loaded
    tcfg = cfg.train
    draft_kind = check_train_config(tcfg)
    torch.manual_seed(0)
    rows = [Example(str(i), e, [0] * (len(e) // 2) + [1] * (len(e) - len(e) // 2))
            for i, e in enumerate(examples)]
    draft = draft_kind.build(tcfg, target, tokenizer, rows, lambda *a: None)
    draft.eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return load_draft(str(folder), target, tokenizer, dtype, device, weights, compile)


def forward_ms(target, prompt: list[int], repeats: int = 20) -> float:
    """Median ms of one 1-token target forward after prompt (batch 1, KV cache)."""
    ids = torch.tensor([prompt])
    times = []
    for _ in range(repeats + 2):
        lm = CachedLM(target)
        lm.prefill(ids, torch.ones_like(ids))
        start = time.perf_counter()
        lm.extend(ids[:, -1:], torch.ones(1, 1, dtype=torch.bool))
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[2:])


def draft_ms(target, prompts, eos, draft, k: int, new_tokens: int) -> tuple[float, int]:
    """ms per drafting step over the prompts, one at a time -> (ms, steps)."""
    seconds, steps = 0.0, 0
    for prompt in prompts:
        ids = torch.tensor([prompt])
        gen = generate(target, ids, torch.ones_like(ids), DecodeSettings(max_new_tokens=new_tokens,
                                                                          k=k), eos, draft)
        seconds += gen.draft_seconds
        steps += len(gen.k_used)
    return 1000 * seconds / max(steps, 1), steps


def _below(event):
    for child in event.cpu_children:
        yield child
        yield from _below(child)


def profile(target, prompts, eos, draft, k: int, new_tokens: int) -> dict:
    """torch.profiler over one question at k: inside the engine's drafting (its "draft"
    ranges, decoding/engine.py), the operators that take the time by self time, and the share
    of the draft's wall time no operator accounts for (Python, allocation, bookkeeping)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        _, steps = draft_ms(target, prompts[:1], eos, draft, k, new_tokens)
    ranges = [e for e in prof.events() if e.name == "draft"]  # propose and accept, each step
    wall_us = sum(e.cpu_time_total for e in ranges)
    ops: dict[str, list[float]] = {}
    for event in ranges:
        for child in _below(event):
            entry = ops.setdefault(child.name, [0.0, 0])
            entry[0] += child.self_cpu_time_total
            entry[1] += 1
    in_ops = sum(us for us, _ in ops.values())
    top = sorted(ops.items(), key=lambda item: -item[1][0])[:12]
    return {"steps": steps, "draft_ms_per_step": wall_us / 1000 / max(steps, 1),
            "outside_operators": 1 - in_ops / wall_us if wall_us else 0.0,
            "top_ops": [{"op": name, "self_ms_per_step": us / 1000 / max(steps, 1),
                         "share": us / wall_us, "calls_per_step": n / max(steps, 1)}
                        for name, (us, n) in top]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--k-max", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--profile-k", type=int, default=4, help="0: no profile")
    parser.add_argument("--rounds", type=int, default=3,
                        help="every kind and k measured once per round; medians reported")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    dtype, device = getattr(torch, args.dtype), torch.device("cpu")
    resolved = resolve_target(ModelConfig())
    tokenizer = load_tokenizer(resolved, {})
    target = load_target(resolved, args.dtype, device)
    conversations, _ = load_mtbench()
    prompts = [render(tokenizer, [{"role": "user", "content": c.user_turns[0]}], True)
               for c in conversations[: args.prompts]]
    eos = end_of_turn_ids(target, tokenizer)
    results = {"dtype": args.dtype, "threads": torch.get_num_threads(), "rounds": args.rounds,
               "kinds": {}}
    with tempfile.TemporaryDirectory() as tmp:
        drafts = {}  # kind -> (loaded, engine draft, largest k)
        for kind in args.kinds.split(","):
            built, *options = kind.split("+")
            formats = [o for o in options if o in ("int8", "int4")]
            if set(options) - {"int8", "int4", "compile"} or len(formats) > 1:
                raise SystemExit(f"--kinds {kind}: the options are one of +int8 and +int4, "
                                 "and +compile (eagle3+int8+compile).")
            loaded = build_draft(built, target, tokenizer, prompts, Path(tmp) / kind, dtype,
                                 device, (formats or ["model"])[0], "compile" in options)
            draft = engine_draft(loaded)
            top_k = min(args.k_max, loaded.max_k or args.k_max)
            if "compile" in options:  # the first steps compile: not a step's cost
                start = time.perf_counter()
                for k in range(1, top_k + 1):
                    draft_ms(target, prompts[:1], eos, draft, k, 8)
                print(f"{kind}: compiled in {time.perf_counter() - start:.0f} s")
            drafts[kind] = loaded, draft, top_k
        # rounds: every kind and k once per round, each against that round's target forward,
        # so that the machine's drift over the run spreads over all of them alike
        forwards, measured = [], {kind: {} for kind in drafts}
        for _ in range(args.rounds):
            forwards.append(forward_ms(target, prompts[0]))
            for kind, (_, draft, top_k) in drafts.items():
                for k in range(1, top_k + 1):
                    ms, steps = draft_ms(target, prompts, eos, draft, k, args.new_tokens)
                    measured[kind].setdefault(k, []).append((ms, ms / forwards[-1], steps))
        base = statistics.median(forwards)
        results["forward_ms"], results["forward_ms_rounds"] = base, forwards
        print(f"target {resolved.name} ({args.dtype}), batch 1, {torch.get_num_threads()} "
              f"threads: a 1-token forward takes {base:.1f} ms (median over {args.rounds} "
              f"rounds of the median of 20: {', '.join(f'{f:.1f}' for f in forwards)})")
        for kind, (loaded, draft, top_k) in drafts.items():
            rows = {}
            print(f"\n{kind}: {loaded.name}, untrained (a lower bound of a trained draft's step)")
            print("| k | ms per draft step (at least) | vs a 1-token target forward (rounds' "
                  "range) | steps |")
            print("|---|---|---|---|")
            for k, runs in measured[kind].items():
                ratios = [ratio for _, ratio, _ in runs]
                rows[k] = {"ms": statistics.median(ms for ms, _, _ in runs),
                           "ratio": statistics.median(ratios), "ratios": ratios,
                           "steps": runs[0][2]}
                print(f"| {k} | {rows[k]['ms']:.1f} | {rows[k]['ratio']:.0%} ({min(ratios):.0%}"
                      f"-{max(ratios):.0%}) | {rows[k]['steps']} |")
            found = {"name": loaded.name, "per_k": rows}
            if args.profile_k and args.profile_k <= top_k:
                found["profile"] = profile(target, prompts, eos, draft, args.profile_k,
                                           args.new_tokens)
                seen = found["profile"]
                print(f"profile of {seen['steps']} draft steps at k={args.profile_k} (one "
                      f"question, profiler on: {seen['draft_ms_per_step']:.1f} ms a step): "
                      f"{seen['outside_operators']:.0%} of the time outside any operator")
                for op in seen["top_ops"]:
                    print(f"  {op['op'][:60]:<60} {op['self_ms_per_step']:7.2f} ms/step "
                          f"{op['share']:5.1%}  {op['calls_per_step']:.0f} calls/step")
            results["kinds"][kind] = found
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
