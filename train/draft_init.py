"""Draft initialisation from the target."""

from __future__ import annotations

import copy

import torch

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


def fresh(target, num_layers: int, hidden_size: int | None = None):
    """A randomly initialised model of the target's architecture: num_layers decoder layers and,
    when given, a narrower hidden size (attention heads and MLP width scale with it)."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(target.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    if hidden_size is not None and hidden_size != config.hidden_size:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if hidden_size % head_dim:
            raise ConfigError(f"fresh draft hidden size {hidden_size} must be a multiple of the "
                              f"target's head size {head_dim}.")
        group = config.num_attention_heads // config.num_key_value_heads
        heads = hidden_size // head_dim
        config.num_attention_heads = heads
        config.num_key_value_heads = max(1, heads // group)
        config.head_dim = head_dim
        config.intermediate_size = config.intermediate_size * hidden_size // config.hidden_size
        config.hidden_size = hidden_size
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def init_draft(spec: str, target, target_tokenizer, medusa_shape: tuple[int, int] | None = None):
    """train.draft -> a trainable fp32 draft on the target's device.

    'layer-truncated:<n>', 'fresh:<layers>[x<hidden>]', an HF folder / hub id, or Medusa heads
    (medusa_shape = (heads, layers), from TrainConfig.medusa_shape)."""
    from serving.drafts import pretrained_draft
    from serving.medusa import MedusaHeads

    kind, _, arg = spec.partition(":")
    if medusa_shape is not None:
        heads = MedusaHeads.from_target(target, *medusa_shape).float()
        heads.requires_grad_(True)
        return heads.train()
    if kind == "layer-truncated":
        draft = layer_truncated(target, _positive(arg, spec))
    elif kind == "fresh":
        layers, _, hidden = arg.partition("x")
        draft = fresh(target, _positive(layers, spec), _positive(hidden, spec) if hidden else None)
    else:
        try:
            draft = pretrained_draft(spec, target, target_tokenizer, torch.float32)
        except ConfigError:
            raise  # a vocabulary mismatch already says what is wrong
        except (OSError, ValueError) as e:
            raise ConfigError(f"train.draft={spec!r} is not 'layer-truncated:<n>', "
                              f"'fresh:<layers>[x<hidden>]', nor a loadable causal LM "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:160]}).") from None
    if getattr(draft.config, "final_logit_softcapping", None):
        raise ConfigError("the draft caps its logits (final_logit_softcapping), which the "
                          "training forward does not apply: choose another draft architecture.")
    draft = draft.to(device=target.device, dtype=torch.float32)
    draft.requires_grad_(True)
    return draft.train()


def _positive(text: str, spec: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"train.draft={spec!r}: expected a positive integer, got {text!r}.")
    return int(text)
