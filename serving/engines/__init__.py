"""Every serving engine, in one list: the only place that names them all.

An engine is one module implementing serving.engines.base.ServingEngine plus one line here;
export, validation and the model card go through it and never ask which engine it is.
"""

from __future__ import annotations

import dataclasses

from assets.published import target_facts
from drafts import DraftKind
from recipe import Config, ConfigError
from serving.engines.base import Counters, EngineRun, Export, Exported, ServingEngine
from serving.engines.llamacpp import LlamaCppEngine
from serving.engines.vllm import VLLM

ENGINES: list[type] = [
    VLLM,
    LlamaCppEngine,
]


def make_engine(name: str, **options) -> ServingEngine:
    """The engine named name, with its options (fields of its class); options it does not take
    are refused by name."""
    engine = next((e for e in ENGINES if e.name == name), None)
    if engine is None:
        raise ConfigError(f"unknown serving engine {name!r}: choose one of "
                          f"{[e.name for e in ENGINES]}.")
    known = {f.name for f in dataclasses.fields(engine)}
    if unknown := sorted(set(options) - known):
        raise ConfigError(f"{engine.label} takes no option {unknown}: its options are "
                          f"{sorted(known) or 'none'}.")
    return engine(**options)


def check_target_served(cfg: Config, kind: DraftKind) -> None:
    """Refuse, at config load, a draft kind that vLLM cannot serve for the target's
    architecture (read without downloading: local folder, HF cache or assets/published.py; a
    target none of them knows is checked when its export is validated)."""
    if cfg.model.target.startswith("embedded:"):
        return  # a Llama: every kind is served
    facts = target_facts(cfg.model.target)
    if facts is not None and (why := VLLM().why_not_target(kind, facts.config,
                                                                   cfg.train.draft)):
        raise ConfigError(f"model.target={cfg.model.target!r} is a {facts.architecture}, and "
                          f"train.draft={cfg.train.draft!r}: {why}")


def engine_for_format(fmt: str, **options) -> ServingEngine:
    """The engine whose export folders serving.export --format fmt writes."""
    engine = next((e for e in ENGINES if fmt in e.formats), None)
    if engine is None:
        raise ConfigError(f"--format {fmt!r}: no serving engine loads it; choose one of "
                          f"{[f for e in ENGINES for f in e.formats]}.")
    return make_engine(engine.name, **options)


__all__ = ["ENGINES", "Counters", "EngineRun", "Export", "Exported", "ServingEngine",
           "engine_for_format", "make_engine"]
