"""The architecture matrix: every target architecture x draft kind x serving engine, run as a
user runs it, written into docs/architectures.md.

    .venv/bin/python -m benchmarks.architecture_matrix [--architectures llama3,qwen3]
        [--kinds eagle3,independent] [--engines vllm,llamacpp] [--root DIR] [--write-docs]
        [--no-run]

For each architecture of assets/tiny.py a tiny random-weight target is built (no downloads), and
stage 1 runs in vLLM (`distill.py --stage distill`, generation.backend=vllm). For each kind the
same data is copied into a run of that kind's embedded recipe, and the real commands run one
after the other: `distill.py --stage train`, `--stage export`, `python -m serving.validate`
(greedy, --enforce-eager) in vLLM; in llama.cpp `serving.export --format gguf` and
`serving.validate --engine llamacpp`. A cell is "validated" when the engine reproduces our
engine's acceptance (tau within 5 %, every alpha_k within 0.05), its texts are unchanged by the
draft, and drafts are accepted (tau > 1.05: a draft that accepts nothing proves nothing);
"refused" when drafts/ or the engine refuses the combination (the reason is the refusal as
printed), "failed" with the last error line otherwise.

Each cell's result is a JSON file under --root (default <cache>/architecture-matrix); a rerun
skips finished cells, so a killed matrix resumes. Logs: <root>/logs/<arch>-<kind>-<step>.log.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from runfolder.paths import RunFolder
from runfolder.provenance import cpu_name, provenance_counts, source_commit

ROOT = Path(__file__).resolve().parent.parent
KINDS = {
    # kind -> (embedded recipe, overrides that fit the tiny 8-layer, 128-wide targets)
    "eagle3": ("smollm2-135m-eagle3", ["train.max_steps=60"]),
    # independent and PARD: 6 of the 8 layers, forward KL at 3e-4. The recipes' TVD at 1e-3
    # drives a draft of a random-weight, peaked target to disjoint support, where TVD has no
    # gradient (tiny Llama-3: predicted alpha_1 0.084 at step 0, 0.008 from step 30 on); forward
    # KL at 3e-4 reaches 0.47 in 60 steps. A draft that accepts nothing proves nothing.
    "independent": ("smollm2-135m-independent", ["train.draft=layer-truncated:6",
                                                 "train.loss=fkl", "train.learning_rate=3e-4",
                                                 "train.max_steps=60"]),
    "dflash": ("smollm2-135m-dflash", ["train.max_steps=60", "train.learning_rate=3e-3"]),
    "pard": ("smollm2-135m-pard", ["train.draft=pard:layer-truncated:6", "train.max_steps=60",
                                   "train.loss=fkl", "train.learning_rate=3e-4"]),
    "medusa": ("smollm2-135m-medusa", ["train.max_steps=60"]),
}
SHARED = ["data.max_prompts=48", "generation.max_new_tokens=48", "generation.backend=vllm",
          "generation.vllm_enforce_eager=true",
          "eval.num_prompts=4", "eval.max_new_tokens=32", "train.save_every=30",
          "train.eval_every=30", "tracking.tracker=none"]
MIN_TAU = 1.05
"""Below this the draft is all but never accepted, and agreement proves nothing."""


def run(argv: list[str], log: Path) -> tuple[int, str]:
    """A command in a fresh interpreter -> (exit code, its last error-looking line)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        code = subprocess.run([sys.executable, *argv], cwd=ROOT, stdout=f,
                              stderr=subprocess.STDOUT).returncode
    lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith(("error:", "config error:", "training stopped"))
              or "Error" in ln.split(":")[0]]
    return code, (errors or lines or [""])[-1].strip()[:800]


def build_target(arch: str, root: Path) -> Path:
    from assets.tiny import build_tiny_target

    folder = root / "targets" / arch
    if not (folder / "draftsmith_source.json").is_file():
        build_tiny_target(arch, folder)
    return folder


