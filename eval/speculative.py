"""Measure a draft the way it will be served: tau, alpha_k, acceptance rate, tokens/s, speedup.

    .venv/bin/python -m eval.speculative --config configs/smollm2-135m-independent.yaml [overrides]
    .venv/bin/python -m eval.speculative --config ... --compare "Write a haiku about rain."

All methods run side by side in one process on the same prompts: plain target decoding (our
loop and HF `generate`), our engine with the draft, transformers' assisted generation with the
same draft and k, and prompt lookup in our engine. Writes results.json, report.md, alpha_k.png
and throughput.png to <run.output_dir>/eval/. --compare runs one request with and without
speculation and compares the texts character by character and the times.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from assets.chat import render
from assets.target import end_of_turn_ids, load_target, load_tokenizer, resolve_target
from decoding.acceptance import measured_acceptance
from decoding.engine import RequestStats, decode_prompts
from decoding.packed import cpu_model, describe_choices, pack_linears, packs, tune_linears
from drafts import LoadedDraft, engine_draft, load_draft
from recipe import Config, ConfigError, DecodeSettings, EvalConfig, cache_root
from recipe.config import EVAL_METHODS
from runfolder import load_eval_prompts, run_folder, run_name_of, speed_text


@dataclass
class MethodResult:
    method: str
    tokens: int
    seconds: float
    texts: list[str]
    identical_to_target: int | None = None
    """Prompts whose output equals plain target decoding token for token (greedy only)."""
    tau: float | None = None
    alpha: list[float] = field(default_factory=list)
    acceptance_rate: float | None = None
    draft_seconds: float | None = None
    verify_seconds: float | None = None
    draft_ms_per_step: float | None = None
    """The draft's time per engine step (one step drafts for the whole batch)."""
    draft_failures: int = 0
    accepted_alternative: int = 0
    """Tree modes: accepted tokens that were the draft's alternatives, not its chain."""
    accepted_ngram: int = 0
    """Hybrid mode: accepted tokens that only the n-gram branch proposed."""
    tree_fallbacks: int = 0
    k_policy: str | None = None
    round_tokens_per_s: list[float] = field(default_factory=list)
    """tokens/s in each round (a round: every method on the same batch of prompts)."""
    speed: Speed | None = None
    """Against the target baseline, round by round (None without the 'target' method)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


@dataclass
class Speed:
    """A method's speedup over plain decoding, computed per round against that round's baseline
    (so noise that slows one stretch of the run slows both sides of its ratio)."""

    median: float
    q25: float
    q75: float
    rounds: int
    verdict: str
    """'faster' when at least 3/4 of the rounds were faster (q25 > 1), 'slower' when at least
    3/4 were slower (q75 < 1), else 'uncertain'."""


def quantile(values: list[float], q: float) -> float:
    """Linear-interpolation quantile of a non-empty list (numpy's default)."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def speedup_stats(method_tps: list[float], baseline_tps: list[float]) -> Speed:
    """Per-round speedups [R] x2 -> their median, quartiles and a verdict."""
    ratios = [m / b for m, b in zip(method_tps, baseline_tps)]
    q25, q75 = quantile(ratios, 0.25), quantile(ratios, 0.75)
    verdict = "faster" if q25 > 1 else "slower" if q75 < 1 else "uncertain"
    return Speed(quantile(ratios, 0.5), q25, q75, len(ratios), verdict)


def check_k_fits(draft: LoadedDraft, ev: EvalConfig) -> None:
    """Refuse, up front, a k or a static tree the draft cannot fill (Medusa: one token per
    head)."""
    k = ev.k_max_used
    depth = max((len(p) for p in ev.tree_paths), default=0)
    if draft.max_k is not None and depth > draft.max_k:
        raise ConfigError(f"eval.tree_paths reach depth {depth}, but {draft.name} has "
                          f"{draft.max_k} {draft.max_k_unit}: a static tree may use at most "
                          f"{draft.max_k} (drop the deeper paths, or train more "
                          f"{draft.max_k_unit}).")
    if draft.max_k is not None and k > draft.max_k:
        raise ConfigError(f"eval.{'k_max' if ev.adaptive_k else 'k'}={k} draft tokens, but "
                          f"{draft.name} has {draft.max_k} {draft.max_k_unit}: set it <= "
                          f"{draft.max_k} (or train more {draft.max_k_unit}).")


def draft_label(spec: str) -> str:
    """A short name for a draft: the run name of <run>/train/draft, else the last path part."""
    parts = Path(spec).parts
    return run_name_of(spec) or (parts[-1] if parts else spec)


@dataclass
class Run:
    """One method on one round's prompts."""

    outputs: list[list[int]]
    stats: list[RequestStats] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    k_used: list[int] = field(default_factory=list)


Runner = Callable[[list[list[int]]], Run]


def engine_runner(target, settings: DecodeSettings, eos, pad_id, tokenizer, draft=None,
                  seed=0) -> Runner:
    """Our engine, with a draft or without (plain decoding), in batches of settings.batch_size;
    one generator across every call, so a seeded run repeats."""
    device = next(target.parameters()).device
    generator = torch.Generator(device).manual_seed(seed)

    def run(prompts: list[list[int]]) -> Run:
        gen = decode_prompts(target, prompts, settings, eos, pad_id, draft, generator,
                             tokenizer.decode)
        return Run(gen.tokens, gen.stats, gen.draft_seconds, gen.verify_seconds, gen.k_used)
    return run


def hf_runner(target, d: DecodeSettings, eos, pad_id, tokenizer, assistant=None) -> Runner:
    """transformers' generate, batch 1, optionally with assisted generation at constant k."""
    from transformers import GenerationConfig

    sampling = (dict(do_sample=True, temperature=d.temperature, top_p=d.top_p, top_k=d.top_k)
                if d.temperature > 0 else dict(do_sample=False))
    extra = {}
    if assistant is not None:
        extra = dict(num_assistant_tokens=d.k, assistant_confidence_threshold=0.0,
                     num_assistant_tokens_schedule="heuristic" if d.adaptive_k else "constant")
    if d.stop_strings:
        extra["stop_strings"] = list(d.stop_strings)
    config = GenerationConfig(max_new_tokens=d.max_new_tokens, eos_token_id=sorted(eos),
                              pad_token_id=pad_id, **sampling, **extra)
    device = next(target.parameters()).device

    def run(prompts: list[list[int]]) -> Run:
        outputs = []
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                  generation_config=config, assistant_model=assistant,
                                  tokenizer=tokenizer if d.stop_strings else None)
            outputs.append(out[0, len(prompt):].tolist())
        return Run(outputs)
    return run


