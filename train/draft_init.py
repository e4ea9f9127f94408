"""Draft initialisation from the target."""

from __future__ import annotations

import copy

from recipe import ConfigError


def layer_truncated(target, num_layers: int):
    """A copy of the target keeping its embeddings, first `num_layers` decoder layers, final norm
    and head: the cheapest draft that already speaks the target's language (untrained)."""
    decoder = target.get_decoder()
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ConfigError(f"{type(target).__name__} keeps no `layers` list in its decoder, so it "
                          "cannot be layer-truncated: name a draft model instead.")
    if not 1 <= num_layers < len(layers):
        raise ConfigError(f"layer-truncated:{num_layers} needs 1 <= n < {len(layers)} (the "
                          "target's layer count).")
    draft = copy.deepcopy(target)
    draft.get_decoder().layers = draft.get_decoder().layers[:num_layers]
    draft.config.num_hidden_layers = num_layers
    if getattr(draft.config, "layer_types", None):
        draft.config.layer_types = draft.config.layer_types[:num_layers]
    draft.requires_grad_(False)
    return draft.eval()
