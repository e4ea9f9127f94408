"""The packages' imports point one way: recipe -> assets -> decoding -> drafts -> runfolder ->
the stages (distill, train, eval, serving) -> the entry script and the benchmarks. No stage
imports another: what two stages share lives below them (the run folder's contract in
runfolder, the acceptance maths in decoding). Imports inside functions count too."""

from __future__ import annotations

import ast
import subprocess

from tests.helpers import ROOT

LAYERS = [{"recipe"}, {"assets"}, {"decoding"}, {"drafts"}, {"runfolder"},
          {"distill", "train", "eval", "serving"}, {"plan"}, {"benchmarks", "distill.py"}]
"""Lowest first; a package may import its own layer's members only when it is that member."""


def _layer(package: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if package in layer)


def project_files() -> list[str]:
    """The Python files git tracks or would track (new ones included), as they are now."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                             "*.py"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.split()
    return sorted({p for p in listed if (ROOT / p).is_file()})


def import_arrows() -> set[tuple[str, str, str]]:
    """(file, importing package, imported package) for every import of a project package."""
    files = project_files()
    packages = {name for layer in LAYERS for name in layer}
    arrows = set()
    for path in files:
        if path.startswith("tests/"):
            continue
        source = path if "/" not in path else path.split("/")[0]
        for node in ast.walk(ast.parse((ROOT / path).read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                target = name.split(".")[0]
                if target in packages and target != source:
                    arrows.add((path, source, target))
    return arrows


def test_every_package_is_placed_in_a_layer():
    top = {p.split("/")[0] for p in project_files() if not p.startswith("tests/")}
    assert top <= {name for layer in LAYERS for name in layer}, top


def test_imports_point_down_and_no_stage_imports_another():
    wrong = sorted(f"{path}: {source} -> {target}" for path, source, target in import_arrows()
                   if _layer(target) >= _layer(source))
    assert not wrong, "imports that point up or across the stages:\n" + "\n".join(wrong)