def schedule(methods: list[str], rounds: int) -> list[list[str]]:
    """The order of the methods in each round: rotated by one per round, so that no method
    always runs first or last in a round."""
    n = len(methods)
    return [methods[r % n:] + methods[: r % n] for r in range(rounds)]


@dataclass
class Measured:
    """A method's runs and wall-clock seconds, round by round."""

    runs: list[Run] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    @property
    def outputs(self) -> list[list[int]]:
        return [o for run in self.runs for o in run.outputs]

    @property
    def tokens_per_s(self) -> list[float]:
        return [sum(map(len, run.outputs)) / s for run, s in zip(self.runs, self.seconds)]


def measure(runners: dict[str, Runner], rounds: list[list[list[int]]],
            clock: Callable[[], float] = time.perf_counter, log=print) -> dict[str, Measured]:
    """Every method on every round's prompts, the methods interleaved (schedule) so that a noisy
    stretch of the machine hits all of them alike; each run timed alone."""
    measured = {name: Measured() for name in runners}
    for r, order in enumerate(schedule(list(runners), len(rounds))):
        for name in order:
            start = clock()
            run = runners[name](rounds[r])
            measured[name].seconds.append(clock() - start)
            measured[name].runs.append(run)
        log(f"[eval] round {r + 1}/{len(rounds)} done", flush=True)
    return measured


