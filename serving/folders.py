"""Writing a draft folder: weights as one safetensors file next to its config.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"


def save_folder(folder: Path, state: dict[str, torch.Tensor], config: dict) -> None:
    """state (CPU copies, contiguous) -> folder/model.safetensors; config -> folder/config.json."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in state.items()},
              str(folder / WEIGHTS_NAME))
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
