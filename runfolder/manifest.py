"""The run's manifest.json: the identity of the data (target, settings), its status and counts,
written atomically; the identity check every stage makes before reading the data."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def read_manifest(out: Path) -> dict[str, Any] | None:
    path = out / "manifest.json"
    return json.loads(path.read_text()) if path.is_file() else None


def write_manifest(out: Path, manifest: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, out / "manifest.json")


def identity_differences(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two identity dicts."""
    diffs = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += identity_differences(a, b, f"{prefix}{key}.")
        elif a != b:
            diffs.append(f"{prefix}{key}: {a!r} (existing) vs {b!r} (now)")
    return diffs
