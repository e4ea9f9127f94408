"""A draft's folder: weights as one safetensors file next to its config.json, written and read
the same way for every kind that is not an HF model (heads)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from recipe import ConfigError

CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"


def save_folder(folder: Path, state: dict[str, torch.Tensor], config: dict) -> None:
    """state (CPU copies, contiguous) -> folder/model.safetensors; config -> folder/config.json."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in state.items()},
              str(folder / WEIGHTS_NAME))
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")


def read_config(folder: str | Path) -> dict | None:
    """folder/config.json, or None when the spec is not a folder holding one."""
    path = Path(folder).expanduser() / CONFIG_NAME
    return json.loads(path.read_text()) if path.is_file() else None


def load_folder(folder: str | Path, build, what: str, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu", derived: tuple[str, ...] = ()) -> nn.Module:
    """A head folder -> the module build(config, state) makes, its weights loaded and checked
    (every tensor present, none left over; `derived` names buffers rebuilt, not stored), in
    evaluation mode on device."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = read_config(folder)
    if config is None:
        raise ConfigError(f"{folder} holds no {CONFIG_NAME}: it is not a saved {what}.")
    state = load_file(str(folder / WEIGHTS_NAME))
    module = build(config, state)
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith(derived)]
    if missing or unexpected:
        raise ConfigError(f"{folder / WEIGHTS_NAME} does not match {what}: missing "
                          f"{missing[:4]}, unexpected {unexpected[:4]}.")
    return module.to(device=device, dtype=dtype).eval()
