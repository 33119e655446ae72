"""The typed recipe schema.

A recipe is one YAML file. Every section is a pydantic model that forbids unknown keys, so a
typo ("num_expert") is an error naming the key and the file instead of a silently ignored knob.
The sections live by concept: the model (:mod:`.model`), the rollout (:mod:`.rollout`), the
rest and the recipe itself (:mod:`.sections`).
"""

from megatron_gspo.config.model import MLAConfig, ModelConfig, YarnScaling
from megatron_gspo.config.rollout import (
    DynamicSampling,
    MultiTurnConfig,
    RolloutConfig,
    VLLMConfig,
)
from megatron_gspo.config.sections import (
    DataConfig,
    EvalConfig,
    LossConfig,
    MemoryConfig,
    OffPolicyCorrection,
    OptimizerConfig,
    OverlongPenalty,
    ParallelConfig,
    PrecisionConfig,
    Recipe,
    RewardConfig,
    RewardFunctionConfig,
    RunConfig,
    TrainConfig,
)

__all__ = [
    "DataConfig",
    "DynamicSampling",
    "EvalConfig",
    "LossConfig",
    "MLAConfig",
    "MemoryConfig",
    "ModelConfig",
    "MultiTurnConfig",
    "OffPolicyCorrection",
    "OptimizerConfig",
    "OverlongPenalty",
    "ParallelConfig",
    "PrecisionConfig",
    "Recipe",
    "RewardConfig",
    "RewardFunctionConfig",
    "RolloutConfig",
    "RunConfig",
    "TrainConfig",
    "VLLMConfig",
    "YarnScaling",
]