def method_result(name: str, m: Measured, tokenizer, settings: DecodeSettings,
                  drafted: bool) -> MethodResult:
    outputs = m.outputs
    result = MethodResult(name, sum(map(len, outputs)), sum(m.seconds),
                          [tokenizer.decode(o) for o in outputs],
                          round_tokens_per_s=m.tokens_per_s)
    if drafted:
        stats = [s for run in m.runs for s in run.stats]
        k_used = [k for run in m.runs for k in run.k_used]
        result.tau, result.alpha, result.acceptance_rate = measured_acceptance(stats)
        result.draft_seconds = sum(run.draft_seconds for run in m.runs)
        result.verify_seconds = sum(run.verify_seconds for run in m.runs)
        result.draft_ms_per_step = 1000 * result.draft_seconds / max(len(k_used), 1)
        result.draft_failures = sum(s.draft_failures for s in stats)
        result.accepted_alternative = sum(s.accepted_alternative for s in stats)
        result.accepted_ngram = sum(s.accepted_ngram for s in stats)
        result.tree_fallbacks = sum(s.tree_fallbacks for s in stats)
        rule = ("the most expected tokens/s over the last "
                f"{settings.window_ms:g} ms" if settings.adaptive_policy == "window"
                else "+2 after a step accepting all, else -1")
        result.k_policy = (f"adaptive ({rule}) in [1, {settings.k_max}]; mean k "
                           f"{sum(k_used) / max(len(k_used), 1):.2f}"
                           if settings.adaptive_k else f"fixed k={settings.k}")
        if settings.confidence_min > 0:  # k_used: the tokens each step verified
            result.k_policy += (f"; verified up to the first confidence below "
                                f"{settings.confidence_min:g}: mean "
                                f"{sum(k_used) / max(len(k_used), 1):.2f} tokens a step")
    return result


def run_engine(name, target, prompts, settings: DecodeSettings, eos, pad_id, tokenizer,
               draft=None, seed=0) -> tuple[MethodResult, list[list[int]]]:
    """Our engine alone over the prompts, in one round -> the result and each prompt's tokens."""
    runner = engine_runner(target, settings, eos, pad_id, tokenizer, draft, seed)
    m = measure({name: runner}, [prompts], log=lambda *a, **k: None)[name]
    return method_result(name, m, tokenizer, settings, draft is not None), m.outputs


def _load(cfg: Config, device: torch.device):
    """-> (resolved target, tokenizer, target, the draft or None); the draft is checked against
    the target and k here, before any generation."""
    resolved = resolve_target(cfg.model)
    tokenizer = load_tokenizer(resolved, cfg.model.chat_template_kwargs)
    target = load_target(resolved, cfg.model.dtype, device)
    spec = cfg.eval.draft
    if spec == "trained":
        spec = str(run_folder(cfg).draft)
        if not (Path(spec) / "config.json").is_file():
            raise ConfigError(f"eval.draft=trained, but {spec} holds no trained draft: run the "
                              "train stage first (distill.py --stage train).")
    draft = (load_draft(spec, target, tokenizer, target.dtype, device, cfg.eval.draft_weights,
                        cfg.eval.draft_compile) if spec else None)
    if draft is not None:
        check_k_fits(draft, cfg.eval)
    return resolved, tokenizer, target, draft


def pack_target(target, ev: EvalConfig) -> str:
    """eval.target_linear on an fp32 CPU target, once every draft that reads the target's
    weights is built: 'packed' runs its products on oneDNN's prepacked weights, 'auto' on
    whichever of those and torch's own is faster per weight shape and rows (decoding/packed.py)
    -> what its products run on ('torch' where nothing changed)."""
    if ev.target_linear == "torch" or not packs(target):
        return "torch"
    if ev.target_linear == "packed":
        count = pack_linears(target)
        print(f"[eval] the target's {count} linear layers run on oneDNN's prepacked fp32 weights "
              "(eval.target_linear=packed)", flush=True)
        return "packed"
    path = cache_root() / "kernels" / f"{_cpu_key()}.json"  # this CPU's earlier choices
    known = {tuple(json.loads(k)): v for k, v in json.loads(path.read_text()).items()} \
        if path.is_file() else {}
    choices = tune_linears(target, known)
    if set(choices) - set(known):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({json.dumps(list(k)): v for k, v in choices.items()}))
    print(f"[eval] the target's fp32 products, the faster of torch's and oneDNN's packed one on "
          f"this CPU by rows (eval.target_linear=auto; timed once per CPU, kept in {path}): "
          f"{describe_choices(choices)}", flush=True)
    return "auto"


