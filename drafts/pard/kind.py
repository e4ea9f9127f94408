"""PARD (parallel draft model): an independent draft LM that proposes k tokens in ONE forward.

After the context [.. x_p] come k-1 copies of a mask token at positions p+1..p+k-1; the LM's
output at x_p predicts x_{p+1} as usual and its output at mask m predicts x_{p+1+m}. Attention
stays causal, so an ordinary causal LM serves it: vLLM's `draft_model` method with
`parallel_drafting: true` reads the mask token from the draft's config.json (`pard_token`).

train.draft='pard:<independent spec>' ('pard:layer-truncated:6', or a trained independent draft
folder): the independent draft, trained on its ordinary next-token positions (draft position 1
at every loss position) plus blocks of masks after train.block_starts starts per conversation
(drafts.parallel.pard_layout: one forward, a 4D attention mask keeps each block to its own
prefix). Target-independent within a tokenizer family, as the independent draft is.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from decoding.kv import CachedLM
from decoding.quantise import quantised_copy
from decoding.speculative import draw, sampling_probs
from drafts.folders import read_config
from drafts.independent import (
    Independent,
    LMHead,
    compiled_lm,
    draft_vocabulary,
    pretrained_draft,
    right_aligned,
)
from drafts.kind import (
    LoadedDraft,
    LossRows,
    TargetHidden,
    TrainingShape,
    block_rows,
    chain_loss_rows,
    check_blocks,
)
from drafts.parallel import block_plan, check_mask_token, pard_layout, resolve_mask_token
from drafts.slot_lm import check_slot_lm
from recipe import ConfigError, TrainConfig

PREFIX = "pard:"


class PardForTraining(LMHead, nn.Module):
    """Draft position 1 at every loss position (the LM's own next-token output), positions
    2..k at the masks of each planned block; position j weighs decay**(j-1)."""

    needs_target_hidden = False
    aux_layers = None

    def __init__(self, lm: nn.Module, k: int, decay: float, starts_per_row: int, mask_id: int):
        super().__init__()
        self.lm, self.k, self.decay = lm, k, decay
        self.starts_per_row, self.mask_id = starts_per_row, mask_id
        self._no_split_modules = getattr(lm, "_no_split_modules", None)
        self.vocabulary = draft_vocabulary(lm)

    def plan(self, pred_mask):
        return block_plan(pred_mask, self.k, self.starts_per_row)

    def loss_rows(self, pred_mask: torch.Tensor) -> list[LossRows]:
        return chain_loss_rows(pred_mask, 1, 1.0) + self.plan(pred_mask).loss_rows(
            pred_mask, self.decay, first=2)

    def forward(self, input_ids, attention_mask, pred_mask,
                target_hidden: TargetHidden | None = None):
        plan, length = self.plan(pred_mask), input_ids.shape[1]
        ids, positions, mask = pard_layout(input_ids, attention_mask, plan, self.k, self.mask_id)
        hidden = self.lm.get_decoder()(input_ids=ids, attention_mask=mask,
                                       position_ids=positions).last_hidden_state
        first = pred_mask.clone()
        first[:, 0] = False  # position 1 of start t-1 needs t >= 1 (chain_loss_rows' rows)
        rows = [hidden[:, :length][first]]  # [n_1, H]
        if self.k > 1:
            masks = hidden[:, length:].view(*plan.starts.shape, self.k - 1, -1)  # [B, S, k-1, H]
            rows += [masks[:, :, j - 2][plan.scored[j - 1]] for j in range(2, self.k + 1)]
        return self.head(torch.cat(rows))  # [M, V or Vd]


class ParallelModelDraft:
    """The engine's draft: one forward over [the tokens verified since the last step, mask x
    (k-1)] proposes k tokens; the masks are dropped from its KV cache right after."""

    uses_target_hidden = False
    failures, propose_tree = None, None

    def __init__(self, model, mask_id: int, name: str = "pard", compile: bool = False):
        self.model, self.mask_id, self.name, self.compile = model, mask_id, name, compile
        if compile:
            check_slot_lm(model)  # refused before any generation
        self.vocabulary = draft_vocabulary(model)  # its head scores these alone, if any
        self.draft_logits = None  # [B, k, V or Vd] behind the last proposal

    @property
    def scores(self) -> torch.Tensor | None:
        """[B, k, V] the logits behind the last proposal (trees rank alternatives with them)."""
        if self.draft_logits is None or self.vocabulary is None:
            return self.draft_logits
        return self.vocabulary.logits(self.draft_logits)

    def start(self, input_ids, attention_mask, first_token, target_hidden=None):
        ids = None if self.vocabulary is None else self.vocabulary.ids
        # compiled: drafts/slot_lm.py, its extension (pending tokens and masks) one compiled call
        self.lm = compiled_lm(self.model, ids, "the PARD draft's") if self.compile \
            else CachedLM(self.model, vocabulary=ids)
        self.lm.prefill(input_ids, attention_mask)
        self.pending = first_token[:, None]  # [B, w]: fed before the masks
        self.pending_valid = torch.ones_like(self.pending, dtype=torch.bool)

    def propose(self, k, sampling, history, generator=None):
        batch = self.pending.shape[0]
        masks = self.pending.new_full((batch, k - 1), self.mask_id)
        logits = self.lm.extend(torch.cat([self.pending, masks], 1), torch.cat(
            [self.pending_valid, torch.ones_like(masks, dtype=torch.bool)], 1))[:, -k:]
        self.lm.reject_last(torch.full((batch,), k - 1, device=masks.device))
        q = sampling_probs(logits, sampling.temperature, sampling.top_p, sampling.top_k)
        self.tokens = draw(q, sampling.temperature, generator)  # [B, k]
        self.draft_logits = logits  # [B, k, V or Vd]
        if self.vocabulary is not None:  # draft ids -> target ids, q zero outside
            self.tokens, q = self.vocabulary.ids[self.tokens], self.vocabulary.probs(q)
        return self.tokens, q  # [B, k], [B, k, V]

    def accept(self, num_accepted, next_token, target_hidden=None, path=None):
        """Next step feeds the accepted d_1..d_n (a tree's path) and next_token (the rejected
        ones as holes)."""
        k = self.tokens.shape[1]
        accepted = self.tokens if path is None else path  # [B, k]
        index = torch.arange(k + 1, device=next_token.device)[None]
        self.pending, self.pending_valid = right_aligned(
            torch.cat([accepted, next_token[:, None]], 1),  # [B, k+1]
            (index < num_accepted[:, None]) | (index == k))


class Pard:
    """An independent draft LM trained to fill k-1 mask tokens after its context."""

    name, description = "pard", "a PARD parallel draft model"
    train_keys = ("position_decay", "position_weights", "dpace_smoothing", "block_size",
                  "block_starts", "mask_token_id", "draft_vocab_size")
    target_layers, target_architecture = False, True
    one_layer_draft = 'pard:layer-truncated:1'
    formats = ("vllm",)
    config_fields_ours = ("pard_trained_k",)
    """Read by us, not by vLLM: the parallel positions trained (our export refuses a larger k;
    vLLM takes k from the speculative config)."""
    hf_assistant = False  # transformers would run it one token at a time, without its masks
    quantised_weights = True
    compiled_steps = True

    def claims(self, spec: str) -> bool:
        return spec.startswith(PREFIX)

    def reads_folder(self, config: dict) -> bool:
        return "pard_token" in config

    def _inner(self, cfg: TrainConfig) -> TrainConfig:
        return dataclasses.replace(cfg, draft=cfg.draft.removeprefix(PREFIX))

    def check_train(self, cfg: TrainConfig) -> None:
        inner = cfg.draft.removeprefix(PREFIX)
        if not inner:
            raise ConfigError("train.draft='pard:' names no draft: write 'pard:layer-truncated:6' "
                              "or 'pard:<a trained independent draft folder>'.")
        Independent().check_train(self._inner(cfg))
        check_blocks(cfg, "PARD")

    def check_target(self, cfg: TrainConfig, k: int, target_config: dict) -> None:
        Independent().check_target(self._inner(cfg), k, target_config)
        if cfg.mask_token_id is not None:
            check_mask_token(cfg.mask_token_id, target_config["vocab_size"])
        if k > cfg.block_size:
            raise ConfigError(f"eval.k={k}: the PARD draft proposes train.block_size="
                              f"{cfg.block_size} tokens per forward; set eval.k <= "
                              f"{cfg.block_size} or train a larger block.")

    def parameters(self, cfg: TrainConfig, target_config: dict) -> tuple[int, int]:
        return Independent().parameters(self._inner(cfg), target_config)

    def attention_layers(self, spec: str, target_config: dict) -> list[str]:
        return Independent().attention_layers(spec.removeprefix(PREFIX), target_config)

    def training_shape(self, cfg: TrainConfig, target_config: dict) -> TrainingShape:
        return TrainingShape(*self.parameters(cfg, target_config),
                             cfg.draft_vocab_size or target_config["vocab_size"], block_rows(cfg))

    def build(self, cfg: TrainConfig, target, tokenizer, examples, log):
        draft = Independent().build(self._inner(cfg), target, tokenizer, examples, log)
        vocab = target.get_output_embeddings().weight.shape[0]
        mask_id = resolve_mask_token(cfg.mask_token_id, tokenizer, vocab, examples)
        draft.config.pard_token = mask_id
        draft.config.pard_trained_k = cfg.block_size
        log(f"[train] PARD on {cfg.draft.removeprefix(PREFIX)}: k = {cfg.block_size} per forward "
            f"(mask token {mask_id} {tokenizer.convert_ids_to_tokens(mask_id)!r}), "
            f"{'every start' if cfg.block_starts == 0 else f'{cfg.block_starts} starts'} per "
            "conversation")
        return draft

    def freeze(self, draft, cfg: TrainConfig) -> None:
        Independent().freeze(draft, self._inner(cfg))

    def wrap(self, draft, cfg: TrainConfig) -> PardForTraining:
        return PardForTraining(draft, cfg.block_size, cfg.position_decay, cfg.block_starts,
                               draft.config.pard_token)

    def load(self, spec, target, tokenizer, dtype, device) -> LoadedDraft:
        draft = pretrained_draft(spec, target, tokenizer, dtype).eval().to(device)
        draft.requires_grad_(False)
        vocab = target.get_output_embeddings().weight.shape[0]
        check_mask_token(draft.config.pard_token, vocab, f"{spec}: pard_token")
        k = getattr(draft.config, "pard_trained_k", None)
        return LoadedDraft(f"{spec} (PARD, trained for k <= {k})", self, draft, max_k=k,
                           max_k_unit="trained parallel positions")

    def quantise(self, loaded: LoadedDraft, weights: str) -> LoadedDraft:
        return dataclasses.replace(loaded, model=quantised_copy(loaded.model, weights))

    def engine_draft(self, loaded: LoadedDraft, name: str) -> ParallelModelDraft:
        return ParallelModelDraft(loaded.model, loaded.model.config.pard_token, name,
                                  loaded.compile)

    def check_export(self, draft_folder, k, target_shape) -> None:
        Independent().check_export(draft_folder, k, target_shape)
        trained = (read_config(draft_folder) or {}).get("pard_trained_k")
        if trained is not None and k > trained:
            raise ConfigError(f"--k {k}: the draft was trained for {trained} parallel positions; "
                              f"export with --k <= {trained} or train with a larger "
                              "train.block_size.")

    def write_export(self, draft_folder, out, k, fmt, verifier) -> None:
        pass  # the HF folder with pard_token in its config is what vLLM loads

    def export_name(self, fmt: str) -> str:
        return "pard"

    def check_exported(self, folder) -> None:
        config = read_config(folder) or {}
        check_mask_token(int(config.get("pard_token", -1)), config.get("vocab_size", 0),
                         f"{folder}: pard_token")