def stage1(arch: str, target: Path, root: Path) -> tuple[Path | None, str]:
    """Stage 1 in vLLM for the architecture, once -> (run folder holding the data, error)."""
    out = root / "runs" / arch / "stage1"
    if (out / "manifest.json").is_file() and json.loads(
            (out / "manifest.json").read_text()).get("complete"):
        return out, ""
    recipe, extra = KINDS["medusa"]  # vLLM serves Medusa for every architecture; same data
    code, last = run(["distill.py", "--config", f"configs/{recipe}.yaml", "--stage", "distill",
                      f"model.target={target}", f"run.output_dir={out}", *SHARED, *extra],
                     root / "logs" / f"{arch}-stage1.log")
    return (out, "") if code == 0 else (None, f"stage 1 in vLLM: {last}")


def cell(arch: str, kind: str, engine: str, target: Path, data: Path, root: Path) -> dict:
    """Train (once per kind), export and validate one cell -> its result."""
    recipe, extra = KINDS[kind]
    out = root / "runs" / arch / kind
    common = [f"model.target={target}", f"run.output_dir={out}", *SHARED, *extra]
    config = ["--config", f"configs/{recipe}.yaml"]
    logs = root / "logs"
    result = dict(architecture=arch, kind=kind, engine=engine)

    if not RunFolder(out).draft.is_dir():
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        shutil.copytree(data / "data", out / "data")
        shutil.copy(data / "manifest.json", out / "manifest.json")
        code, last = run(["distill.py", *config, "--stage", "train", *common],
                         logs / f"{arch}-{kind}-train.log")
        if code != 0:
            return {**result, "status": "refused" if code == 2 else "failed",
                    "reason": f"train: {last}"}
    if engine == "vllm":
        steps = [("export", ["distill.py", *config, "--stage", "export", *common]),
                 ("validate", ["-m", "serving.validate", *config, "--enforce-eager", *common])]
        results = out / "validate" / "results.json"
    else:
        steps = [("export-gguf", ["-m", "serving.export", *config, "--format", "gguf", *common]),
                 ("validate-llamacpp", ["-m", "serving.validate", *config, "--engine",
                                        "llamacpp", *common])]
        results = out / "validate" / "results-llamacpp.json"
    for step, argv in steps:
        code, last = run(argv, logs / f"{arch}-{kind}-{step}.log")
        if code != 0 and not (step.startswith("validate") and results.is_file()):
            return {**result, "status": "refused" if code == 2 else "failed",
                    "reason": f"{step}: {last}"}
    report = json.loads(results.read_text())
    accepted = report["tau_ours"] > MIN_TAU
    status = "validated" if report["ok"] and accepted else "failed"
    reason = "" if status == "validated" else (
        "; ".join(report["failures"]) or f"tau {report['tau_ours']:.3f}: drafts not accepted")
    return {**result, "status": status, "reason": reason,
            **{key: report[key] for key in ("tau_ours", "tau_engine", "alpha_ours",
                                            "alpha_engine", "identical_engine_texts",
                                            "identical_to_our_engine", "prompts", "k")}}


def _config(target: Path) -> dict:
    return json.loads((target / "config.json").read_text())


def _short(reason: str) -> str:
    """A reason for a table cell: vLLM's list of supported targets is in the docs' text."""
    head, _, rest = reason.partition(" Supported: ")
    return head + (" " + rest.split(". ", 1)[1] if ". " in rest else "")


def results_file(root: Path) -> Path:
    return root / "matrix.json"


def table(cells: list[dict], commit: str, cpu: str) -> str:
    """The matrix as Markdown: one row per architecture x kind, one column per engine; each
    refusal or failure is a numbered note under the table, word for word."""
    from assets.tiny import ARCHITECTURES

    engines = sorted({c["engine"] for c in cells}, key=["vllm", "llamacpp"].index)
    head = ["| architecture | kind | " + " | ".join(
        {"vllm": "vLLM 0.32: tau ours / vLLM", "llamacpp": "llama.cpp: tau ours / llama.cpp"}[e]
        for e in engines) + " |", "|---|---|" + "---|" * len(engines)]
    rows, notes = [], []
    by = {(c["architecture"], c["kind"], c["engine"]): c for c in cells}
    for arch in [a for a in ARCHITECTURES if any(c["architecture"] == a for c in cells)]:
        for kind in [k for k in KINDS if any((arch, k, e) in by for e in engines)]:
            entries = []
            for e in engines:
                c = by.get((arch, kind, e))
                if c is None:
                    entries.append("not run")
                    continue
                text = ""
                if c["status"] == "validated" or "tau_ours" in c:
                    text = (f"{c['tau_ours']:.3f} / {c['tau_engine']:.3f}, texts "
                            f"{c['identical_engine_texts']}/{c['prompts']}")
                if c["status"] != "validated":
                    reason = _short(c["reason"])
                    if reason not in notes:
                        notes.append(reason)
                    text = f"{text}; " if text else ""
                    text = f"**{c['status']}** ({notes.index(reason) + 1})" + (
                        f": {text.rstrip('; ')}" if text else "")
                else:
                    text = f"validated: {text}"
                entries.append(text)
            rows.append(f"| {arch} | {kind} | " + " | ".join(entries) + " |")
    listed = [f"{i}. {n}".replace("|", "\\|") for i, n in enumerate(notes, 1)]
    return "\n".join([f"Table written at commit {commit} on {cpu}: `python -m "
                      "benchmarks.architecture_matrix --write-docs`. Cells computed at "
                      f"{provenance_counts(cells, 'cell')}.", "", *head, *rows, "", *listed])


