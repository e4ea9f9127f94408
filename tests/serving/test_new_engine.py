"""A new serving engine is one module plus one registry line: a toy engine, written here as
such a module would be, is exported to, run and validated against our engine with no other
change anywhere; validation catches it when it miscounts."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from assets.target import load_target, load_tokenizer, resolve_target
from decoding.engine import decode_prompts
from drafts import engine_draft, load_draft
from recipe import ConfigError, DecodeSettings
from runfolder import run_folder
from serving import engines
from serving.engines.base import (
    EngineRun,
    Export,
    Exported,
    as_counters,
    single_export,
    staged,
    summed,
)

# --- the toy engine's module --------------------------------------------------------------------


@dataclass
class InProcess:
    """Our own decoding loop in this process, loading the export folder as an engine would.
    miscount: it reports one accepted token fewer per request at position 1 (a wrong
    counter, which validation must catch)."""

    miscount: bool = False
    name = "inprocess"
    label = "in-process"
    formats = ("inprocess",)
    report_name = "results-inprocess.json"

    def why_not(self, kind):
        return None if kind.name == "independent" else "it serves independent drafts only."

    def export(self, cfg, draft_folder, kind, k, fmt, out=None, log=print) -> Export:
        if why := self.why_not(kind):
            raise ConfigError(why)
        out = Path(out or run_folder(cfg).export / "inprocess")
        with staged(out) as tmp:
            shutil.copytree(draft_folder, tmp / "draft")
            (tmp / "inprocess.json").write_text(json.dumps({"k": k}))
        return Export(out, "chain", k, resolve_target(cfg.model).path, f"inprocess --k {k}")

    def exported(self, cfg, folder) -> Exported:
        folder = single_export(cfg, folder, "inprocess.json", "serving.export --format inprocess")
        return Exported(folder, "chain", json.loads((folder / "inprocess.json").read_text())["k"],
                        {})

    def our_counters(self, stats, k, max_new_tokens):
        return as_counters(stats, k)

    def drafting(self, exported, settings):
        return settings

    def run(self, cfg, exported, target_path, prompts, settings, eos, with_draft) -> EngineRun:
        resolved = resolve_target(cfg.model)
        tokenizer = load_tokenizer(resolved)
        target = load_target(resolved, "float32", torch.device("cpu"))
        draft = None
        if with_draft:
            draft = engine_draft(load_draft(str(exported.folder / "draft"), target, tokenizer,
                                            torch.float32, torch.device("cpu")))
        gen = decode_prompts(target, prompts, settings, eos, tokenizer.pad_token_id, draft,
                             torch.Generator().manual_seed(cfg.run.seed), tokenizer.decode)
        run = EngineRun(gen.tokens, max(gen.draft_seconds + gen.verify_seconds, 1e-9))
        if with_draft:
            k = exported.k
            per_prompt = as_counters(gen.stats, k)
            if self.miscount:
                for c in per_prompt:
                    c.accepted_per_position[0] = max(c.accepted_per_position[0] - 3, 0)
            run.per_prompt = per_prompt
            run.counters = summed(per_prompt, k)
            run.report = {"drafting": "as the request"}
        return run


# --- the test -----------------------------------------------------------------------------------


@pytest.fixture
def inprocess_registered(monkeypatch):
    """The one registry line: ENGINES gains the toy engine."""
    monkeypatch.setattr(engines, "ENGINES", [*engines.ENGINES, InProcess])


@pytest.fixture
def trained(tiny_run, tiny_target):
    """A run whose trained draft is the target's first layer (an independent draft)."""
    from drafts.independent import layer_truncated

    cfg = tiny_run("eval.prompts=held_out", "eval.num_prompts=3", "eval.max_new_tokens=12")
    target = load_target(resolve_target(cfg.model), "float32", torch.device("cpu"))
    layer_truncated(target, 1).save_pretrained(run_folder(cfg).draft)
    load_tokenizer(resolve_target(cfg.model)).save_pretrained(run_folder(cfg).draft)
    return cfg


def test_a_toy_engine_is_exported_to_run_and_validated_with_one_registry_line(
        inprocess_registered, trained):
    from serving.export import export_draft
    from serving.validate import results_path, validate

    cfg = trained
    exported = export_draft(cfg, 2, fmt="inprocess")
    assert exported.folder == run_folder(cfg).export / "inprocess"
    assert (exported.folder / "draft" / "config.json").is_file()

    greedy = validate(cfg, "inprocess")
    assert greedy.ok, greedy.failures
    assert greedy.engine == "in-process" and greedy.k == 2 and greedy.prompts == 3
    assert greedy.tau_engine == greedy.tau_ours > 1.0  # the same loop: the same counts
    assert greedy.identical_engine_texts == greedy.identical_to_our_engine == 3
    report = json.loads(results_path(cfg, engines.make_engine("inprocess")).read_text())
    assert report["ok"] and report["compared_prompts"] == [0, 1, 2]

    sampled = validate(cfg, "inprocess", settings=DecodeSettings(temperature=1.0))
    assert sampled.ok and sampled.tau_engine == sampled.tau_ours, sampled.failures

    wrong = validate(cfg, engines.make_engine("inprocess", miscount=True))
    assert not wrong.ok and wrong.tau_engine < wrong.tau_ours
    assert any("tau" in f for f in wrong.failures) and any("alpha_1" in f for f in wrong.failures)


def test_an_engine_refuses_options_it_does_not_take_and_kinds_it_does_not_serve(
        inprocess_registered, trained):
    from serving.export import export_draft

    with pytest.raises(ConfigError, match=r"in-process takes no option \['draft_sampling'\]"):
        engines.make_engine("inprocess", draft_sampling="greedy")
    with pytest.raises(ConfigError, match="unknown serving engine 'sglang'"):
        engines.make_engine("sglang")
    with pytest.raises(ConfigError, match="no serving engine loads it"):
        engines.engine_for_format("trtllm")
    with pytest.raises(ConfigError, match="--k 0"):
        export_draft(trained, 0, fmt="inprocess")