def _cpu_key() -> str:
    """This CPU's model name and torch's version, as a file name."""
    import re

    return re.sub(r"[^A-Za-z0-9.]+", "-", f"{cpu_model()}-torch-{torch.__version__}").strip("-")


@dataclass
class _Methods:
    """What eval.methods run on: the target, the draft, eval.compare_drafts' drafts (by label),
    prompt lookup."""

    ev: Any
    seed: int
    target: Any
    tokenizer: Any
    draft: Any
    others: dict
    lookup: Any
    eos: set[int]
    pad: int

    def runners(self, settings: DecodeSettings) -> dict[str, tuple[Runner, bool]]:
        """method -> (its runner, whether it drafts), fresh drafts and generators; each drafted
        method of our engine once per eval.modes, in eval.methods' order."""
        ev, made = self.ev, {}
        for mode in ev.modes:
            moded = dataclasses.replace(settings, tree=mode != "chain",
                                        ngram_branch=mode == "hybrid",
                                        tree_paths=ev.tree_paths if mode != "chain" else [],
                                        tree_nodes=ev.tree_nodes if mode != "chain" else 0)
            suffix = "" if mode == "chain" else f"+{mode}"
            if "speculative" in ev.methods:
                made["speculative" + suffix] = self._engine(moded, engine_draft(self.draft))
                for label, other in self.others.items():
                    made[label + suffix] = self._engine(moded, engine_draft(other))
            if "prompt_lookup" in ev.methods and mode == "chain":
                # a tree adds nothing to it: it ranks no alternatives, and its n-gram branch
                # is its own chain
                made["prompt_lookup"] = self._engine(
                    settings, engine_draft(self.lookup, "prompt lookup"))
        target, eos, pad, tokenizer = self.target, self.eos, self.pad, self.tokenizer
        for method in ev.methods:
            if method == "target":
                made[method] = self._engine(settings, None)
            elif method == "hf_generate":
                made[method] = hf_runner(target, settings, eos, pad, tokenizer), False
            elif method == "hf_assisted" and self.draft.kind.hf_assistant:
                made[method] = hf_runner(target, settings, eos, pad, tokenizer,
                                         assistant=self.draft.model), False
        in_order = sorted(made, key=lambda name: EVAL_METHODS.index(
            name.split(":")[0].split("+")[0]))  # eval.methods' order, modes inside
        return {name: made[name] for name in in_order}

    def _engine(self, settings: DecodeSettings, draft) -> tuple[Runner, bool]:
        return engine_runner(self.target, settings, self.eos, self.pad, self.tokenizer, draft,
                             self.seed), draft is not None


