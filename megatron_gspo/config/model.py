"""The model section: a Qwen3-style decoder or the DeepSeek-V3 family's."""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from megatron_gspo.config.base import _Section


class MLAConfig(_Section):
    """Multi-latent attention (DeepSeek-V2/V3, Kimi K2, Moonlight): queries through a low-rank
    latent (``q_lora_rank``; None projects them directly), keys and values from one shared
    latent of ``kv_lora_rank``, each head's query/key split into a part without RoPE and a
    RoPE part shared by all heads."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # transformers builds the two latent RMSNorms with this epsilon whatever rms_norm_eps
    # says (vLLM takes rms_norm_eps: the two differ where it is not 1e-6).
    latent_norm_epsilon: float = 1e-6


class YarnScaling(_Section):
    """YaRN RoPE scaling (``rope_type: yarn`` in a Hugging Face config), as DeepSeek-V3 and
    Kimi K2 are released with; multi-latent attention only."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


class ModelConfig(_Section):
    """A Qwen3-style decoder (GQA, QK-norm, RoPE, RMSNorm, SwiGLU, optional top-k MoE), or the
    DeepSeek-V3 family's (multi-latent attention, shared experts, first dense layers, sigmoid
    routing with an expert bias, group-limited routing)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    # GQA's key/value heads; multi-latent attention has one per head.
    num_query_groups: int
    # The query/key head width (with multi-latent attention: qk_nope + qk_rope).
    head_dim: int
    # The tokenizer's vocabulary; the model's rows are padded up to a multiple of
    # make_vocab_size_divisible_by x TP (Megatron's rule), and padded ids are never sampled nor
    # scored. 1 pads only where TP does not divide the vocabulary. A run's checkpoint resumes
    # on another TP size where both pad to the same rows; run.init_from loads any padding.
    vocab_size: int
    make_vocab_size_divisible_by: int = 1
    max_seq_length: int = 2048
    # Dense MLP width: of a dense model, and of the dense layers of an MoE one.
    ffn_hidden_size: int | None = None
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    # MoE models: the layers (0-based) whose MLP is dense (Qwen3-MoE's mlp_only_layers,
    # DeepSeek-V3's first_k_dense_replace).
    dense_layers: list[int] = []
    moe_router_topk: int = 2
    # Routing: "softmax" (Qwen3-MoE) or "sigmoid" (DeepSeek-V3) scores; whether the top-k
    # weights are renormalized to sum to 1 (Qwen3-MoE's norm_topk_prob; sigmoid routing
    # renormalizes for k > 1); a factor on the routed output (DeepSeek's
    # routed_scaling_factor).
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    moe_norm_topk_prob: bool = True
    moe_router_topk_scaling_factor: float | None = None
    # Aux-loss-free balancing (DeepSeek-V3's e_score_correction_bias): a per-expert bias added
    # to the scores for choosing experts only, moved by Megatron-Core after every optimizer
    # step towards balanced loads at this rate (0 keeps it fixed); saved with checkpoints.
    moe_router_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    # Group-limited routing: experts in num_groups groups, tokens routed within the group_topk
    # best groups.
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    # Shared experts' total width (DeepSeek: n_shared_experts x moe_intermediate_size).
    moe_shared_expert_intermediate_size: int | None = None
    moe_aux_loss_coeff: float = 1e-3
    # Megatron-Core's load-balancing loss: "aux_loss" per micro-batch and data-parallel rank
    # (its statistics over the TP x CP group), "seq_aux_loss" per sequence, "global_aux_loss"
    # with the expert counts over the data-parallel group too (docs/loss.md: which layouts equal
    # one rank with each).
    moe_aux_loss_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss"] = "aux_loss"
    mla: MLAConfig | None = None
    rotary_base: float = 1_000_000.0
    rope_scaling: YarnScaling | None = None
    norm_epsilon: float = 1e-6
    init_method_std: float = 0.02
    untie_embeddings_and_output_weights: bool = True
    params_dtype: Literal["float32", "bfloat16"] = "float32"

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    @property
    def moe_layers(self) -> list[int]:
        """The (0-based) indices of the MoE layers."""
        if not self.is_moe:
            return []
        return [i for i in range(self.num_layers) if i not in self.dense_layers]

    def padded_vocab_size(self, tensor_parallel: int = 1) -> int:
        """The model's vocabulary rows under ``tensor_parallel`` (Megatron's padding rule)."""
        multiple = self.make_vocab_size_divisible_by * tensor_parallel
        return -(-self.vocab_size // multiple) * multiple

    @model_validator(mode="after")
    def _check_shapes(self) -> ModelConfig:
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_query_groups ({self.num_query_groups})"
            )
        if self.make_vocab_size_divisible_by < 1:
            raise ValueError("make_vocab_size_divisible_by must be >= 1")
        if self.is_moe:
            if self.moe_ffn_hidden_size is None:
                raise ValueError("moe_ffn_hidden_size is required when num_experts is set")
            if not 1 <= self.moe_router_topk <= self.num_experts:
                raise ValueError(
                    f"moe_router_topk ({self.moe_router_topk}) must be in [1, num_experts "
                    f"({self.num_experts})]"
                )
            if any(not 0 <= i < self.num_layers for i in self.dense_layers):
                raise ValueError(f"dense_layers {self.dense_layers} must be layer indices")
            if self.dense_layers and self.ffn_hidden_size is None:
                raise ValueError("dense_layers need ffn_hidden_size (the dense MLP's width)")
            self._check_router()
        elif self.ffn_hidden_size is None:
            raise ValueError("ffn_hidden_size is required for a dense model (no num_experts)")
        elif self.dense_layers:
            raise ValueError("dense_layers is for MoE models (every layer of this one is dense)")
        if self.mla is not None:
            want = self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim
            if self.head_dim != want or self.num_query_groups != self.num_attention_heads:
                raise ValueError(
                    "with multi-latent attention head_dim must be qk_nope_head_dim + "
                    f"qk_rope_head_dim ({want}) and num_query_groups num_attention_heads"
                )
        elif self.rope_scaling is not None:
            raise ValueError("rope_scaling (YaRN) is supported with multi-latent attention only")
        return self

    def _check_router(self) -> None:
        sigmoid = self.moe_router_score_function == "sigmoid"
        if self.moe_router_expert_bias and not sigmoid:
            raise ValueError("moe_router_expert_bias needs moe_router_score_function: sigmoid")
        if sigmoid and self.moe_norm_topk_prob != (self.moe_router_topk > 1):
            # Megatron's sigmoid routing always renormalizes k > 1 weights, never k = 1.
            raise ValueError(
                "sigmoid routing renormalizes the top-k weights exactly when "
                f"moe_router_topk > 1: moe_norm_topk_prob must be {self.moe_router_topk > 1}"
            )
        if not sigmoid and self.moe_router_topk == 1 and self.moe_norm_topk_prob:
            # Megatron scores top-1 softmax routing over all experts (it refuses otherwise).
            raise ValueError(
                "softmax routing with moe_router_topk 1 needs moe_norm_topk_prob false"
            )
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        if (groups is None) != (group_topk is None):
            raise ValueError("set both moe_router_num_groups and moe_router_group_topk, or none")
        if groups is not None and (self.num_experts % groups or not 1 <= group_topk <= groups):
            raise ValueError(
                f"group-limited routing needs num_experts ({self.num_experts}) divisible by "
                f"moe_router_num_groups ({groups}) and 1 <= moe_router_group_topk <= groups"
            )
