"""The DSpark drafter (arXiv 2607.05147): a DFlash block drafter (drafts/dflash/head.py) plus a
Markov head that makes the block semi-autoregressive and a confidence head that estimates each
drafted token's acceptance.

The DFlash backbone proposes base logits for all k positions in one forward. The Markov head
then adds a low-rank bias from the previous token, drawn left to right:

    logits_j = lm_head(h_j) + markov_w2(markov_w1[y_{j-1}])      y_0 = the anchor (pending token)

(markov_w1 [V, r] an embedding, markov_w2 [r -> V] a projection), so position j sees the token
position j-1 actually drew, which the parallel backbone cannot. The confidence head reads the
same step:

    c_j = sigmoid(proj([h_j ; markov_w1[y_{j-1}]]))

the probability that y_j is accepted given y_1..y_{j-1} were, which decides how many drafted
tokens a step verifies (adaptive verification: vLLM's enable_adaptive_verification, llama.cpp's
--spec-draft-p-min for draft-dspark).

Saved in the layout vLLM 0.32's `Qwen3DSparkForCausalLM` and llama.cpp's converter read
(architecture `Qwen3DSparkModel`, `markov_head.markov_w1` / `markov_w2`, `confidence_head.proj`
with a bias, `markov_rank`, `enable_confidence_head`, `confidence_head_with_markov`) with
`sample_from_anchor: false`: the block is DFlash's [anchor, mask x k] and mask j predicts draft
position j, as our DFlash drafter is trained.
"""

from __future__ import annotations

import torch
from torch import nn

from drafts.dflash.head import DFlashForTraining, DFlashHead
from recipe import ConfigError

ARCHITECTURE = "Qwen3DSparkModel"  # vLLM's registry: qwen3_dspark.Qwen3DSparkForCausalLM


class MarkovHead(nn.Module):
    """markov_w1 [V, r] embeds the previous token; markov_w2 [r -> V] maps it to a logit bias."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def forward(self, previous: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """previous token ids [*] -> (embedding [*, r], logit bias [*, V])."""
        embed = self.markov_w1(previous)
        return embed, self.markov_w2(embed)


class ConfidenceHead(nn.Module):
    """proj [H + r -> 1] with a bias: the acceptance logit of a drafted token (fp32 in vLLM)."""

    def __init__(self, hidden: int, rank: int):
        super().__init__()
        self.proj = nn.Linear(hidden + rank, 1, bias=True)

    def forward(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        """hidden [*, H], markov_embed [*, r] -> acceptance logits [*]."""
        x = torch.cat([hidden, markov_embed.to(hidden.dtype)], -1)
        return self.proj(x.to(self.proj.weight.dtype)).squeeze(-1)


class DSparkHead(DFlashHead):
    """DFlashHead + markov_head + confidence_head; markov_rank: r."""

    architecture = ARCHITECTURE
    what = "a DSpark drafter"
    config_keys = DFlashHead.config_keys | {"markov_rank", "markov_head_type",
                                            "enable_confidence_head",
                                            "confidence_head_with_markov", "sample_from_anchor",
                                            "draft_vocab_size"}

    def __init__(self, config, aux_layers: list[int], mask_token_id: int, block_size: int,
                 markov_rank: int = 64):
        super().__init__(config, aux_layers, mask_token_id, block_size)
        if markov_rank < 1:
            raise ConfigError(f"train.dspark.markov_rank={markov_rank} must be >= 1.")
        self.markov_rank = markov_rank
        self.markov_head = MarkovHead(config.vocab_size, markov_rank)
        self.confidence_head = ConfidenceHead(config.hidden_size, markov_rank)

    @classmethod
    def from_target(cls, target, aux_layers, num_layers, mask_token_id, block_size,
                    init="target", **fields) -> DSparkHead:
        """DFlashHead.from_target, then the Markov head's projection and the confidence head at
        zero: the drafter starts as the DFlash drafter it extends (no bias, confidence 0.5),
        and markov_w1 at N(0, 1/r) so the projection's first gradients are not zero."""
        head = super().from_target(target, aux_layers, num_layers, mask_token_id, block_size,
                                   init, **fields)
        with torch.no_grad():
            head.markov_head.markov_w1.weight.normal_(0.0, head.markov_rank ** -0.5)
            head.markov_head.markov_w2.weight.zero_()
            head.confidence_head.proj.weight.zero_()
            head.confidence_head.proj.bias.zero_()
        return head

    @classmethod
    def fields_of(cls, config: dict) -> dict:
        if "markov_rank" not in config:
            raise ConfigError("the DSpark drafter's config.json has no markov_rank.")
        if config.get("markov_head_type", "vanilla") != "vanilla" or config.get(
                "sample_from_anchor", True) is not False:
            raise ConfigError("draftsmith reads DSpark drafters with a vanilla Markov head and "
                              "the DFlash block layout (markov_head_type 'vanilla', "
                              "sample_from_anchor false): this one is another variant.")
        return {"markov_rank": int(config["markov_rank"])}

    def config_dict(self) -> dict:
        config = super().config_dict()
        config.update({"markov_rank": self.markov_rank, "markov_head_type": "vanilla",
                       "enable_confidence_head": True, "confidence_head_with_markov": True,
                       "sample_from_anchor": False})
        return config

    def markov(self, base: torch.Tensor, hidden: torch.Tensor, previous: torch.Tensor):
        """One draft position: base logits [*, V], the backbone's output [*, H] and the previous
        token [*] -> (logits [*, V], confidence logits [*])."""
        embed, bias = self.markov_head(previous)
        return base + bias.to(base.dtype), self.confidence_head(hidden, embed)


