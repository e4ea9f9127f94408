"""Every draft kind, in one list: the only place that names them all.

A spec (train.draft, eval.draft) or a saved folder goes to the first kind that claims it; the
independent draft comes last and takes every causal LM the others do not. A new kind is one
package drafts/<name>/ whose kind.py implements drafts.kind.DraftKind, plus one line here.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from assets.published import target_facts
from drafts.dflash import DFlash
from drafts.dspark import DSpark
from drafts.eagle3 import Eagle3
from drafts.folders import read_config
from drafts.independent import Independent
from drafts.kind import DraftKind, LoadedDraft
from drafts.medusa import Medusa
from drafts.pard import Pard
from drafts.prompt_lookup import PromptLookup
from recipe import Config, ConfigError, TrainConfig
from recipe.config import DRAFT_WEIGHTS

KINDS: list[DraftKind] = [
    Medusa(),
    Eagle3(),
    DSpark(),
    DFlash(),
    PromptLookup(),
    Pard(),  # before Independent: a PARD folder is also a causal LM
    Independent(),  # last: any causal LM with the target's vocabulary
]


def kind_of(spec: str | Path) -> DraftKind:
    """The kind a spec names: a saved folder by its config.json, else by the spec string."""
    config = read_config(spec)
    if config is not None:
        return next(kind for kind in KINDS if kind.reads_folder(config))
    return next(kind for kind in KINDS if kind.claims(str(spec)))


def check_train_config(cfg: TrainConfig) -> DraftKind:
    """What train.draft's kind asks of the train section; -> the kind. A train key that only
    other kinds read (their train_keys), set away from its default, is refused by name. Run
    before any stage, so a contradiction fails in seconds, not after stage 1."""
    kind = kind_of(cfg.draft)
    defaults = TrainConfig()
    for key in sorted({k for other in KINDS for k in other.train_keys} - set(kind.train_keys)):
        if getattr(cfg, key) != getattr(defaults, key):
            readers = [other.name for other in KINDS if key in other.train_keys]
            raise ConfigError(f"train.{key}={getattr(cfg, key)!r} is read by {readers} drafts "
                              f"only: train.draft={cfg.draft!r} is {kind.description}, which "
                              f"does not read it; drop it.")
    kind.check_train(cfg)
    return kind


def check_target_config(cfg: Config, kind: DraftKind) -> None:
    """The kind's checks against the target's config.json, read without downloading (a local
    folder, the HF cache, or assets/published.py); a target none of them knows is checked when
    its weights load."""
    facts = target_facts(cfg.model.target)
    if facts is not None:
        kind.check_target(cfg.train, cfg.eval.k, facts.config)


def load_draft(spec: str, target, tokenizer, dtype: torch.dtype, device: torch.device,
               weights: str = "model", compile: bool = False) -> LoadedDraft:
    """A draft spec or folder -> the draft, checked against the target, of whatever kind;
    weights: 'model' (the draft's own dtype), or the 'int8' or 'int4' weights its engine drafts
    with; compile: with compiled steps (each refused for kinds that cannot)."""
    kind = kind_of(spec)
    if compile and not kind.compiled_steps:
        able = [k.name for k in KINDS if k.compiled_steps]
        raise ConfigError(f"compiled draft steps: {spec!r} is a {kind.name} draft, and only "
                          f"{', '.join(able)} drafts run compiled: set "
                          "eval.draft_compile=false for it.")
    if weights not in DRAFT_WEIGHTS:
        raise ConfigError(f"draft weights {weights!r}: expected one of {DRAFT_WEIGHTS}.")
    if weights != "model" and not kind.quantised_weights:
        able = [k.name for k in KINDS if k.quantised_weights]
        raise ConfigError(f"{weights} draft weights: {spec!r} is a {kind.name} draft, and only "
                          f"{', '.join(able)} drafts run on quantised weights: set "
                          "eval.draft_weights=model for it.")
    loaded = kind.load(spec, target, tokenizer, dtype, device)
    if weights != "model":
        loaded = replace(kind.quantise(loaded, weights), weights=weights,
                         name=f"{loaded.name} on {weights} weights")
    if compile:
        loaded = replace(loaded, compile=True, name=f"{loaded.name}, compiled")
        engine_draft(loaded)  # a draft compiled steps cannot run is refused before generating
    return loaded


def engine_draft(loaded: LoadedDraft, name: str = "draft"):
    """A fresh decoding.engine.Draft for one engine run."""
    return loaded.kind.engine_draft(loaded, name)
