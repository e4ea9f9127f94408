"""The DFlash kind: what the rest of draftsmith asks of it (drafts.kind.DraftKind)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from torch import nn

from assets.published import layer_parameters
from decoding.quantise import quantised_copy
from drafts.dflash.engine import DFlashDraft
from drafts.dflash.head import (
    DFlashForTraining,
    DFlashHead,
    check_aux_layers,
    check_fits_target,
)
from drafts.eagle3.head import default_aux_layers
from drafts.folders import CONFIG_NAME
from drafts.kind import (
    LoadedDraft,
    TrainingShape,
    block_rows,
    check_blocks,
    check_feature_noise,
    feature_bytes,
)
from drafts.parallel import check_mask_token, resolve_mask_token
from recipe import ConfigError, TrainConfig


@dataclass
class DFlashModel:
    """A loaded drafter with the target embedding it reads tokens through."""

    head: DFlashHead
    embedding: nn.Module


def parse_layers(spec: str) -> int:
    """'dflash' -> 1 layer; 'dflash:<n>' -> n (and so for 'dspark')."""
    name, _, arg = spec.partition(":")
    if not arg:
        return 1
    if not arg.isdigit() or int(arg) < 1:
        raise ConfigError(f"train.draft={spec!r}: write '{name}' or '{name}:<layers>' with a "
                          "positive layer count.")
    return int(arg)


class DFlash:
    """Decoder layers on the target's context that fill k mask tokens in one forward."""

    name, description = "dflash", "a DFlash block drafter"
    head_class, engine_class = DFlashHead, DFlashDraft
    train_keys = ("position_decay", "position_weights", "dpace_smoothing", "aux_layers",
                  "feature_noise", "block_size", "block_starts", "mask_token_id", "head_init")
    target_layers, target_architecture = True, False
    one_layer_draft = 'dflash:1'
    label = "DFlash"
    unquantised = ("fc",)
    """Linear layers kept in the head's dtype when its weights are quantised: fc maps the
    target's features once per verified token, and its dtype is the head's working dtype."""
    formats = ("vllm",)
    hf_assistant, quantised_weights = False, True
    compiled_steps = False

    def claims(self, spec: str) -> bool:
        return spec == self.name or spec.startswith(f"{self.name}:")

    def reads_folder(self, config: dict) -> bool:
        return self.head_class.architecture in (config.get("architectures") or [])

    def check_train(self, cfg: TrainConfig) -> None:
        parse_layers(cfg.draft)
        check_feature_noise(cfg)
        check_blocks(cfg, "the drafter")
        if cfg.on_policy_fraction > 0 or cfg.lora_rank or cfg.target_logits != "online":
            raise ConfigError("a DFlash drafter needs the target's features on every batch and "
                              "is trained whole: set train.on_policy_fraction=0, "
                              "train.lora_rank=0 and train.target_logits=online.")

    def check_target(self, cfg: TrainConfig, k: int, target_config: dict) -> None:
        layers, vocab = target_config["num_hidden_layers"], target_config["vocab_size"]
        check_aux_layers(cfg.aux_layers or default_aux_layers(layers), layers)
        if cfg.mask_token_id is not None:
            check_mask_token(cfg.mask_token_id, vocab)
        if k > cfg.block_size:
            raise ConfigError(f"eval.k={k}: the drafter fills blocks of train.block_size="
                              f"{cfg.block_size} masks per step; set eval.k <= "
                              f"{cfg.block_size} or train a larger block.")

    def parameters(self, cfg: TrainConfig, target_config: dict) -> tuple[int, int]:
        h, layers = target_config["hidden_size"], target_config["num_hidden_layers"]
        aux = cfg.aux_layers or default_aux_layers(layers)
        body = parse_layers(cfg.draft) * layer_parameters(target_config) + len(aux) * h * h
        head = target_config["vocab_size"] * h  # the target's lm_head, kept by default
        return (body + head, 0) if cfg.freeze_embeddings is False else (body, head)

    def attention_layers(self, spec: str, target_config: dict) -> list[str]:
        return ["full_attention"] * parse_layers(spec)

    def training_shape(self, cfg: TrainConfig, target_config: dict) -> TrainingShape:
        aux = cfg.aux_layers or default_aux_layers(target_config["num_hidden_layers"])
        return TrainingShape(*self.parameters(cfg, target_config), target_config["vocab_size"],
                             block_rows(cfg), feature_bytes=feature_bytes(
                                 target_config["hidden_size"], len(aux), cfg.feature_dtype))

    def build(self, cfg: TrainConfig, target, tokenizer, examples, log) -> DFlashHead:
        layers = target.config.num_hidden_layers
        vocab = target.get_output_embeddings().weight.shape[0]
        aux = cfg.aux_layers or default_aux_layers(layers)
        mask_id = resolve_mask_token(cfg.mask_token_id, tokenizer, vocab, examples)
        head = self.head_class.from_target(target, aux, parse_layers(cfg.draft), mask_id,
                                           cfg.block_size, cfg.head_init or "target",
                                           **self.head_fields(cfg))
        log(f"[train] {self.description}: {head.config.num_hidden_layers} layer(s) "
            f"({cfg.head_init or 'target'} start) on aux layers "
            f"{aux} of {layers}, blocks of k = {cfg.block_size} masks (mask token {mask_id} "
            f"{tokenizer.convert_ids_to_tokens(mask_id)!r}), "
            f"{'every start' if cfg.block_starts == 0 else f'{cfg.block_starts} starts'} per "
            "conversation")
        return head.float().requires_grad_(True).train()

    def head_fields(self, cfg: TrainConfig) -> dict:
        """A subclass's own arguments of its head's constructor, from the train config."""
        return {}

    def freeze(self, draft: DFlashHead, cfg: TrainConfig) -> None:
        if cfg.freeze_embeddings is not False:  # default: the target's lm_head, kept
            draft.lm_head.requires_grad_(False)

    def wrap(self, draft: DFlashHead, cfg: TrainConfig) -> DFlashForTraining:
        return DFlashForTraining(draft, cfg.position_decay, cfg.block_starts)

    def load(self, spec, target, tokenizer, dtype, device) -> LoadedDraft:
        head = self.head_class.from_pretrained(spec, dtype, device)
        check_fits_target(head, target)
        head.read_mask_embedding(target.get_input_embeddings())
        return LoadedDraft(f"{spec} ({self.label}, {head.config.num_hidden_layers} layer(s), "
                           f"trained for k <= {head.block_size})", self,
                           DFlashModel(head, target.get_input_embeddings()),
                           max_k=head.block_size, max_k_unit="trained block positions")

    def quantise(self, loaded: LoadedDraft, weights: str) -> LoadedDraft:
        return replace(loaded, model=DFlashModel(quantised_copy(loaded.model.head, weights,
                                                                skip=self.unquantised),
                                                 loaded.model.embedding))

    def engine_draft(self, loaded: LoadedDraft, name: str) -> DFlashDraft:
        return self.engine_class(loaded.model.head, loaded.model.embedding, name)

    def check_export(self, draft_folder, k, target_shape) -> None:
        head = self.head_class.from_pretrained(draft_folder)
        if (head.config.hidden_size, head.vocab_size) != target_shape:
            raise ConfigError(f"the DFlash drafter reads hidden size {head.config.hidden_size} "
                              f"over {head.vocab_size} tokens; the target has {target_shape[0]} "
                              f"and {target_shape[1]}: export it with the target it was trained "
                              "on (model.target).")
        if k > head.block_size:
            raise ConfigError(f"--k {k}: the drafter was trained to fill blocks of "
                              f"{head.block_size} masks; export with --k <= {head.block_size} "
                              "or train with a larger train.block_size.")

    def write_export(self, draft_folder, out, k, fmt, verifier) -> None:
        pass  # the trained folder is in vLLM's layout already

    def export_name(self, fmt: str) -> str:
        return self.name

    def check_exported(self, folder) -> None:
        """Refuse a config vLLM would misread: a mask token outside the vocabulary, or target
        layer ids that do not match fc's width."""
        from safetensors import safe_open

        config = json.loads((folder / CONFIG_NAME).read_text())
        dflash = config.get("dflash_config") or {}
        check_mask_token(int(dflash.get("mask_token_id", -1)), config["vocab_size"],
                         f"{folder}: dflash_config.mask_token_id")
        ids = dflash.get("target_layer_ids") or []
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            width = f.get_slice("fc.weight").get_shape()[1]
        if len(ids) * config["hidden_size"] != width or min(ids, default=-1) < 0:
            raise ConfigError(f"{folder}: dflash_config.target_layer_ids {ids} do not fit fc "
                              f"({width} inputs = {width // config['hidden_size']} layers of "
                              f"{config['hidden_size']}): re-export the drafter.")
