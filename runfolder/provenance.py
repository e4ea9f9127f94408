"""Where a figure comes from: the hardware that computed it and the commit of the code that did,
recorded with every trained draft and printed with every benchmark table."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cpu_name() -> str:
    """The CPU model, whether it computes bf16 natively (/proc/cpuinfo) and its L3 cache
    (a small draft's weights stay in it between steps, a target's do not)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                  if ln.startswith("model name")), "unknown CPU")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines()
                  if ln.startswith("flags")), [])
    shown = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    l3 = Path("/sys/devices/system/cpu/cpu0/cache/index3/size")  # e.g. 107520K
    size = l3.read_text().strip() if l3.is_file() else ""
    if size.endswith("K") and size[:-1].isdigit():
        shown.append(f"L3 {int(size[:-1]) // 1024} MiB")
    return f"{os.cpu_count()} x {model} ({' '.join(shown)})"


def hardware() -> str:
    """The accelerators a process computes on: its GPUs by name where it has any, else the CPU
    (cpu_name)."""
    import torch

    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return ", ".join(f"{names.count(n)} x {n}" for n in dict.fromkeys(names))
    return cpu_name()


def source_commit(root: Path = ROOT) -> str:
    """The commit of the source tree at root (short hash), '+changes' when tracked files differ
    from it; 'unknown' outside a git checkout (an installed wheel)."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                              check=False)

    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode != 0:
            return "unknown"
        changed = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    except OSError:  # no git on the PATH
        return "unknown"
    return head.stdout.strip() + ("+changes" if changed else "")


def provenance_counts(records, unit: str) -> str:
    """Each commit and hardware that computed `records` (dicts with "commit" and "hardware"),
    with how many `unit`s each: a table may gather figures of several runs ('unrecorded' for
    records older than the record)."""
    counts: dict[tuple[str, str], int] = {}
    for r in records:
        key = (r.get("commit", "unrecorded"), r.get("hardware", "unrecorded"))
        counts[key] = counts.get(key, 0) + 1
    return "; ".join(f"commit {commit} on {hardware} ({n} {unit}{'s' * (n != 1)})"
                     for (commit, hardware), n in counts.items())
