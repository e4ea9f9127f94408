"""The reports later stages leave in the run folder and others read: the eval report of a draft
(for its model card) and the stage-1 counts, with the one way every report writes a speedup."""

from __future__ import annotations

import json
from pathlib import Path

from runfolder.paths import RunFolder


def speed_text(speed: dict | None, baseline: bool = False) -> str:
    """A method's speedup as every report prints it: '0.69x (0.36-2.93, uncertain)' (median over
    rounds, quartiles, verdict); '1.00x' for plain decoding itself, '-' when not measured."""
    if not speed:
        return "-"
    if baseline:
        return "1.00x"
    return f"{speed['median']:.2f}x ({speed['q25']:.2f}-{speed['q75']:.2f}, {speed['verdict']})"


def eval_report_of(run: RunFolder, draft_folder: Path) -> dict | None:
    """<run>/eval/results.json when it measured this very draft folder, else None."""
    if not run.eval_results.is_file():
        return None
    report = json.loads(run.eval_results.read_text())
    measured = str(report.get("draft") or "").split(" (")[0]
    if not measured or Path(measured).resolve() != Path(draft_folder).resolve():
        return None
    return report


def stage1_counts(run: RunFolder) -> dict | None:
    """The manifest's counts of conversations and tokens per split, when stage 1 ran."""
    return json.loads(run.manifest.read_text()).get("counts") if run.manifest.is_file() else None