def evaluate(cfg: Config, device: torch.device) -> dict:
    """Run every configured method on the eval prompts; write the report; return the results."""
    ev = cfg.eval
    resolved, tokenizer, target, draft = _load(cfg, device)
    prompts, skipped = load_eval_prompts(cfg, tokenizer,
                                         getattr(target.config, "max_position_embeddings", None))
    others = {}  # eval.compare_drafts, loaded and checked before anything runs
    for spec in ev.compare_drafts:
        other = load_draft(spec, target, tokenizer, target.dtype, device, ev.draft_weights,
                           ev.draft_compile)
        check_k_fits(other, ev)
        others[f"speculative:{draft_label(spec)}"] = other
    lookup = load_draft("prompt-lookup", target, tokenizer, target.dtype, device)
    products = pack_target(target, ev)
    methods = _Methods(ev, cfg.run.seed, target, tokenizer, draft, others, lookup,
                       end_of_turn_ids(target, tokenizer), tokenizer.pad_token_id)
    if "hf_assisted" in ev.methods and not draft.kind.hf_assistant:
        print(f"[eval] hf_assisted skipped: transformers' assisted generation runs an "
              f"independent draft LM, not {draft.kind.description}.")
    torch.manual_seed(cfg.run.seed)  # transformers' sampling draws from the global RNG
    # warm-up: every method once on a short request, so none pays one-off costs in the timing
    warm = methods.runners(dataclasses.replace(ev.decoding, max_new_tokens=8))
    measure({name: runner for name, (runner, _) in warm.items()}, [prompts[:1]],
            log=lambda *a, **k: None)
    made = methods.runners(ev.decoding)
    rounds = [prompts[b : b + ev.batch_size] for b in range(0, len(prompts), ev.batch_size)]
    print(f"[eval] {', '.join(made)} on {len(prompts)} prompts, interleaved over {len(rounds)} "
          f"rounds of {ev.batch_size} ...", flush=True)
    measured = measure({name: runner for name, (runner, _) in made.items()}, rounds)
    results = {name: method_result(name, measured[name], tokenizer, ev, drafted)
               for name, (_, drafted) in made.items()}
    if "target" in results:
        reference = measured["target"].outputs
        for name, result in results.items():
            result.speed = speedup_stats(result.round_tokens_per_s,
                                         results["target"].round_tokens_per_s)
            if name != "target" and ev.temperature == 0:
                result.identical_to_target = sum(
                    a == b for a, b in zip(measured[name].outputs, reference))
    report = {"target": resolved.name, "dtype": cfg.model.dtype,
              "target_linear": products,
              "draft": draft.name if draft else None,
              "prompts": ev.prompts,
              "num_prompts": len(prompts), "skipped_over_context": skipped,
              "settings": asdict(ev.decoding),
              "batch_size": ev.batch_size, "device": str(device), "modes": ev.modes,
              "tree_paths": ev.tree_paths, "tree_nodes": ev.tree_nodes,
              "threads": torch.get_num_threads(),
              "rounds": len(rounds),
              "methods": {m: {**asdict(r), "tokens_per_s": r.tokens_per_s,
                              "speedup": r.speed.median if r.speed else None}
                          for m, r in results.items()}}
    out_dir = run_folder(cfg).eval_results.parent
    write_report(report, out_dir)
    cfg.save(out_dir / "config.yaml")
    print(markdown_table(report))
    print(f"[eval] wrote {out_dir}/results.json, report.md, alpha_k.png, throughput.png")
    return report


