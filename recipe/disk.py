"""Refusing, before anything is written, a stage whose output would not fit on the disk."""

from __future__ import annotations

import shutil
from pathlib import Path

from recipe.config import ConfigError


def check_free_space(folder: Path, needed: int, what: str, fix: str) -> None:
    """Raise ConfigError when the disk that holds (or will hold) folder has fewer than `needed`
    bytes free: what is written there, and how to make it fit, are named in the message."""
    probe = Path(folder)
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed > free:
        raise ConfigError(f"{what} needs about {needed / 2**30:.2f} GiB in {folder}, but only "
                          f"{free / 2**30:.2f} GiB is free there: {fix} Nothing was written.")
