"""The recipe: typed configuration shared by every stage."""

from recipe.config import (
    EMBEDDED_TARGET,
    Config,
    ConfigError,
    DataConfig,
    DecodeSettings,
    DSparkConfig,
    Eagle3Config,
    EvalConfig,
    GenerationConfig,
    ModelConfig,
    PublishConfig,
    RunConfig,
    TrackingConfig,
    TrainConfig,
    cache_root,
    load_config,
)

__all__ = [
    "EMBEDDED_TARGET",
    "Config",
    "ConfigError",
    "DSparkConfig",
    "DataConfig",
    "DecodeSettings",
    "Eagle3Config",
    "EvalConfig",
    "GenerationConfig",
    "ModelConfig",
    "PublishConfig",
    "RunConfig",
    "TrackingConfig",
    "TrainConfig",
    "cache_root",
    "load_config",
]