def markdown_table(report: dict) -> str:
    s = report["settings"]
    lines = [f"target {report['target']} ({report['dtype']}), draft {report['draft']}, "
             f"{report['num_prompts']} "
             f"{report['prompts']} prompts, max_new_tokens {s['max_new_tokens']}, "
             f"T={s['temperature']}, k={s['k']}{' (adaptive)' if s['adaptive_k'] else ''}, "
             f"batch {report['batch_size']}, {report['device']} x{report['threads']} threads",
             (("trees ('+tree', '+hybrid'): " + (
                 f"the static tree {report['tree_paths']}" if report.get("tree_paths") else
                 f"dynamic (EAGLE-2) trees of {report['tree_nodes']} nodes, {s['tree_width']} "
                 "expanded per depth, for drafts that expand them (EAGLE-3 heads, independent "
                 "drafts), else the chain plus "
                 f"{s['tree_width']} alternatives per draft position" if report.get("tree_nodes")
                 else f"the chain plus {s['tree_width']} alternatives per draft position")
               + "; '+hybrid' adds the n-gram match as a branch")
              if report.get("modes", ["chain"]) != ["chain"] else ""),
             "",
             f"speedup: the median over {report.get('rounds', 1)} rounds of the round's tokens/s "
             "over plain decoding's in the same round (methods interleaved), with the quartiles; "
             "'uncertain' unless 3/4 of the rounds agree",
             "",
             "| method | tau | acceptance | alpha_k | draft ms/step | tokens/s | "
             "speedup (q25-q75) | identical to target | accepted alternatives / n-gram |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in report["methods"].items():
        tau = f"{r['tau']:.2f}" if r["tau"] is not None else "-"
        rate = f"{r['acceptance_rate']:.2f}" if r["acceptance_rate"] is not None else "-"
        alpha = " ".join(f"{a:.2f}" for a in r["alpha"]) or "-"
        same = (f"{r['identical_to_target']}/{report['num_prompts']}"
                if r["identical_to_target"] is not None else "-")
        speed = speed_text(r.get("speed"), baseline=r["method"] == "target")
        draft_ms = (f"{r['draft_ms_per_step']:.1f}" if r.get("draft_ms_per_step") is not None
                    else "-")
        tree = (f"{r.get('accepted_alternative', 0)} / {r.get('accepted_ngram', 0)}"
                if "+" in name else "-")
        lines.append(f"| {name} | {tau} | {rate} | {alpha} | {draft_ms} | "
                     f"{r['tokens_per_s']:.1f} | {speed} | {same} | {tree} |")
    lines += [f"- {name}: k {r['k_policy']}" for name, r in report["methods"].items()
              if (r.get("k_policy") or "").startswith("adaptive")]
    return "\n".join(lines)


def write_report(report: dict, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / "report.md").write_text(markdown_table(report) + "\n")
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in report["methods"].items():
        if r["alpha"]:
            ax.plot(range(1, len(r["alpha"]) + 1), r["alpha"], marker="o",
                    label=f"{name} (tau {r['tau']:.2f})")
    positions = max((len(r["alpha"]) for r in report["methods"].values()), default=0)
    ax.set_xticks(range(1, positions + 1))
    ax.set(xlabel="draft position k", ylabel="alpha_k (acceptance rate)", ylim=(0, 1.05),
           title="Per-position acceptance")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "alpha_k.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(report["methods"])
    ax.bar(names, [report["methods"][n]["tokens_per_s"] for n in names])
    ax.set(ylabel="tokens/s", title="Decoding throughput")
    ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(out_dir / "throughput.png", dpi=120)
    plt.close(fig)


def compare(cfg: Config, prompt: str, device: torch.device) -> dict:
    """One request with and without speculation: texts character by character, and times."""
    ev = cfg.eval
    if ev.draft is None:
        raise ConfigError("--compare needs a draft: set eval.draft.")
    _, tokenizer, target, draft = _load(cfg, device)
    pack_target(target, ev)
    ids = [render(tokenizer, [{"role": "user", "content": prompt}], add_generation_prompt=True)]
    eos, pad = end_of_turn_ids(target, tokenizer), tokenizer.pad_token_id
    plain, _ = run_engine("target", target, ids, ev, eos, pad, tokenizer, None, cfg.run.seed)
    spec, _ = run_engine("speculative", target, ids, ev, eos, pad, tokenizer,
                         engine_draft(draft), cfg.run.seed)
    a, b = plain.texts[0], spec.texts[0]
    first_diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                      None if len(a) == len(b) else min(len(a), len(b)))
    print(f"--- without speculation ({plain.seconds:.2f} s, {plain.tokens_per_s:.1f} tokens/s)\n{a}")
    print(f"--- with speculation ({spec.seconds:.2f} s, {spec.tokens_per_s:.1f} tokens/s, "
          f"tau {spec.tau:.2f})\n{b}")
    print("--- texts are identical" if first_diff is None else
          f"--- texts differ from character {first_diff}: {a[first_diff:first_diff + 40]!r} vs "
          f"{b[first_diff:first_diff + 40]!r}")
    print(f"--- one request: {plain.seconds / spec.seconds:.2f}x plain decoding's speed (a single "
          "run, no quartiles: eval.speculative without --compare measures over rounds)")
    return {"identical": first_diff is None, "first_difference": first_diff,
            "seconds_plain": plain.seconds, "seconds_speculative": spec.seconds, "tau": spec.tau}


def main(argv: list[str] | None = None) -> None:
    from recipe import load_config

    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--compare", metavar="PROMPT", help="A/B one request and stop")
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(args.config, overrides)
    from accelerate import Accelerator

    device = Accelerator().device
    if args.compare:
        compare(cfg, args.compare, device)
    else:
        evaluate(cfg, device)


if __name__ == "__main__":
    main()
