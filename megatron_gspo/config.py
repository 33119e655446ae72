"""The typed recipe schema.

A recipe is one YAML file. Every section is a pydantic model that forbids unknown keys, so a
typo ("num_expert") is an error naming the key and the file instead of a silently ignored knob.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Section):
    """A Qwen3-style decoder: GQA, QK-norm, RoPE, RMSNorm, SwiGLU, optional top-k MoE."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    max_seq_length: int = 2048
    # Dense MLP width; unused by layers that are MoE.
    ffn_hidden_size: int | None = None
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_router_topk: int = 2
    moe_aux_loss_coeff: float = 1e-3
    rotary_base: float = 1_000_000.0
    norm_epsilon: float = 1e-6
    init_method_std: float = 0.02
    untie_embeddings_and_output_weights: bool = True
    params_dtype: Literal["float32", "bfloat16"] = "float32"

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    @model_validator(mode="after")
    def _check_shapes(self) -> ModelConfig:
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_query_groups ({self.num_query_groups})"
            )
        if self.is_moe:
            if self.moe_ffn_hidden_size is None:
                raise ValueError("moe_ffn_hidden_size is required when num_experts is set")
            if not 1 <= self.moe_router_topk <= self.num_experts:
                raise ValueError(
                    f"moe_router_topk ({self.moe_router_topk}) must be in [1, num_experts "
                    f"({self.num_experts})]"
                )
        elif self.ffn_hidden_size is None:
            raise ValueError("ffn_hidden_size is required for a dense model (no num_experts)")
        return self


class ParallelConfig(_Section):
    """Megatron-Core's parallel layout. Data parallelism is what the world size leaves over."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    # Megatron requires sequence parallelism for MoE layers under tensor parallelism.
    sequence_parallel: bool = False
    seed: int = 1234

    @property
    def model_parallel_size(self) -> int:
        return (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
        )


class PrecisionConfig(_Section):
    """Mixed precision. Log-probs and the loss are fp32 regardless of these settings."""

    bf16: bool = False
    # Transformer Engine FP8 recipe; needs the `gpu` extra and a GPU with FP8 support.
    fp8: Literal["hybrid", "e4m3"] | None = None


class RolloutConfig(_Section):
    """How responses are sampled: the embedded engine or a vLLM service."""

    engine: Literal["local", "vllm"] = "local"


class Recipe(_Section):
    model: ModelConfig
    parallel: ParallelConfig = ParallelConfig()
    precision: PrecisionConfig = PrecisionConfig()
    rollout: RolloutConfig = RolloutConfig()


class RecipeError(ValueError):
    """A recipe file that cannot be used; the message names the file and the key."""


def _format_validation_error(path: Path, err: ValidationError) -> str:
    lines = [f"{path}: invalid recipe"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key")
        else:
            lines.append(f"  {key}: {e['msg']}")
    return "\n".join(lines)


def load_recipe(path: str | Path) -> Recipe:
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"{path}: recipe file not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: expected a mapping of sections at the top level")
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(_format_validation_error(path, e)) from None
