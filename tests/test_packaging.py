"""The wheel holds every package and data file of the tree, and an install of it alone (not the
checkout) imports every package."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers import ROOT

def tracked_package_files() -> set[str]:
    """Every file git tracks under a top-level package of the tree (a folder with an
    __init__.py; tests are not shipped), sources and data alike."""
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.split()
    packages = {name.split("/")[0] for name in listed
                if name.count("/") == 1 and name.endswith("/__init__.py")} - {"tests"}
    return {name for name in listed
            if name.split("/")[0] in packages and "__pycache__" not in name}


def packages_of(files: set[str]) -> set[str]:
    return {str(Path(name).parent).replace("/", ".") for name in files
            if name.endswith("__init__.py")}


@pytest.mark.slow
def test_the_wheel_ships_every_package_and_imports_without_the_checkout(tmp_path):
    source = tmp_path / "source"  # the tracked files alone: a stale build/ must not fill gaps
    tracked_everywhere = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True,
                                        text=True, check=True).stdout.split()
    for name in tracked_everywhere:
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "--no-build-isolation", "-w", str(tmp_path / "dist"), str(source)],
                           capture_output=True, text=True, timeout=600, check=False)
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    wheel, = (tmp_path / "dist").glob("draftsmith-*.whl")
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if ".dist-info/" not in n}
    tracked = tracked_package_files()
    assert tracked - shipped == set(), f"in the tree, not in the wheel: {sorted(tracked - shipped)}"
    assert shipped - tracked == set(), f"in the wheel, not in the tree: {sorted(shipped - tracked)}"

    site = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target",
                              str(site), str(wheel)], capture_output=True, text=True, timeout=600,
                             check=False)
    assert install.returncode == 0, install.stderr[-2000:]
    packages = sorted(packages_of(tracked))
    probe = ("import importlib\n"
             f"for name in {packages!r}:\n"
             "    module = importlib.import_module(name)\n"
             f"    assert module.__file__.startswith({str(site)!r}), (name, module.__file__)\n"
             "print('ok')\n")
    # run outside the checkout, with the installed copy first on the path and no PYTHONPATH
    imported = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True,
                              text=True, timeout=600, check=False,
                              env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    assert imported.returncode == 0, imported.stderr[-3000:]
