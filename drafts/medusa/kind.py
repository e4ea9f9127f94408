"""Medusa heads (Cai et al. 2024): K small heads on the target's post-norm last hidden state.

Head j (1-based) reads h_t, the target's hidden state at the position whose own next token the
target just chose (x_{t+1}), and predicts x_{t+1+j}. Each head is L residual blocks x + SiLU(W x)
followed by an lm_head over the target's vocabulary. No draft KV cache: a chain of k <= K draft
tokens costs the heads once per step.

Trained on the target's features at every loss position (head j scored as draft position j of
the chain that starts there, weighted train.position_decay**(j-1)). Saved in vLLM's layout (`model_type: medusa`, `MedusaModel`, `blocks.{h}.layers.{l}.weight`,
`lm_heads.{h}.weight`), so the trained folder is what `--speculative-config '{"method":
"medusa", ...}'` loads.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from decoding.speculative import draw, sampling_probs
from drafts.folders import load_folder, save_folder
from drafts.kind import (
    LoadedDraft,
    LossRows,
    SameVocabulary,
    TargetHidden,
    TrainingShape,
    chain_loss_rows,
    check_position_decay,
    micro_batch_tokens,
)
from recipe import ConfigError, TrainConfig


class ResidualBlock(nn.Module):
    """L layers of x + SiLU(W x); W starts at zero, so an untrained block is the identity."""

    def __init__(self, hidden_size: int, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=False)
                                    for _ in range(num_layers))
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + self.act(layer(x))
        return x


class MedusaHeads(nn.Module):
    """num_heads heads over hidden states [N, H] -> logits [num_heads, N, V]."""

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int = 1):
        super().__init__()
        if num_heads < 1 or num_layers < 0:
            raise ConfigError(f"Medusa needs >= 1 head and >= 0 layers per head, got "
                              f"{num_heads} heads x {num_layers} layers.")
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers = num_heads, num_layers
        self.blocks = nn.ModuleList(ResidualBlock(hidden_size, num_layers)
                                    for _ in range(num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(hidden_size, vocab_size, bias=False)
                                      for _ in range(num_heads))

    @classmethod
    def from_target(cls, target, num_heads: int, num_layers: int = 1) -> MedusaHeads:
        """Blocks at the identity (W = 0) and every lm_head a copy of the target's head, so each
        head starts out predicting the target's next token (Medusa's initialisation)."""
        head = target.get_output_embeddings().weight  # [V, H]
        if getattr(target.get_output_embeddings(), "bias", None) is not None:
            raise ConfigError("the target's output head has a bias, which Medusa's lm_heads (and "
                              "vLLM's loader) do not hold: Medusa cannot start from this head.")
        heads = cls(head.shape[1], head.shape[0], num_heads, num_layers)
        with torch.no_grad():
            for block in heads.blocks:
                for layer in block.layers:
                    layer.weight.zero_()
            for lm_head in heads.lm_heads:
                lm_head.weight.copy_(head.float())
        return heads.to(head.device)

    @property
    def shared_lm_head(self) -> bool:
        """One lm_head for every head (vLLM's `original_lm_head`)."""
        return len(self.lm_heads) == 1 < self.num_heads

    def share_identical_lm_heads(self) -> bool:
        """Keep one lm_head when all are bit-identical (heads trained with the target's head
        frozen): the k heads' logits are then one [k, H] x [H, V] product instead of k
        matrix-vector products, which read the 49k x H matrix k times. Exact."""
        first = self.lm_heads[0].weight
        if len(self.lm_heads) > 1 and all(torch.equal(first, h.weight) for h in self.lm_heads):
            self.lm_heads = nn.ModuleList([self.lm_heads[0]])
        return self.shared_lm_head

    def forward(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """hidden [N, H] -> logits [n, N, V] of the first n = num_heads (default all) heads."""
        n = self.num_heads if num_heads is None else num_heads
        if self.shared_lm_head:
            return self.lm_heads[0](torch.stack([self.blocks[j](hidden) for j in range(n)]))
        return torch.stack([self.lm_heads[j](self.blocks[j](hidden)) for j in range(n)])

    def head_logits(self, j: int, hidden: torch.Tensor) -> torch.Tensor:
        """Head j (0-based, predicting j+2 tokens past h's position): [N, H] -> [N, V]."""
        return self.lm_heads[0 if self.shared_lm_head else j](self.blocks[j](hidden))

    def config_dict(self) -> dict:
        # vLLM's MedusaConfig renames every key holding 'num' and 'heads'/'layers' to num_heads /
        # num_hidden_layers, so no other such key may appear here
        return {"model_type": "medusa", "architectures": ["MedusaModel"],
                "hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
                "num_heads": self.num_heads, "num_hidden_layers": self.num_layers,
                "medusa_fc_bias": False, "truncated_vocab_size": self.vocab_size,
                "original_lm_head": self.shared_lm_head}

    def save_pretrained(self, folder: Path, state_dict: dict | None = None) -> None:
        save_folder(folder, self.state_dict() if state_dict is None else state_dict,
                    self.config_dict())

    @classmethod
    def from_pretrained(cls, folder: str | Path, dtype=torch.float32,
                        device: torch.device | str = "cpu") -> MedusaHeads:
        def build(config: dict, state: dict) -> MedusaHeads:
            if config.get("model_type") != "medusa":
                raise ConfigError(f"{folder} is not a Medusa folder (model_type "
                                  f"{config.get('model_type')!r}).")
            heads = cls(config["hidden_size"], config["vocab_size"], config["num_heads"],
                        config["num_hidden_layers"])
            if config.get("original_lm_head"):  # one lm_head, stored as lm_heads.0
                heads.lm_heads = nn.ModuleList([heads.lm_heads[0]])
            return heads

        heads = load_folder(folder, build, "its config.json", dtype, device)
        heads.share_identical_lm_heads()
        return heads


def check_fits_target(heads: MedusaHeads, target) -> None:
    """Refuse heads made for another hidden size or vocabulary than the target's."""
    weight = target.get_output_embeddings().weight  # [V, H]
    if (heads.vocab_size, heads.hidden_size) != tuple(weight.shape):
        raise ConfigError(f"the Medusa heads read hidden size {heads.hidden_size} and predict "
                          f"{heads.vocab_size} tokens, but the target has hidden size "
                          f"{weight.shape[1]} and {weight.shape[0]} tokens: heads only work on "
                          "the target they were trained on.")


class MedusaDraft:
    """The engine's draft: the heads on the target's last hidden state propose a chain of k."""

    uses_target_hidden = True
    scores, failures, propose_tree = None, None, None  # scores: set by propose

    def __init__(self, heads: MedusaHeads, name: str = "medusa"):
        self.heads, self.name = heads, name

    def start(self, input_ids, attention_mask, first_token, target_hidden=None):
        self.hidden = target_hidden[-1][:, -1]  # [B, H] the prompt's last position (left-padded)

    def propose(self, k, sampling, history, generator=None):
        if k > self.heads.num_heads:
            raise ValueError(f"k={k} draft tokens need {k} Medusa heads, but these heads have "
                             f"{self.heads.num_heads}: set k <= {self.heads.num_heads} or train "
                             "more heads.")
        dtype = self.heads.lm_heads[0].weight.dtype
        logits = self.heads(self.hidden.to(dtype), k).transpose(0, 1)  # [B, k, V]
        probs = sampling_probs(logits, sampling.temperature, sampling.top_p, sampling.top_k)
        tokens = draw(probs, sampling.temperature, generator)  # [B, k]
        self.scores = logits  # [B, k, V]
        return tokens, probs

    def accept(self, num_accepted, next_token, target_hidden=None, path=None):
        rows = torch.arange(num_accepted.shape[0], device=num_accepted.device)
        # chunk = [pending, d_1..d_k]; position n (the last accepted) produced next_token
        self.hidden = target_hidden[-1][rows, num_accepted]  # [B, H]


class MedusaForTraining(SameVocabulary, nn.Module):
    """Medusa heads on the frozen target's post-norm last hidden state [B, T, H]: for each head
    its logits at the starts chain_loss_rows gives, concatenated -> [M, V]."""

    needs_target_hidden = True
    aux_layers = None

    def __init__(self, heads: MedusaHeads, decay: float):
        super().__init__()
        self.lm, self.decay = heads, decay  # `lm`: the trained module, as for every kind

    def loss_rows(self, pred_mask: torch.Tensor) -> list[LossRows]:
        return chain_loss_rows(pred_mask, self.lm.num_heads, self.decay)

    def forward(self, input_ids, attention_mask, pred_mask,
                target_hidden: TargetHidden | None = None):
        dtype = self.lm.lm_heads[0].weight.dtype
        logits = [self.lm.head_logits(run.position - 1,
                                      target_hidden.last[run.starts[:, 0],
                                                         run.starts[:, 1]].to(dtype))
                  for run in self.loss_rows(pred_mask)]
        return torch.cat(logits)  # [M, V]


class Medusa:
    """train.draft='medusa:<heads>[x<layers>]'; a folder with model_type 'medusa'."""

    name, description, formats = "medusa", "Medusa heads", ("vllm",)
    train_keys = ("position_decay", "position_weights", "dpace_smoothing")
    target_layers, target_architecture = False, False
    one_layer_draft = None
    hf_assistant, quantised_weights = False, False
    compiled_steps = False

    def claims(self, spec: str) -> bool:
        return spec.partition(":")[0] == "medusa"

    def reads_folder(self, config: dict) -> bool:
        return config.get("model_type") == "medusa"

    @staticmethod
    def shape(spec: str) -> tuple[int, int]:
        """'medusa:<heads>[x<layers>]' -> (heads, layers)."""
        heads, _, layers = spec.partition(":")[2].partition("x")
        if not heads.isdigit() or int(heads) < 1 or (layers and not layers.isdigit()):
            raise ConfigError(f"train.draft={spec!r}: expected 'medusa:<heads>' or "
                              "'medusa:<heads>x<layers>' with heads >= 1, e.g. 'medusa:4x1'.")
        return int(heads), int(layers) if layers else 1

    def check_train(self, cfg: TrainConfig) -> None:
        heads, _ = self.shape(cfg.draft)
        check_position_decay(cfg)
        if cfg.on_policy_fraction > 0:
            raise ConfigError("Medusa heads cannot sample on their own (they need the "
                              "target's hidden states): set train.on_policy_fraction=0.")
        if cfg.lora_rank:
            raise ConfigError("LoRA applies to a draft LM's attention and MLP; Medusa heads "
                              "are small enough to train whole: set train.lora_rank=0.")
        if cfg.eval_k > heads:
            raise ConfigError(f"train.eval_k={cfg.eval_k} draft tokens need as many Medusa "
                              f"heads, but train.draft={cfg.draft!r} has {heads}: lower "
                              "train.eval_k or add heads.")

    def check_target(self, cfg: TrainConfig, k: int, target_config: dict) -> None:
        heads, _ = self.shape(cfg.draft)
        if k > heads:
            raise ConfigError(f"eval.k={k} draft tokens need as many Medusa heads, but "
                              f"train.draft={cfg.draft!r} has {heads}: lower eval.k or add "
                              "heads.")

    def parameters(self, cfg: TrainConfig, target_config: dict) -> tuple[int, int]:
        heads, layers = self.shape(cfg.draft)
        h, v = target_config["hidden_size"], target_config["vocab_size"]
        blocks = heads * layers * h * h  # each head's residual blocks, then its own lm_head
        return (blocks, heads * v * h) if cfg.freeze_embeddings else (blocks + heads * v * h, 0)

    def attention_layers(self, spec: str, target_config: dict) -> list[str]:
        return []  # residual blocks, no attention

    def training_shape(self, cfg: TrainConfig, target_config: dict) -> TrainingShape:
        heads, _ = self.shape(cfg.draft)
        return TrainingShape(*self.parameters(cfg, target_config), target_config["vocab_size"],
                             micro_batch_tokens(cfg) * heads)

    def build(self, cfg: TrainConfig, target, tokenizer, examples, log) -> MedusaHeads:
        heads = MedusaHeads.from_target(target, *self.shape(cfg.draft)).float()
        return heads.requires_grad_(True).train()

    def freeze(self, draft: MedusaHeads, cfg: TrainConfig) -> None:
        if cfg.freeze_embeddings:  # default: the heads train their lm_heads
            draft.lm_heads.requires_grad_(False)

    def wrap(self, draft: MedusaHeads, cfg: TrainConfig) -> MedusaForTraining:
        return MedusaForTraining(draft, cfg.position_decay)

    def load(self, spec, target, tokenizer, dtype, device) -> LoadedDraft:
        heads = MedusaHeads.from_pretrained(spec, dtype, device)
        check_fits_target(heads, target)
        return LoadedDraft(f"{spec} (Medusa, {heads.num_heads} heads)", self, heads,
                           max_k=heads.num_heads, max_k_unit="heads")

    def engine_draft(self, loaded: LoadedDraft, name: str) -> MedusaDraft:
        return MedusaDraft(loaded.model, name)

    def check_export(self, draft_folder, k, target_shape) -> None:
        heads = MedusaHeads.from_pretrained(draft_folder)
        if k > heads.num_heads:
            raise ConfigError(f"--k {k} draft tokens need {k} Medusa heads, but {draft_folder} "
                              f"has {heads.num_heads}; vLLM would build the missing heads with "
                              f"uninitialised weights. Export with --k <= {heads.num_heads}.")
        if (heads.hidden_size, heads.vocab_size) != target_shape:
            raise ConfigError(f"the Medusa heads read hidden size {heads.hidden_size} and "
                              f"predict {heads.vocab_size} tokens; the target has "
                              f"{target_shape[0]} and {target_shape[1]}: export them with the "
                              "target they were trained on (model.target).")

    def write_export(self, draft_folder, out, k, fmt, verifier) -> None:
        # heads trained with the target's head frozen share it: written once, as vLLM's
        # original_lm_head, so the folder is k-1 lm_heads smaller and loads the same heads
        MedusaHeads.from_pretrained(draft_folder).save_pretrained(out)

    def export_name(self, fmt: str) -> str:
        return "medusa"

    def check_exported(self, folder) -> None:
        pass
