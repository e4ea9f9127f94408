"""What a serving engine is: the one interface export, validation, the model card and the
server use, whatever engine (vLLM, llama.cpp, ...) serves the draft.

An engine is one module of serving/engines/ implementing ServingEngine, listed once in
serving/engines/__init__.py. It says which draft kinds it serves (or why not), writes the
folder it loads, runs token-id prompts under one DecodeSettings with and without the draft and
returns its counters, and gives the command that serves the export.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from drafts import DraftKind, kind_of
from drafts.folders import read_config
from recipe import Config, ConfigError, DecodeSettings
from runfolder import run_folder


def file_stamps(files) -> list[tuple[str, int, int]]:
    """(name, size, modification time) of each file, sorted: what a cached run's key holds of
    the weights it read, so that re-written weights miss the cache."""
    return sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files)


@dataclass
class Export:
    """What serving.export wrote."""

    folder: Path
    method: str
    """The engine's name for how it serves the draft (vLLM's method, llama.cpp's --spec-type)."""
    num_speculative_tokens: int
    target_path: str
    command: str
    """The command that serves it."""


@dataclass
class Exported:
    """An export folder found and checked, as an engine runs it."""

    folder: Path
    method: str
    k: int
    spec: dict
    """The engine's own description of the export (vLLM's speculative config, llamacpp.json)."""


@dataclass
class Counters:
    """An engine's speculative counters over some requests, in vLLM's terms (llama.cpp counts
    alike): tau = 1 + sum(accepted_per_position) / drafts."""

    drafts: int
    """Target verification steps that carried a draft."""
    accepted_per_position: list[int]
    """[k] steps whose draft position j was accepted."""
    drafted_per_position: list[int]
    """[k] steps that drafted position j (an engine may trim a request's last draft)."""


def summed(requests: list[Counters], k: int) -> Counters:
    """Requests' counters added up over draft positions 1..k."""
    return Counters(sum(r.drafts for r in requests),
                    [sum(r.accepted_per_position[j] for r in requests
                         if j < len(r.accepted_per_position)) for j in range(k)],
                    [sum(r.drafted_per_position[j] for r in requests) for j in range(k)])


def as_counters(stats: list, k: int) -> list[Counters]:
    """Our engine's per-request stats (decoding.engine.RequestStats) as counters, unchanged: an
    engine that drafts k at every step until max_new_tokens counts them so (vLLM)."""
    return [Counters(s.steps, s.accepted_per_position[:k], s.drafted_per_position[:k])
            for s in stats]


@dataclass
class EngineRun:
    """One engine run over the prompts (all of them, one seed per prompt when sampling)."""

    tokens: list[list[int]]
    """Per prompt: the generated token ids."""
    seconds: float
    counters: Counters | None = None
    """None for a run without the draft."""
    per_prompt: list[Counters] | None = None
    """Per-request counters, where the engine reports them (requests run one by one)."""
    reused: bool = False
    """The run came from the cache of an earlier identical run (its seconds measured then)."""
    report: dict = field(default_factory=dict)
    """Engine-specific facts for the validation report."""


class ServingEngine(Protocol):
    name: str
    """The command-line name (serving.validate --engine NAME)."""
    label: str
    """How reports name it ('vLLM')."""
    formats: tuple[str, ...]
    """serving.export --format values whose folders it loads."""
    report_name: str
    """The validation report's file name under <run>/validate/."""

    def why_not(self, kind: DraftKind) -> str | None:
        """None when it serves drafts of this kind; else why not and what to use instead."""

    def export(self, cfg: Config, draft_folder: Path, kind: DraftKind, k: int, fmt: str,
               out: Path | None, log=print) -> Export:
        """Write what it loads for the trained draft into out (default <run>/export/...),
        atomically, with the resolved config, a model card and the serving command."""

    def exported(self, cfg: Config, folder: Path | None) -> Exported:
        """The export folder to run (the one given, else the run's single one), checked."""

    def our_counters(self, stats: list, k: int, max_new_tokens: int) -> list[Counters]:
        """Our engine's per-request stats (decoding.engine.RequestStats) as this engine would
        have counted the same steps (as_counters where it drafts k at every step)."""

    def drafting(self, exported: Exported, settings: DecodeSettings) -> DecodeSettings:
        """Our engine's settings that propose drafts as this engine does for this export
        (vLLM and llama.cpp draft the argmax by default: draft_temperature 0)."""

    def run(self, cfg: Config, exported: Exported, target_path: str, prompts: list[list[int]],
            settings: DecodeSettings, eos: set[int], with_draft: bool) -> EngineRun:
        """The prompts (token ids, templated) through the engine, each with seed run.seed + i
        when sampling."""


def target_shape(target_path: str) -> tuple[int, int]:
    """(hidden size, vocab size) of the target, from its config.json."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(target_path)
    config = getattr(config, "text_config", None) or config
    return config.hidden_size, config.vocab_size


def trained_draft(cfg: Config, draft_folder: Path | None, k: int) -> tuple[Path, DraftKind]:
    """The draft folder to export (default <run>/train/draft) and its kind, checked."""
    folder = Path(draft_folder or run_folder(cfg).draft)
    if read_config(folder) is None:
        raise ConfigError(f"{folder} holds no trained draft (no config.json): run the train "
                          "stage first, or pass --draft FOLDER.")
    if k < 1:
        raise ConfigError(f"--k {k}: the number of speculative tokens must be >= 1.")
    return folder, kind_of(folder)


@contextmanager
def staged(out: Path):
    """Write a folder under a temporary name; it replaces out only when the block succeeds."""
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def single_export(cfg: Config, folder: Path | None, marker: str, command: str) -> Path:
    """The export folder given, else the single one in <run>/export/ holding marker."""
    export = run_folder(cfg).export
    candidates = [folder] if folder else sorted(export.glob("*/"))
    candidates = [c for c in candidates if (c / marker).is_file()]
    if len(candidates) != 1:
        raise ConfigError(f"expected one export holding {marker}, found {len(candidates)} in "
                          f"{export}: run `python -m {command}` first, or pass --folder.")
    return candidates[0]
