"""Builds the Megatron-Core ``GPTModel`` of a recipe: Qwen3-style (GQA, dense or MoE) or the
DeepSeek-V3 family's (multi-latent attention, shared experts, sigmoid routing with a bias)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from megatron_gspo.config import MemoryConfig, ModelConfig, ParallelConfig, PrecisionConfig
from megatron_gspo.model.aux_loss import guard_empty_microbatches
from megatron_gspo.model.expert_bias import count_expert_tokens_without_padding
from megatron_gspo.model.spec import decoder_block_spec, transformer_engine_available
from megatron_gspo.runtime.errors import InputError
from megatron_gspo.runtime.extras import require_extra

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def check_layout(model: ModelConfig, parallel: ParallelConfig) -> None:
    """Refuse a layout that does not divide the model, naming the offending pair."""
    tp = parallel.tensor_model_parallel_size
    checks = [
        ("num_attention_heads", model.num_attention_heads, "tensor_model_parallel_size", tp),
        ("num_query_groups", model.num_query_groups, "tensor_model_parallel_size", tp),
        (
            "num_layers",
            model.num_layers,
            "pipeline_model_parallel_size",
            parallel.pipeline_model_parallel_size,
        ),
    ]
    if model.mla is not None:
        # Without Transformer Engine the latent down-projections are split over TP too.
        if model.mla.q_lora_rank is not None:
            checks.append(
                ("mla.q_lora_rank", model.mla.q_lora_rank, "tensor_model_parallel_size", tp)
            )
        latent = model.mla.kv_lora_rank + model.mla.qk_rope_head_dim
        checks.append(
            ("mla.kv_lora_rank + mla.qk_rope_head_dim", latent, "tensor_model_parallel_size", tp)
        )
    if model.is_moe:
        checks.append(
            (
                "num_experts",
                model.num_experts,
                "expert_model_parallel_size",
                parallel.expert_model_parallel_size,
            )
        )
    for name, value, pname, pvalue in checks:
        if value % pvalue:
            raise InputError(f"model.{name}={value} is not divisible by parallel.{pname}={pvalue}")
    if model.is_moe and tp > 1 and not parallel.sequence_parallel:
        raise InputError(
            "parallel.sequence_parallel must be true for MoE models with "
            "tensor_model_parallel_size > 1 (Megatron-Core requires it for MoE layers)"
        )


def transformer_config(
    model: ModelConfig,
    parallel: ParallelConfig,
    precision: PrecisionConfig | None = None,
    *,
    memory: MemoryConfig | None = None,
    routing_replay: bool = False,
    use_te: bool | None = None,
) -> TransformerConfig:
    precision = precision or PrecisionConfig()
    memory = memory or MemoryConfig()
    if use_te is None:
        use_te = transformer_engine_available()
    if precision.fp8 and not use_te:
        require_extra("transformer_engine", "FP8 training (precision.fp8)", extra="gpu")
    check_layout(model, parallel)
    on_gpu = torch.cuda.is_available()
    params_dtype = torch.bfloat16 if precision.bf16 else _DTYPES[model.params_dtype]
    moe = {}
    if model.is_moe:
        moe = dict(
            num_moe_experts=model.num_experts,
            moe_ffn_hidden_size=model.moe_ffn_hidden_size,
            moe_layer_freq=[int(i not in model.dense_layers) for i in range(model.num_layers)],
            moe_router_topk=model.moe_router_topk,
            moe_aux_loss_coeff=_aux_loss_coeff(model),
            moe_router_load_balancing_type=model.moe_aux_loss_type,
            moe_router_score_function=model.moe_router_score_function,
            # Softmax over the top-k logits is softmax-then-renormalize (norm_topk_prob);
            # without renormalizing, the top-k of a softmax over every expert.
            moe_router_pre_softmax=not model.moe_norm_topk_prob,
            moe_router_topk_scaling_factor=model.moe_router_topk_scaling_factor,
            moe_router_enable_expert_bias=model.moe_router_expert_bias,
            moe_router_bias_update_rate=model.moe_router_bias_update_rate,
            moe_router_num_groups=model.moe_router_num_groups,
            moe_router_group_topk=model.moe_router_group_topk,
            moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size,
            moe_router_dtype="fp32",
            # alltoall needs CUDA streams; allgather runs everywhere.
            moe_token_dispatcher_type="alltoall" if on_gpu else "allgather",
            moe_grouped_gemm=use_te,
            moe_enable_routing_replay=routing_replay,
        )
    config_cls, attention = TransformerConfig, {}
    if model.mla is not None:
        config_cls, attention = MLATransformerConfig, _mla(model)
    return config_cls(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.head_dim,
        ffn_hidden_size=model.ffn_hidden_size or model.moe_ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_epsilon,
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_method_std,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=precision.bf16,
        fp8=precision.fp8,
        use_cpu_initialization=not on_gpu,
        # Fusions need apex or Transformer Engine kernels.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # Megatron then averages each micro-batch's loss over micro-batches and data-parallel
        # ranks, and scales the router's aux loss the same way. The GSPO step multiplies its
        # loss by (DP x CP x micro-batches / global sequences) so the result is the global
        # per-sequence mean, while the aux loss keeps Megatron's mean (see train_step.py).
        calculate_per_token_loss=False,
        # Packed micro-batches differ in length: with alltoall, pipeline stages exchange
        # shapes first; allgather cannot, and the trainer pads to one shape per mini-batch.
        variable_seq_lengths=on_gpu and parallel.pipeline_model_parallel_size > 1,
        recompute_granularity=memory.recompute_granularity,
        recompute_method=memory.recompute_method,
        recompute_num_layers=memory.recompute_num_layers,
        **({"recompute_modules": memory.recompute_modules} if memory.recompute_modules else {}),
        **moe,
        **attention,
    )


def _mla(model: ModelConfig) -> dict:
    """Megatron-Core's multi-latent attention settings (and its RoPE, which it owns)."""
    mla, yarn = model.mla, model.rope_scaling
    out = dict(
        q_lora_rank=mla.q_lora_rank,
        kv_lora_rank=mla.kv_lora_rank,
        # Megatron's qk_head_dim is the part without RoPE.
        qk_head_dim=mla.qk_nope_head_dim,
        qk_pos_emb_head_dim=mla.qk_rope_head_dim,
        v_head_dim=mla.v_head_dim,
        rotary_base=model.rotary_base,
        # The config's default is YaRN; its softmax scale reads mscale_all_dim even for plain
        # RoPE, where it must stay 0 (a scale of 1).
        rope_type="rope",
        mscale=1.0,
        mscale_all_dim=0.0,
    )
    if yarn is not None:
        out.update(
            rope_type="yarn",
            rotary_scaling_factor=yarn.factor,
            original_max_position_embeddings=yarn.original_max_position_embeddings,
            beta_fast=yarn.beta_fast,
            beta_slow=yarn.beta_slow,
            mscale=yarn.mscale,
            mscale_all_dim=yarn.mscale_all_dim,
        )
    return out


