"""The target, its tokenizer and the drafts the server decodes with, loaded once."""

from __future__ import annotations

from dataclasses import replace

import torch

from assets.target import (
    end_of_turn_ids,
    load_target,
    load_tokenizer,
    model_id,
    resolve_target,
)
from drafts import load_draft
from recipe import Config, ConfigError
from runfolder import run_folder

NGRAM = "ngram"
"""The draft name of prompt lookup, which every server serves."""


class Served:
    """The target, its tokenizer and the loaded drafts: what the scheduler decodes with."""

    def __init__(self, cfg: Config, extra_drafts: dict[str, str], device: torch.device):
        self.cfg = cfg
        resolved = resolve_target(cfg.model)
        self.model_id = model_id(cfg)
        self.tokenizer = load_tokenizer(resolved, cfg.model.chat_template_kwargs)
        self.target = load_target(resolved, cfg.model.dtype, device)
        self.device = device
        self.eos = end_of_turn_ids(self.target, self.tokenizer)
        self.context = getattr(self.target.config, "max_position_embeddings", None)
        dtype = self.target.dtype
        self.drafts = {}
        trained = run_folder(cfg).draft
        if (trained / "config.json").is_file():
            self.drafts[cfg.run.name] = load_draft(str(trained), self.target, self.tokenizer,
                                                   dtype, device, cfg.eval.draft_weights,
                                                   cfg.eval.draft_compile)
        for name, spec in extra_drafts.items():
            if name == NGRAM or name in self.drafts:
                raise ConfigError(f"--draft {name}=...: the name {name!r} is taken (the run's "
                                  f"trained draft or 'ngram'): choose another.")
            self.drafts[name] = load_draft(spec, self.target, self.tokenizer, dtype, device,
                                           cfg.eval.draft_weights, cfg.eval.draft_compile)
        self.default_draft = next(iter(self.drafts), None)
        self.drafts[NGRAM] = load_draft("prompt-lookup", self.target, self.tokenizer, dtype,
                                        device)
        self.decoding = replace(cfg.eval.decoding, tree=False, ngram_branch=False,
                                tree_paths=[], tree_nodes=0, stop_strings=[], batch_size=1)

    def text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode([t for t in tokens if t not in self.eos],
                                     skip_special_tokens=True)
