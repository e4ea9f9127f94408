"""Medusa heads (Cai et al. 2024): K small heads on the target's post-norm last hidden state.

Head j (1-based) reads h_t, the target's hidden state at the position whose own next token the
target just chose (x_{t+1}), and predicts x_{t+1+j}. Each head is L residual blocks x + SiLU(W x)
followed by an lm_head over the target's vocabulary. No draft KV cache: a chain of k <= K draft
tokens costs the heads once per step.

Saved in vLLM's layout (`model_type: medusa`, `MedusaModel`, `blocks.{h}.layers.{l}.weight`,
`lm_heads.{h}.weight`), so the trained folder is what `--speculative-config '{"method":
"medusa", ...}'` loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from recipe import ConfigError
from serving.folders import CONFIG_NAME, WEIGHTS_NAME, save_folder
from serving.speculative import sampling_probs


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
        from safetensors.torch import load_file

        folder = Path(folder)
        config = json.loads((folder / CONFIG_NAME).read_text())
        if config.get("model_type") != "medusa":
            raise ConfigError(f"{folder} is not a Medusa folder (model_type "
                              f"{config.get('model_type')!r}).")
        heads = cls(config["hidden_size"], config["vocab_size"], config["num_heads"],
                    config["num_hidden_layers"])
        if config.get("original_lm_head"):  # one lm_head, stored as lm_heads.0
            heads.lm_heads = nn.ModuleList([heads.lm_heads[0]])
        state = load_file(str(folder / WEIGHTS_NAME))
        missing, unexpected = heads.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ConfigError(f"{folder / WEIGHTS_NAME} does not match its config.json: missing "
                              f"{missing[:4]}, unexpected {unexpected[:4]}.")
        heads.share_identical_lm_heads()
        return heads.to(device=device, dtype=dtype).eval()


def is_medusa_folder(spec: str) -> bool:
    config = Path(spec).expanduser() / CONFIG_NAME
    return config.is_file() and json.loads(config.read_text()).get("model_type") == "medusa"


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

    def __init__(self, heads: MedusaHeads, name: str = "medusa"):
        self.heads, self.name = heads, name

    def start(self, input_ids, attention_mask, first_token, target_hidden=None):
        self.hidden = target_hidden[-1][:, -1]  # [B, H] the prompt's last position (left-padded)

    def propose(self, k, sampling, history):
        if k > self.heads.num_heads:
            raise ValueError(f"k={k} draft tokens need {k} Medusa heads, but these heads have "
                             f"{self.heads.num_heads}: set k <= {self.heads.num_heads} or train "
                             "more heads.")
        dtype = self.heads.lm_heads[0].weight.dtype
        logits = self.heads(self.hidden.to(dtype), k).transpose(0, 1)  # [B, k, V]
        probs = sampling_probs(logits, sampling.temperature, sampling.top_p, sampling.top_k)
        tokens = torch.multinomial(probs.flatten(0, 1), 1).view(probs.shape[:2])  # [B, k]
        return tokens, probs

    def accept(self, num_accepted, next_token, target_hidden=None):
        rows = torch.arange(num_accepted.shape[0], device=num_accepted.device)
        # chunk = [pending, d_1..d_k]; slot n (the last accepted) produced next_token
        self.hidden = target_hidden[-1][rows, num_accepted]  # [B, H]
