"""What a draft kind is: the one interface the training loop, the engine, eval and export use.

A kind (an independent LM, Medusa heads, an EAGLE-3 head, prompt lookup, ...) is one package
drafts/<name>/ whose kind.py implements DraftKind, listed once in drafts/registry.py. Nothing
outside drafts/ asks which kind a draft is: it asks the kind (its facts, its TrainingShape).

For training, a kind wraps its draft in a module whose forward returns draft logits [M, Vd]
only where a loss applies (DDP, FSDP and DeepSpeed wrap that forward), and whose
`loss_rows(pred_mask)` (a list of LossRows) says which of the batch's N loss positions those M
rows are scored against and which draft position they serve. The loop then indexes target
logits [N, V] and labels [N] by those rows, weighs the loss per run of rows, and fills the
predicted-acceptance grid from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from recipe import ConfigError, TrainConfig


@dataclass
class TargetHidden:
    """What the frozen target computed for a batch, as the draft kinds read it."""

    last: torch.Tensor
    """[B, T, H] the post-norm last hidden state (the target's logits are its lm_head of it)."""
    aux: torch.Tensor | None = None
    """[B, T, len(layers) * H] the hidden states at the layers a head reads, concatenated."""
    embeds: torch.Tensor | None = None
    """[B, T, H] the target's embedding of each input token."""


def aux_features(hidden_states, layers: list[int]) -> torch.Tensor:
    """HF output_hidden_states (a tuple of [B, T, H]; index k = the input of decoder layer k)
    -> the given layers concatenated in layer order, [B, T, len(layers) * H]."""
    return torch.cat([hidden_states[i] for i in layers], dim=-1)


@dataclass
class LoadedDraft:
    """A draft ready to measure or serve: what registry.load_draft returns."""

    name: str
    """How reports name it (the spec, and what it is)."""
    kind: DraftKind
    model: Any
    """What the kind's engine_draft reads (an HF model, heads, settings)."""
    max_k: int | None = None
    """The most draft tokens it proposes per step; None: no limit."""
    max_k_unit: str = "draft positions"
    """What max_k counts, for messages (Medusa: 'heads', one token each)."""
    weights: str = "model"
    """The weights it drafts on: 'model' (its own dtype), 'int8' or 'int4'
    (registry.load_draft(..., weights=...), DraftKind.quantise)."""
    compile: bool = False
    """Its engine draft runs compiled steps (registry.load_draft(..., compile=True))."""


class DraftKind(Protocol):
    name: str
    """Short name (the export folder's)."""
    description: str
    """What it is, for reports and the model card ('Medusa heads')."""
    formats: tuple[str, ...]
    """The layouts write_export writes ('vllm': the HF or vLLM-native folder every engine
    starts from; EAGLE-3 also 'speculators'); empty: nothing to export (prompt lookup). Which
    engines serve a kind, and how, each serving engine says (serving/engines/)."""
    hf_assistant: bool
    """transformers' assisted generation can run it (an LM of its own, no target features)."""
    target_layers: bool
    """Its draft reads the target's intermediate layers (EAGLE-3, DFlash): an engine serves it
    only for targets that expose them, and its own layers attend in the standard way whatever
    the target's attention is."""
    target_architecture: bool
    """Its draft is a model of the target's own architecture (independent, PARD)."""
    one_layer_draft: str | None
    """The train.draft of its one-layer draft, for messages; None: it has no layer count."""
    config_fields_ours: tuple[str, ...] = ()
    """Fields of its config.json that only draftsmith reads (the vLLM export's check that vLLM
    reads every field skips them)."""
    quantised_weights: bool
    """Its engine draft can run its matrix products on int8 or int4 weights
    (decoding/quantise.py: a cheaper step; verification reads the quantised draft's own
    probabilities, so decoding stays lossless and only acceptance may move): see quantise."""
    compiled_steps: bool
    """Its engine draft can run its steps compiled (torch.compile: eval.draft_compile), the
    same arithmetic in fewer, fused kernels."""
    train_keys: tuple[str, ...]
    """The train keys only some kinds read that this kind reads (position_decay, block_size, ...):
    any other such key set away from its default is refused (registry.check_train_config);
    check_train checks the values of these."""

    def claims(self, spec: str) -> bool:
        """Whether a train.draft / eval.draft spec that is not a saved folder names this kind."""

    def reads_folder(self, config: dict) -> bool:
        """Whether a saved folder, by its config.json, holds this kind."""

    def check_train(self, cfg: TrainConfig) -> None:
        """Refuse train settings this kind cannot honour, and values of its train_keys out of
        range (a ConfigError that names the fix)."""

    def check_target(self, cfg: TrainConfig, k: int, target_config: dict) -> None:
        """Refuse settings the target cannot honour, from its config.json alone (no weights):
        layer ids beyond its depth, token ids beyond its vocabulary, k = eval.k draft tokens
        beyond what this kind drafts per step."""

    def parameters(self, cfg: TrainConfig, target_config: dict) -> tuple[int, int]:
        """(trainable, frozen) parameters the draft holds for a target of this config.json, by
        its shapes alone."""

    def attention_layers(self, spec: str, target_config: dict) -> list[str]:
        """The attention type of each decoder layer of the draft train.draft=spec, read without
        weights ('full_attention', 'sliding_attention', ...); [] where unknown (a named draft
        not on disk) or none (Medusa heads)."""

    def training_shape(self, cfg: TrainConfig, target_config: dict) -> TrainingShape:
        """What training this draft for a target of this config.json holds and computes, by
        shapes alone (what `distill.py --plan` sizes memory, disk and time with)."""

    def build(self, cfg: TrainConfig, target, tokenizer, examples: list, log) -> nn.Module:
        """The initial trainable fp32 draft on the target's device (the loop seeds the RNG).
        examples: the training conversations (train.data.Example)."""

    def freeze(self, draft: nn.Module, cfg: TrainConfig) -> None:
        """Freeze what train.freeze_embeddings asks (None: the kind's default)."""

    def wrap(self, draft: nn.Module, cfg: TrainConfig) -> TrainableDraft:
        """The module the loop trains (see TrainableDraft)."""

    def load(self, spec: str, target, tokenizer, dtype: torch.dtype,
             device: torch.device) -> LoadedDraft:
        """A saved folder, hub id or spec -> a draft checked against the target."""

    def quantise(self, loaded: LoadedDraft, weights: str) -> LoadedDraft:
        """The loaded draft on weights 'int8' or 'int4', quantised once (kinds with
        quantised_weights only)."""

    def engine_draft(self, loaded: LoadedDraft, name: str):
        """A fresh decoding.engine.Draft for one engine run."""

    def check_export(self, draft_folder: Path, k: int, target_shape: tuple[int, int]) -> None:
        """Refuse a trained folder that does not fit the target's (hidden size, vocabulary) or
        k, before anything is written."""

    def write_export(self, draft_folder: Path, out: Path, k: int, fmt: str,
                     verifier: str) -> None:
        """Write what the serving engine loads into out (which already holds a copy of the
        trained folder); verifier: the target's hub id or path."""

    def export_name(self, fmt: str) -> str:
        """The export folder's name for format fmt ('vllm', or a kind's own)."""

    def check_exported(self, folder: Path) -> None:
        """Refuse an exported folder that a serving engine would misread, before it serves it."""


@dataclass(frozen=True)
class TrainingShape:
    """A kind's training, by its shapes: the planner's only source of what a kind costs."""

    trainable: int
    frozen: int
    """Parameters (DraftKind.parameters)."""
    draft_vocabulary: int
    """Vd: the tokens the draft's head scores (train.draft_vocab_size; null: all V)."""
    scored_rows: int
    """Draft logit rows [M, Vd] one micro-batch (train.micro_batch_size x max_seq_len tokens)
    scores at most."""
    draft_passes: int = 1
    """Forwards of the draft per training token (EAGLE-3: its training-time-test steps)."""
    feature_bytes: int = 0
    """Per token, what the target's offline features hold (train.target_features=offline);
    0: the kind reads no features of the target."""


def micro_batch_tokens(cfg: TrainConfig) -> int:
    """Tokens of one full micro-batch: every one a loss row of an autoregressive draft."""
    return cfg.micro_batch_size * cfg.max_seq_len


def block_rows(cfg: TrainConfig) -> int:
    """Loss rows of one micro-batch of a block drafter: block_starts blocks per conversation
    (0: a block at every token), block_size positions each."""
    starts = min(cfg.block_starts or cfg.max_seq_len, cfg.max_seq_len)
    return cfg.micro_batch_size * starts * cfg.block_size


def feature_bytes(hidden: int, aux_layers: int, feature_dtype: str) -> int:
    """Offline features per token: the aux layers [aux_layers x H] and the post-norm last hidden
    state [H], in train.feature_dtype (bfloat16 or float16: 2 bytes)."""
    return (aux_layers + 1) * hidden * {"bfloat16": 2, "float16": 2}[feature_dtype]


class TrainableDraft(Protocol):
    """What `DraftKind.wrap` returns: an nn.Module with these members."""

    lm: nn.Module
    """The trained module (an HF model, heads): saved with save_pretrained."""
    needs_target_hidden: bool
    """Its forward reads the target's hidden states of the batch."""
    aux_layers: list[int] | None
    """The target layers it reads besides the last (HF output_hidden_states indices)."""

    def loss_rows(self, pred_mask: torch.Tensor) -> list[LossRows]: ...

    def forward(self, input_ids, attention_mask, pred_mask,
                target_hidden: TargetHidden | None = None) -> torch.Tensor:
        """-> draft logits [M, Vd], the LossRows' rows in order."""

    target_rows: torch.Tensor | None
    """[Vd] the target ids its loss scores (its draft vocabulary); None: all V. Training
    computes the target's logits on these rows alone."""

    def restrict(self, target_logits, labels):
        """Target logits [N, V] (or [N, Vd], already on target_rows) and labels [N] -> what the
        draft's [M, Vd] rows are scored against."""

    def expand(self, draft_logits):
        """Draft logits [M, Vd] -> [M, V] over the target's vocabulary (for acceptance)."""


class SameVocabulary:
    """Drafts that predict over the target's own vocabulary: nothing to map."""

    target_rows = None

    def restrict(self, target_logits, labels):
        return target_logits, labels

    def expand(self, draft_logits):
        return draft_logits


@dataclass
class LossRows:
    """A run of draft logits scored against some of the batch's N loss positions."""

    count: int
    """Rows of the draft's output [M, V] that belong to these LossRows (consecutive, in order)."""
    rows: torch.Tensor | None
    """[count] indices into the N loss positions (row-major over pred_mask): the target's
    distribution and the label each row is scored against. None: all N, in order."""
    starts: torch.Tensor | None
    """[count, 2] (row b, position s) of the chain start each row serves: the position whose
    hidden state the draft read. None: an autoregressive draft, which serves every position."""
    position: int | None
    """Draft position j (1-based) in a chain of k; None: every position."""
    weight: float = 1.0

    def pick(self, per_loss_position: torch.Tensor | None) -> torch.Tensor | None:
        """The rows of a tensor over the N loss positions ([N, ...]: target logits, labels)
        that these draft rows are scored against -> [count, ...]."""
        if per_loss_position is None or self.rows is None:
            return per_loss_position
        return per_loss_position[self.rows]


def chain_loss_rows(pred_mask: torch.Tensor, positions: int, decay: float) -> list[LossRows]:
    """Draft position j (1-based) read at the target's hidden state h_s predicts x_{s+1+j}: it
    is scored against the target's distribution at s + j, which must be a loss position (Medusa
    head j, EAGLE-3 training-time-test step j-1). pred_mask [B, T] -> one LossRows per position,
    weighted decay**(j-1)."""
    loss_positions = pred_mask.nonzero()  # [N, 2] (b, t), row-major like boolean indexing
    runs = []
    for j in range(1, positions + 1):
        keep = loss_positions[:, 1] >= j  # the start s = t - j must exist
        rows = keep.nonzero()[:, 0]  # [n_j]
        starts = loss_positions[rows] - torch.tensor([0, j], device=pred_mask.device)  # [n_j, 2]
        runs.append(LossRows(len(rows), rows, starts, j, decay ** (j - 1)))
    return runs



def check_position_decay(cfg: TrainConfig) -> None:
    """train.position_decay, for the kinds whose draft positions have losses of their own."""
    if not 0.0 < cfg.position_decay <= 1.0:
        raise ConfigError(f"train.position_decay={cfg.position_decay} must be in (0, 1].")


def check_blocks(cfg: TrainConfig, learner: str) -> None:
    """train.block_size, block_starts, mask_token_id and position_decay, for the kinds that fill
    mask blocks (learner: what learns the block's positions, for the message)."""
    if cfg.block_size < 1 or cfg.block_starts < 0:
        raise ConfigError(f"train.block_size={cfg.block_size} must be >= 1 and "
                          f"train.block_starts={cfg.block_starts} >= 0 (0: every start).")
    if cfg.mask_token_id is not None and cfg.mask_token_id < 0:
        raise ConfigError(f"train.mask_token_id={cfg.mask_token_id} must be a token id (>= 0) "
                          "or null.")
    check_position_decay(cfg)
    if cfg.eval_k > cfg.block_size:
        raise ConfigError(f"train.eval_k={cfg.eval_k} exceeds train.block_size={cfg.block_size}, "
                          f"the draft positions {learner} learns: lower eval_k or raise "
                          "block_size.")


def check_feature_noise(cfg: TrainConfig) -> None:
    """train.feature_noise, for the kinds that read the target's aux features."""
    if cfg.feature_noise < 0:
        raise ConfigError(f"train.feature_noise={cfg.feature_noise} must be >= 0 (0: off).")