def main() -> None:
    from assets.tiny import ARCHITECTURES
    from recipe import cache_root

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--architectures", default=",".join(ARCHITECTURES))
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--engines", default="vllm,llamacpp")
    parser.add_argument("--root", type=Path, default=None)
    parser.add_argument("--write-docs", action="store_true",
                        help="write the table into docs/architectures.md")
    parser.add_argument("--no-run", action="store_true",
                        help="only print (and with --write-docs write) the finished cells")
    args = parser.parse_args()
    root = (args.root or cache_root() / "architecture-matrix").resolve()
    cells_dir = root / "cells"
    cells_dir.mkdir(parents=True, exist_ok=True)
    from drafts import check_train_config
    from recipe import load_config
    from serving.engines import make_engine

    targets, data, errors = {}, {}, {}
    for kind in [] if args.no_run else args.kinds.split(","):  # kind by kind
        recipe, extra = KINDS[kind]
        config = load_config(ROOT / "configs" / f"{recipe}.yaml", extra)
        checked = check_train_config(config.train)
        for arch in args.architectures.split(","):
            for engine in args.engines.split(","):
                path = cells_dir / f"{arch}-{kind}-{engine}.json"
                if path.is_file():
                    continue
                start = time.time()
                if arch not in targets:
                    targets[arch] = build_target(arch, root)
                engine_ = make_engine(engine)
                why = engine_.why_not(checked) or (  # llama.cpp's converter answers itself
                    engine_.why_not_target(checked, _config(targets[arch]), config.train.draft)
                    if engine == "vllm" else None)
                if why:
                    result = dict(architecture=arch, kind=kind, engine=engine, status="refused",
                                  reason=why)
                else:
                    if arch not in data:
                        data[arch], errors[arch] = stage1(arch, targets[arch], root)
                    result = (cell(arch, kind, engine, targets[arch], data[arch], root)
                              if data[arch] else dict(architecture=arch, kind=kind,
                                                      engine=engine, status="failed",
                                                      reason=errors[arch]))
                result["seconds"] = round(time.time() - start, 1)
                result.update(commit=source_commit(), hardware=cpu_name())  # this cell's own
                path.write_text(json.dumps(result, indent=2) + "\n")
                print(f"[matrix] {arch} x {kind} x {engine}: {result['status']} "
                      f"{result.get('tau_ours', '')} {result.get('tau_engine', '')} "
                      f"{result.get('reason', '')} ({result['seconds']} s)", flush=True)
    cells = [json.loads(p.read_text()) for p in sorted(cells_dir.glob("*.json"))]
    results_file(root).write_text(json.dumps(cells, indent=2) + "\n")
    text = table(cells, source_commit(), cpu_name())
    print(text)
    if args.write_docs:
        write_docs(text)


BEGIN, END = "<!-- matrix:begin -->", "<!-- matrix:end -->"


def write_docs(text: str) -> None:
    """Replace the table between the markers of docs/architectures.md."""
    doc = ROOT / "docs" / "architectures.md"
    before, rest = doc.read_text().split(BEGIN)
    _, after = rest.split(END)
    doc.write_text(f"{before}{BEGIN}\n{text}\n{END}{after}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