class DSparkForTraining(DFlashForTraining):
    """DFlash's blocks, with draft position j's logits biased by the Markov head from the true
    token before it (teacher forcing: x_{s+j}, the anchor for j = 1), as the engine biases them
    from the token it drew there. The confidence head learns, by binary cross-entropy, whether
    the target's greedy token is the draft's at each scored row (auxiliary_loss), weighed by
    confidence_weight; its logits of the last forward are kept for that loss."""

    def __init__(self, head: DSparkHead, decay: float, starts_per_row: int,
                 confidence_weight: float):
        super().__init__(head, decay, starts_per_row)
        self.confidence_weight = confidence_weight
        self.confidence: torch.Tensor | None = None  # [M] logits of the last forward

    def draft_logits(self, out: torch.Tensor, plan, input_ids: torch.Tensor) -> torch.Tensor:
        head, length = self.lm, input_ids.shape[1]
        logits, confidence = [], []
        for j in range(1, head.block_size + 1):
            scored = plan.scored[j - 1]  # [B, S]
            previous = input_ids.gather(1, (plan.starts + j).clamp(max=length - 1))[scored]
            hidden = out[:, :, j][scored]  # [n_j, H]
            row_logits, row_confidence = head.markov(head.lm_head(hidden), hidden, previous)
            logits.append(row_logits)
            confidence.append(row_confidence)
        self.confidence = torch.cat(confidence)  # [M]
        return torch.cat(logits)  # [M, V]

    def auxiliary_loss(self, q_rows: list[torch.Tensor], p_rows: list[torch.Tensor]
                       ) -> torch.Tensor:
        """The draft's logits and the target's, per LossRows run ([n, V] each) -> the summed
        binary cross-entropy of the confidence logits against greedy acceptance, times
        confidence_weight -> []."""
        with torch.no_grad():
            accepted = torch.cat([(q.argmax(-1) == p.argmax(-1)).float()
                                  for q, p in zip(q_rows, p_rows)])  # [M]
        loss = nn.functional.binary_cross_entropy_with_logits(
            self.confidence.float(), accepted, reduction="sum")
        return self.confidence_weight * loss
