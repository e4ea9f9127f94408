"""The packages' imports point one way: recipe -> assets -> decoding -> drafts -> runfolder ->
plan -> the stages (distill, train, eval, serving) -> the entry script and the benchmarks. No stage
imports another: what two stages share lives below them (the run folder's contract in
runfolder, the acceptance maths in decoding). Imports inside functions count too."""

from __future__ import annotations

import ast
import subprocess

from tests.helpers import ROOT

LAYERS = [{"recipe"}, {"assets"}, {"decoding"}, {"drafts"}, {"runfolder"}, {"plan"},
          {"distill", "train", "eval", "serving"}, {"benchmarks", "distill.py"}]
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


def kind_name_comparisons(names: set[str]) -> list[str]:
    """'file:line' of every comparison with a literal kind name (==, !=, in, not in a literal
    tuple, list or set) in the project's code outside drafts/, the tests and the benchmarks
    (whose command lines choose kinds by name)."""
    found = []
    for path in project_files():
        if path.startswith(("drafts/", "tests/", "benchmarks/")):
            continue
        for node in ast.walk(ast.parse((ROOT / path).read_text())):
            if not isinstance(node, ast.Compare):
                continue
            literals = []
            for side in [node.left, *node.comparators]:
                elements = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                literals += [e.value for e in elements if isinstance(e, ast.Constant)]
            if names & {v for v in literals if isinstance(v, str)}:
                found.append(f"{path}:{node.lineno}")
    return found


def test_no_kind_name_is_compared_outside_drafts():
    """Nothing outside drafts/ asks which kind a draft is: it asks the kind (its facts, its
    TrainingShape). A serving engine's own table of the kinds it serves is keyed by name, which
    is not a comparison."""
    from drafts.registry import KINDS

    names = {kind.name for kind in KINDS}
    assert kind_name_comparisons(names) == []


def test_the_kind_name_scan_finds_a_comparison(tmp_path, monkeypatch):
    """The scan above does see a comparison with a kind name (it would pass vacuously if not)."""
    import tests.test_layers as layers

    (tmp_path / "serving").mkdir()
    (tmp_path / "serving" / "leak.py").write_text(
        "def f(kind):\n    return kind.name == 'eagle3' or kind.name in ('pard', 'x')\n")
    monkeypatch.setattr(layers, "ROOT", tmp_path)
    monkeypatch.setattr(layers, "project_files", lambda: ["serving/leak.py"])
    assert layers.kind_name_comparisons({"eagle3"}) == ["serving/leak.py:2"]
    assert layers.kind_name_comparisons({"pard"}) == ["serving/leak.py:2"]


LONGEST = {"serving": 60, "": 80}
"""The longest function, in lines, a package may hold ("" every package but benchmarks and the
tests): one that reads in one screen, its parts named."""


def long_functions(files: list[str]) -> list[str]:
    """'path:name (lines)' for each function longer than its package allows."""
    found = []
    for path in files:
        package = path.split("/")[0] if "/" in path else ""
        if package in ("benchmarks", "tests"):
            continue
        limit = LONGEST.get(package, LONGEST[""])
        for node in ast.walk(ast.parse((ROOT / path).read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{path}:{node.name} ({lines})")
    return found


def test_no_function_is_longer_than_its_package_allows():
    assert long_functions(project_files()) == []


def test_the_length_scan_finds_a_long_function(tmp_path, monkeypatch):
    import tests.test_layers as layers

    (tmp_path / "serving").mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(60))
    (tmp_path / "serving" / "long.py").write_text(f"def short():\n    pass\n\n\ndef f():\n{body}")
    monkeypatch.setattr(layers, "ROOT", tmp_path)
    assert layers.long_functions(["serving/long.py"]) == ["serving/long.py:f (61)"]
