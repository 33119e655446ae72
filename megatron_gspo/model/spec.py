"""The one place that chooses Transformer Engine or Megatron's local layers."""

from __future__ import annotations

import dataclasses
import importlib.util

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer import multi_latent_attention
from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_gspo.model.attention import SegmentAttention
from megatron_gspo.model.norm import RMSNorm


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def _local(layer: ModuleSpec, latent_norm_epsilon: float | None) -> ModuleSpec:
    """Megatron's local layer with our RMSNorm (sequence parallelism) and core attention
    (packed sequences, context parallelism) in place of the modules that refuse them."""
    attn = layer.submodules.self_attention
    if isinstance(attn.submodules, MLASelfAttentionSubmodules):
        latent = ModuleSpec(module=RMSNorm, params={"fixed_eps": latent_norm_epsilon})
        norms = {"q_layernorm": latent, "kv_layernorm": latent}
    else:
        norms = {"q_layernorm": RMSNorm, "k_layernorm": RMSNorm}
    attn = dataclasses.replace(
        attn,
        submodules=dataclasses.replace(attn.submodules, core_attention=SegmentAttention, **norms),
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
    config: TransformerConfig,
    *,
    use_te: bool,
    pp_rank: int | None = None,
    latent_norm_epsilon: float | None = None,
) -> TransformerBlockSubmodules:
    """Layer specs for the layers of this pipeline stage, with the final norm
    (``latent_norm_epsilon``: multi-latent attention's latent norms, where it differs)."""
    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_te, normalization="RMSNorm", pp_rank=pp_rank
    )
    if use_te:
        return block
    if not transformer_engine_available():
        # Megatron's MLA imports its Transformer Engine wrappers from a module that stands in
        # mocks when TE is missing, so it believes TE is there and refuses every local linear.
        multi_latent_attention.HAVE_TE = False
    return TransformerBlockSubmodules(
        layer_specs=[_local(s, latent_norm_epsilon) for s in block.layer_specs],
        layer_norm=RMSNorm,
    )
