"""The DSpark kind: what the rest of draftsmith asks of it (drafts.kind.DraftKind). Everything
but the Markov and confidence heads is the DFlash kind's."""

from __future__ import annotations

from drafts.dflash.kind import DFlash
from drafts.dspark.engine import DSparkDraft
from drafts.dspark.head import DSparkForTraining, DSparkHead
from recipe import ConfigError, TrainConfig


class DSpark(DFlash):
    """A DFlash block drafter whose positions are drawn left to right through a Markov head,
    with a confidence head that decides how many drafted tokens a step verifies."""

    name, description = "dspark", "a DSpark block drafter"
    head_class, engine_class = DSparkHead, DSparkDraft
    train_keys = DFlash.train_keys + ("dspark",)
    one_layer_draft = "dspark:1"
    label = "DSpark"
    unquantised = ("fc", "proj")  # proj: the confidence head's, one output

    def check_train(self, cfg: TrainConfig) -> None:
        super().check_train(cfg)
        if cfg.dspark.markov_rank < 1 or cfg.dspark.confidence_weight < 0:
            raise ConfigError(f"train.dspark.markov_rank={cfg.dspark.markov_rank} must be >= 1 "
                              f"and train.dspark.confidence_weight="
                              f"{cfg.dspark.confidence_weight} >= 0.")

    def parameters(self, cfg: TrainConfig, target_config: dict) -> tuple[int, int]:
        trainable, frozen = super().parameters(cfg, target_config)
        rank, hidden = cfg.dspark.markov_rank, target_config["hidden_size"]
        markov = 2 * target_config["vocab_size"] * rank
        return trainable + markov + hidden + rank + 1, frozen

    def head_fields(self, cfg: TrainConfig) -> dict:
        return {"markov_rank": cfg.dspark.markov_rank}

    def wrap(self, draft: DSparkHead, cfg: TrainConfig) -> DSparkForTraining:
        return DSparkForTraining(draft, cfg.position_decay, cfg.block_starts,
                                 cfg.dspark.confidence_weight)
