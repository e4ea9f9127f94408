"""The EAGLE-3 kind: what the rest of draftsmith asks of it (drafts.kind.DraftKind)."""

from __future__ import annotations

from assets.published import layer_parameters
from drafts.eagle3.engine import Eagle3Draft, Eagle3Model
from drafts.eagle3.head import (
    Eagle3Head,
    check_aux_layers,
    check_fits_target,
    check_mlp_width,
    check_target_init_layers,
    check_vocab_maps,
    default_aux_layers,
    is_eagle3_config,
)
from drafts.eagle3.training import Eagle3ForTraining
from drafts.folders import WEIGHTS_NAME, save_folder
from drafts.kind import (
    LoadedDraft,
    TrainingShape,
    check_feature_noise,
    check_position_decay,
    feature_bytes,
    micro_batch_tokens,
)
from drafts.vocabulary import frequent_labels
from recipe import ConfigError, TrainConfig


class Eagle3:
    """A decoder layer (or a few) on the target's aux features, over a reduced draft
    vocabulary."""

    name, description = "eagle3", "an EAGLE-3 head"
    train_keys = ("position_decay", "position_weights", "dpace_smoothing", "eagle3",
                  "aux_layers", "draft_vocab_size", "feature_noise", "head_init")
    target_layers, target_architecture = True, False
    one_layer_draft = None
    formats = ("vllm", "speculators")
    hf_assistant, quantised_weights = False, True
    compiled_steps = True

    def claims(self, spec: str) -> bool:
        return spec.startswith("eagle")

    def reads_folder(self, config: dict) -> bool:
        return is_eagle3_config(config)

    def check_train(self, cfg: TrainConfig) -> None:
        if cfg.draft != "eagle3":
            raise ConfigError(f"train.draft={cfg.draft!r}: the EAGLE-3 head is 'eagle3' (its "
                              "decoder layers: train.eagle3.layers).")
        check_position_decay(cfg)
        check_feature_noise(cfg)
        if cfg.eagle3.ttt_steps < 1:
            raise ConfigError(f"train.eagle3.ttt_steps={cfg.eagle3.ttt_steps} must be >= 1.")
        if cfg.eval_k > cfg.eagle3.ttt_steps:
            raise ConfigError(f"train.eval_k={cfg.eval_k}: the predicted acceptance of draft "
                              f"position j needs training-time-test step j, and "
                              f"train.eagle3.ttt_steps={cfg.eagle3.ttt_steps}: lower eval_k or "
                              "raise train.eagle3.ttt_steps.")
        if cfg.on_policy_fraction > 0 or cfg.lora_rank or cfg.target_logits != "online":
            raise ConfigError("an EAGLE-3 head needs the target's features on every batch and "
                              "is trained whole: set train.on_policy_fraction=0, "
                              "train.lora_rank=0 and train.target_logits=online.")
        if cfg.draft_vocab_size is not None and cfg.draft_vocab_size < 1:
            raise ConfigError("train.draft_vocab_size must be >= 1 (or null).")
        if cfg.eagle3.intermediate_size is not None and cfg.eagle3.intermediate_size < 1:
            raise ConfigError(f"train.eagle3.intermediate_size={cfg.eagle3.intermediate_size} "
                              "must be >= 1 (or null for the target's MLP width).")
        if cfg.eagle3.layers < 1:
            raise ConfigError(f"train.eagle3.layers={cfg.eagle3.layers} must be >= 1 (1 is "
                              "EAGLE-3's head).")

    def check_target(self, cfg: TrainConfig, k: int, target_config: dict) -> None:
        layers, vocab = target_config["num_hidden_layers"], target_config["vocab_size"]
        aux = check_aux_layers(cfg.aux_layers or default_aux_layers(layers), layers)
        if cfg.head_init == "target":
            check_target_init_layers(aux[-1], cfg.eagle3.layers, layers)
        if cfg.eagle3.intermediate_size and cfg.head_init == "target":
            check_mlp_width(cfg.eagle3.intermediate_size, target_config["intermediate_size"])
        if cfg.draft_vocab_size is not None and cfg.draft_vocab_size > vocab:
            raise ConfigError(f"train.draft_vocab_size={cfg.draft_vocab_size} exceeds the "
                              f"target's vocabulary of {vocab} tokens: lower it (32000 is "
                              "EAGLE-3's usual), or null for the whole vocabulary.")

    def parameters(self, cfg: TrainConfig, target_config: dict) -> tuple[int, int]:
        h = target_config["hidden_size"]
        head = self.draft_vocabulary(cfg, target_config) * h
        body = (layer_parameters(target_config, input_width=2 * h,  # the first layer, and fc
                                 intermediate=cfg.eagle3.intermediate_size) + 3 * h * h
                + (cfg.eagle3.layers - 1) * layer_parameters(
                    target_config, intermediate=cfg.eagle3.intermediate_size)
                + (3 * h if cfg.eagle3.fc_norm else 0))
        return (body, head) if cfg.freeze_embeddings else (body + head, 0)

    def draft_vocabulary(self, cfg: TrainConfig, target_config: dict) -> int:
        return cfg.draft_vocab_size or target_config["vocab_size"]

    def attention_layers(self, spec: str, target_config: dict) -> list[str]:
        return ["full_attention"]

    def training_shape(self, cfg: TrainConfig, target_config: dict) -> TrainingShape:
        layers = target_config["num_hidden_layers"]
        aux = cfg.aux_layers or default_aux_layers(layers)
        return TrainingShape(*self.parameters(cfg, target_config),
                             self.draft_vocabulary(cfg, target_config),
                             micro_batch_tokens(cfg) * cfg.eagle3.ttt_steps, cfg.eagle3.ttt_steps,
                             feature_bytes(target_config["hidden_size"], len(aux),
                                           cfg.feature_dtype))

    def build(self, cfg: TrainConfig, target, tokenizer, examples, log) -> Eagle3Head:
        """A fresh head: aux layers checked against the target, the draft vocabulary the
        train.draft_vocab_size most frequent label tokens of the training conversations."""
        layers = target.config.num_hidden_layers
        aux_layers = check_aux_layers(cfg.aux_layers or default_aux_layers(layers), layers)
        vocab_size = target.get_output_embeddings().weight.shape[0]
        size = self.draft_vocabulary(cfg, {"vocab_size": vocab_size})
        draft_ids, covered = frequent_labels(examples, vocab_size, size)
        e = cfg.eagle3
        head = Eagle3Head.from_target(target, aux_layers, draft_ids, cfg.head_init or "random",
                                     e.intermediate_size, e.layers, e.fc_norm,
                                     e.norm_output).float()
        version = ("EAGLE 3.1 (" + ", ".join(name for name, on in [
            ("fc_norm", e.fc_norm), ("norm_output", e.norm_output)] if on) + ") head"
            if e.fc_norm or e.norm_output else "EAGLE-3 head")
        log(f"[train] {version} of {head.num_layers} decoder layer"
            f"{'s' if head.num_layers > 1 else ''} on aux layers {aux_layers} of {layers}, an MLP "
            f"of {head.config.intermediate_size} units; draft vocabulary {size} of {vocab_size} "
            f"tokens covers {100 * covered:.2f} % of the training labels")
        return head.requires_grad_(True).train()

    def freeze(self, draft: Eagle3Head, cfg: TrainConfig) -> None:
        if cfg.freeze_embeddings:  # default: the head trains its lm_head
            draft.lm_head.requires_grad_(False)

    def wrap(self, draft: Eagle3Head, cfg: TrainConfig) -> Eagle3ForTraining:
        return Eagle3ForTraining(draft, cfg.eagle3.ttt_steps, cfg.position_decay)

    def load(self, spec, target, tokenizer, dtype, device) -> LoadedDraft:
        head = Eagle3Head.from_pretrained(spec, dtype, device)
        check_fits_target(head, target)
        return LoadedDraft(f"{spec} (EAGLE-3, draft vocabulary {head.draft_vocab_size})", self,
                           Eagle3Model(head, target.get_input_embeddings()))

    def quantise(self, loaded: LoadedDraft, weights: str) -> LoadedDraft:
        return loaded  # Eagle3Draft quantises the matrices of its FusedLayer (loaded.weights)

    def engine_draft(self, loaded: LoadedDraft, name: str) -> Eagle3Draft:
        return Eagle3Draft(loaded.model.head, loaded.model.embedding, name, loaded.weights,
                           loaded.compile, loaded.model.layers)

    def check_export(self, draft_folder, k, target_shape) -> None:
        head = Eagle3Head.from_pretrained(draft_folder)  # refuses a d2t that mismatches t2d
        if (head.config.hidden_size, head.vocab_size) != target_shape:
            raise ConfigError(f"the EAGLE-3 head reads hidden size {head.config.hidden_size} over "
                              f"{head.vocab_size} tokens; the target has {target_shape[0]} and "
                              f"{target_shape[1]}: export it with the target it was trained on "
                              "(model.target).")

    def write_export(self, draft_folder, out, k, fmt, verifier) -> None:
        head = Eagle3Head.from_pretrained(draft_folder)
        if fmt == "vllm":
            head.save_pretrained(out)
        else:
            (out / WEIGHTS_NAME).unlink()
            save_speculators(head, out, k, verifier)

    def export_name(self, fmt: str) -> str:
        return "eagle3" if fmt == "vllm" else "eagle3-speculators"

    def check_exported(self, folder) -> None:
        """Refuse an exported head whose d2t does not match its t2d before vLLM serves it (vLLM
        reads d2t alone and would silently map draft tokens to other words)."""
        from safetensors import safe_open

        with safe_open(str(folder / WEIGHTS_NAME), "pt") as f:
            if not {"d2t", "t2d"} <= set(f.keys()):
                raise ConfigError(f"{folder / WEIGHTS_NAME} lacks d2t or t2d: re-export the "
                                  "head (python -m serving.export).")
            check_vocab_maps(f.get_tensor("d2t"), f.get_tensor("t2d"), str(folder))


def save_speculators(head: Eagle3Head, folder, k: int, verifier: str) -> None:
    """An EAGLE-3 head in the speculators format (which `vllm serve <folder>` also reads): the
    layer as `layers.0.*`, the Llama fields under transformer_layer_config, and
    norm_before_residual written out (it defaults to true there)."""
    state = {k.replace("midlayer.", "layers.0.", 1): v for k, v in head.state_dict().items()
             if not k.startswith("rotary.")}
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
              "speculators_config": {
                  "algorithm": "eagle3", "default_proposal_method": "greedy",
                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k}],
                  "verifier": {"name_or_path": verifier, "architectures": []}},
              "transformer_layer_config": head.layer_config(), **head.eagle3_fields(),
              "draftsmith": head.provenance()}
    save_folder(folder, state, config)
