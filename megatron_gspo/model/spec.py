"""The one place that chooses Transformer Engine or Megatron's local layers."""

from __future__ import annotations

import dataclasses
import importlib.util

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_gspo.model.attention import SegmentAttention
from megatron_gspo.model.norm import RMSNorm


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def _local(layer: ModuleSpec) -> ModuleSpec:
    """Megatron's local layer with our RMSNorm (sequence parallelism) and core attention
    (packed sequences, context parallelism) in place of the modules that refuse them."""
    attn = layer.submodules.self_attention
    attn = dataclasses.replace(
        attn,
        submodules=dataclasses.replace(
            attn.submodules,
            core_attention=SegmentAttention,
            q_layernorm=RMSNorm,
            k_layernorm=RMSNorm,
        ),
    )
    return dataclasses.replace(
        layer,
        submodules=dataclasses.replace(
            layer.submodules,
            input_layernorm=RMSNorm,
            pre_mlp_layernorm=RMSNorm,
            self_attention=attn,
        ),
    )


def decoder_block_spec(
    config: TransformerConfig, *, use_te: bool, pp_rank: int | None = None
) -> TransformerBlockSubmodules:
    """Layer specs for the layers of this pipeline stage, with the final norm."""
    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_te, normalization="RMSNorm", pp_rank=pp_rank
    )
    if use_te:
        return block
    return TransformerBlockSubmodules(
        layer_specs=[_local(s) for s in block.layer_specs], layer_norm=RMSNorm
    )
