"""Benchmark: speculative decoding inside llama.cpp, by llama.cpp's own timings.

    .venv/bin/python -m benchmarks.llamacpp_speed --config configs/qwen2.5-coder-0.5b-eagle3.yaml \
        --draft-gguf <run>/export/eagle3-gguf/draft-f32.gguf \
        --arms plain,draft-eagle3:2,draft-eagle3:3,ngram-simple:3 [section.key=value ...]

The target is a GGUF file (--target-gguf; for model.target embedded:Qwen2.5-Coder-0.5B-Instruct
its own Q4_K_M file by default). Each arm starts `llama-server` (one slot, `-t` = CPU cores) and
sends the config's eval prompts one by one, greedy, eval.max_new_tokens each; an arm is
`plain` (no draft) or `<spec-type>[+<spec-type>...]:<k>[@<p_min>]` (llama.cpp's --spec-type, with
k draft tokens a step, fixed unless @p_min names --spec-draft-p-min: for draft-dspark, a step's
drafted tokens up to the first the confidence head puts below p_min, adaptive verification). Speed is llama.cpp's `timings.predicted_ms`
of each request (decoding after the prompt, as llama-server reports it); plain runs first and
last, and each prompt's speedup is its tokens/s over the mean of its two plain runs. Printed:
tokens/s, speedup (median and quartiles over prompts, pooled with a bootstrap 95 % interval
over prompts), tau and alpha_k from llama-server's counters, and texts identical to plain.

With --verify-curve 1,2,3,5,9 it first prints llama.cpp's own verification cost: the time of
one forward over n new tokens after a cached --context-token prefix (llama-server's
`timings.prompt_ms` of a request that extends its cached prompt by n tokens), median of 7, as
a ratio to one token: what a chain of k = n - 1 must beat.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from assets.target import EMBEDDED, embedded, embedded_gguf, load_tokenizer, resolve_target
from eval.speculative import quantile, speedup_stats
from recipe import ConfigError, load_config
from runfolder.prompts import load_eval_prompts
from runfolder.provenance import cpu_name
from serving.engines.base import Counters
from serving.engines.llamacpp import LlamaServer, per_request
from serving.engines.llamacpp_build import ensure_llamacpp

DRAFT_TYPES = ("draft-simple", "draft-eagle3", "draft-mtp", "draft-dflash", "draft-dspark")


@dataclass
class Arm:
    name: str
    spec_types: list[str] = field(default_factory=list)
    k: int = 0
    p_min: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Arm:
        if text == "plain":
            return cls(text)
        types, _, rest = text.partition(":")
        k, _, p_min = rest.partition("@")
        if not k.isdigit() or int(k) < 1 or not _probability(p_min or "0"):
            raise ConfigError(f"--arms {text!r}: write plain or <spec-type>[+<spec-type>]:<k>"
                              "[@<p_min in [0, 1)>], e.g. draft-eagle3:2, "
                              "draft-eagle3+ngram-simple:3 or draft-dspark:4@0.5.")
        return cls(text, types.split("+"), int(k), float(p_min or 0))

    @property
    def needs_draft(self) -> bool:
        return any(t in DRAFT_TYPES for t in self.spec_types)


def _probability(text: str) -> bool:
    try:
        return 0.0 <= float(text) < 1.0
    except ValueError:
        return False


@dataclass
class ArmRun:
    tokens: list[list[int]]
    predicted_ms: list[float]
    counters: Counters
    """Over all prompts; alpha positions 1..k (llama.cpp's n-gram types may draft more)."""
    accepted: int
    """Draft tokens accepted, at every position."""
    k: int = 0


def pooled_speedup_interval(arm_ms: list[float], arm_n: list[int], plain_ms: list[float],
                            plain_n: list[int], draws: int = 2000, seed: int = 0):
    """Pooled speedup (plain ms per token over the arm's), with a 95 % bootstrap interval over
    prompts (prompts resampled with replacement) -> (speedup, low, high)."""
    def ratio(ix):
        return (sum(plain_ms[i] for i in ix) / sum(plain_n[i] for i in ix)) / (
            sum(arm_ms[i] for i in ix) / sum(arm_n[i] for i in ix))

    rng, n = random.Random(seed), len(arm_ms)
    samples = sorted(ratio([rng.randrange(n) for _ in range(n)]) for _ in range(draws))
    return ratio(range(n)), quantile(samples, 0.025), quantile(samples, 0.975)


def run_arm(llama, target: Path, draft: Path | None, arm: Arm, prompts: list[list[int]],
            max_new_tokens: int) -> ArmRun:
    server = LlamaServer(llama, target, draft if arm.needs_draft else None,
                         ",".join(arm.spec_types) or None, arm.k, p_min=arm.p_min)
    tokens, ms = [], []
    with server:
        server.complete(prompts[0], 8)  # warm-up, not counted
        before = server.counters()
        for prompt in prompts:
            reply = server.completion(prompt, max_new_tokens)
            tokens.append(list(reply["tokens"]))
            ms.append(float(reply["timings"]["predicted_ms"]))
        after = server.counters()
    return ArmRun(tokens, ms, per_request(after, before, arm.k),
                  after["accepted"] - before["accepted"], arm.k)


def verify_curve(llama, target: Path, sizes: list[int], context: int = 256,
                 repeats: int = 7) -> dict[int, float]:
    """n new tokens after a cached context-token prefix -> llama.cpp's median forward ms."""
    rng = random.Random(0)
    prefix = [rng.randrange(1000, 20000) for _ in range(context)]
    curve = {}
    with LlamaServer(llama, target) as server:
        for n in sizes:
            times = []
            for _ in range(repeats):
                server.completion(prefix, 0, cache_prompt=True)
                extra = [rng.randrange(1000, 20000) for _ in range(n)]
                reply = server.completion(prefix + extra, 0, cache_prompt=True)
                if reply["timings"]["prompt_n"] != n:
                    raise RuntimeError(f"llama-server processed {reply['timings']['prompt_n']} "
                                       f"new tokens, not {n}: its prompt cache was not reused.")
                times.append(float(reply["timings"]["prompt_ms"]))
            curve[n] = quantile(times, 0.5)
    return curve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--target-gguf", default=None,
                        help="the target as GGUF (default: an embedded target's own file)")
    parser.add_argument("--draft-gguf", default=None, help="the draft (arms of a draft-* type)")
    parser.add_argument("--arms", default="plain,ngram-simple:3",
                        help="comma-separated: plain, <spec-type>[+<spec-type>...]:<k>")
    parser.add_argument("--verify-curve", default=None,
                        help="comma-separated token counts, e.g. 1,2,3,5,9 (1 first)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(args.config, overrides)
    arms = [Arm.parse(a) for a in args.arms.split(",")]
    if any(a.needs_draft for a in arms) and not args.draft_gguf:
        raise SystemExit("error: a draft-* arm needs --draft-gguf (serving.export --format gguf "
                         "writes one).")
    if args.target_gguf:
        target_gguf = Path(args.target_gguf)
    elif cfg.model.target in EMBEDDED:
        target_gguf = embedded_gguf(embedded(cfg.model.target))[0]
    else:
        raise SystemExit("error: model.target is not embedded: name its GGUF with --target-gguf.")
    resolved = resolve_target(cfg.model)
    tokenizer = load_tokenizer(resolved, cfg.model.chat_template_kwargs)
    prompts, _ = load_eval_prompts(cfg, tokenizer, None)
    llama = ensure_llamacpp()
    n_new = cfg.eval.max_new_tokens
    print(f"[llama.cpp] {target_gguf.name}; {len(prompts)} prompts ({cfg.eval.prompts}, "
          f"{cfg.eval.prompt_pick}), greedy, {n_new} tokens, batch 1; {cpu_name()}")
    results = {"cpu": cpu_name(), "target": str(target_gguf), "prompts": len(prompts),
               "max_new_tokens": n_new, "arms": {}}
    if args.verify_curve:
        curve = verify_curve(llama, target_gguf, [int(n) for n in args.verify_curve.split(",")])
        one = curve[min(curve)]
        print("| new tokens | " + " | ".join(map(str, curve)) + " |\n|---|"
              + "---|" * len(curve) + "\n| forward ms (ratio) | "
              + " | ".join(f"{ms:.1f} ({ms / one:.2f}x)" for ms in curve.values()) + " |")
        results["verify_curve_ms"] = curve
    plain = [run_arm(llama, target_gguf, None, Arm("plain"), prompts, n_new)]
    runs = {a.name: run_arm(llama, target_gguf, Path(args.draft_gguf or "."), a, prompts, n_new)
            for a in arms if a.name != "plain"}
    plain.append(run_arm(llama, target_gguf, None, Arm("plain"), prompts, n_new))
    plain_n = [len(t) for t in plain[0].tokens]
    plain_ms = [(a + b) / 2 for a, b in zip(plain[0].predicted_ms, plain[1].predicted_ms)]
    drift = sum(plain[1].predicted_ms) / sum(plain[0].predicted_ms)
    print(f"plain: {sum(plain_n) / sum(plain_ms) * 1000:.1f} tokens/s (second plain pass "
          f"{drift:.3f}x the first's time)")
    print("| arm | tokens/s | speedup pooled [95 %] | per prompt median (q25-q75) | verdict | "
          "steps with a draft | tau | alpha_1..k | identical |")
    print("|---|---|---|---|---|---|---|---|---|")
    results.update(plain_drift=drift, plain_tokens_per_s=sum(plain_n) / sum(plain_ms) * 1000)
    for name, run in runs.items():
        arm_n = [len(t) for t in run.tokens]
        pooled, low, high = pooled_speedup_interval(run.predicted_ms, arm_n, plain_ms, plain_n)
        speed = speedup_stats([n / ms for n, ms in zip(arm_n, run.predicted_ms)],
                              [n / ms for n, ms in zip(plain_n, plain_ms)])
        c = run.counters
        tau = 1 + run.accepted / c.drafts if c.drafts else 1.0
        alpha = [round(a / c.drafts, 3) for a in c.accepted_per_position] if c.drafts else []
        same = sum(a == b for a, b in zip(run.tokens, plain[0].tokens))
        print(f"| {name} | {sum(arm_n) / sum(run.predicted_ms) * 1000:.1f} | {pooled:.2f}x "
              f"[{low:.2f}, {high:.2f}] | {speed.median:.2f}x ({speed.q25:.2f}-{speed.q75:.2f}) "
              f"| {speed.verdict} | {c.drafts} | {tau:.3f} | {alpha} | {same}/{len(prompts)} |")
        results["arms"][name] = {"tokens_per_s": sum(arm_n) / sum(run.predicted_ms) * 1000,
                                 "speedup": pooled, "interval": [low, high],
                                 "median": speed.median, "q25": speed.q25, "q75": speed.q75,
                                 "verdict": speed.verdict, "drafts": c.drafts, "tau": tau,
                                 "alpha": alpha,
                                 "identical": same}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