def _aux_loss_coeff(model: ModelConfig) -> float:
    """The coefficient Megatron-Core is given for the recipe's load-balancing loss.

    With ``global_aux_loss`` each data-parallel rank's loss is its share of one loss over the
    whole data-parallel batch (its own router probabilities against the expert counts summed
    over the DP x CP group), so the shares add up to that loss; but the router's gradients are
    then averaged over the same group, which would divide it by its size. Scaling the
    coefficient by that size gives the loss the recipe asks for, on any number of ranks.
    """
    if model.moe_aux_loss_type != "global_aux_loss":
        return model.moe_aux_loss_coeff
    dp_cp = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    return model.moe_aux_loss_coeff * dp_cp


def build_model(
    model: ModelConfig,
    parallel: ParallelConfig,
    precision: PrecisionConfig | None = None,
    *,
    memory: MemoryConfig | None = None,
    routing_replay: bool = False,
    use_te: bool | None = None,
) -> GPTModel:
    """The policy's stage for this rank; parallel state must already be initialized."""
    guard_empty_microbatches()
    count_expert_tokens_without_padding()
    if use_te is None:
        use_te = transformer_engine_available()
    config = transformer_config(
        model, parallel, precision, memory=memory, routing_replay=routing_replay, use_te=use_te
    )
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=decoder_block_spec(
            config,
            use_te=use_te,
            pp_rank=pp_rank,
            latent_norm_epsilon=model.mla.latent_norm_epsilon if model.mla else None,
        ),
        vocab_size=model.padded_vocab_size(parallel.tensor_model_parallel_size),
        max_sequence_length=model.max_seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
        position_embedding_type="rope",
        # Megatron annotates it int, but only raises it to a power: a float is exact, and int()
        # would silently move a fractional rope_theta (100.5 -> 100 moved logits by 7e-2).
        rotary_base=model.rotary_base,
    )
    if torch.cuda.is_available():
        # As Megatron-LM's own get_model does: a module that leaves a parameter or buffer on
        # the host at construction (found on an H200 with megatron-core 0.19: a bf16 one
        # that its mixed-precision optimizer then refused) joins the others.
        gpt.cuda(torch.cuda.current_device())
    # The tokenizer's vocabulary: ids from here to gpt.vocab_size are padding (weights/shards,
    # loss/logprobs and the engines leave them out).
    gpt.vocab_size_unpadded = model.vocab_size
    return gpt
