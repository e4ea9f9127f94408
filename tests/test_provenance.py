"""runfolder.provenance: the commit and hardware every trained draft and benchmark table names."""

import os
import subprocess
from pathlib import Path

from runfolder.provenance import cpu_name, hardware, provenance_counts, source_commit


def _git(root, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root,
                   check=True, capture_output=True)


def test_the_commit_is_the_trees_and_says_when_tracked_files_changed(tmp_path):
    assert source_commit(tmp_path) == "unknown"  # not a checkout
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "a.py")
    _git(tmp_path, "commit", "-q", "-m", "a")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path,
                          capture_output=True, text=True, check=True).stdout.strip()
    (tmp_path / "new.txt").write_text("untracked files are not the code that ran\n")
    assert source_commit(tmp_path) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert source_commit(tmp_path) == head + "+changes"


def test_the_hardware_names_the_cpu_with_its_bf16_flags():
    name = cpu_name()
    assert name.startswith(f"{os.cpu_count()} x ") and "(" in name
    flags = Path("/proc/cpuinfo").read_text()
    assert ("avx512_bf16" in name) == (" avx512_bf16" in flags)
    import torch

    if torch.cuda.is_available():
        assert torch.cuda.get_device_name(0) in hardware()
    else:
        assert hardware() == name


def test_provenance_counts_each_commit_and_hardware_and_names_what_was_never_recorded():
    records = [{"commit": "abc", "hardware": "2 x CPU"}, {"commit": "abc", "hardware": "2 x CPU"},
               {"commit": "def", "hardware": "1 x H100"}, {"tau": 1.2}]
    assert provenance_counts(records, "run") == ("commit abc on 2 x CPU (2 runs); commit def on "
                                                 "1 x H100 (1 run); commit unrecorded on "
                                                 "unrecorded (1 run)")
