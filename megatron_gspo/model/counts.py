"""Parameter counts of a model from its config alone (no Megatron-Core): exact for the model
:mod:`megatron_gspo.model.provider` builds. ``megatron-gspo plan`` and preflight use them."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_gspo.config import ModelConfig

__all__ = ["LayerCounts", "ParamCounts", "active_parameters", "count_parameters"]


@dataclass(frozen=True)
class LayerCounts:
    """Parameters of one layer, by how they are sharded."""

    attention: int  # projections: split by TP (MLA's latent down-projections too, locally)
    replicated: int  # RMSNorm weights, router and its expert bias
    mlp: int  # a dense layer's SwiGLU, or an MoE layer's shared experts: split by TP
    experts: int  # all routed experts' SwiGLU: split by EP x ETP

    @property
    def total(self) -> int:
        return self.attention + self.replicated + self.mlp + self.experts


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of the whole (unsharded) model."""

    embedding: int  # word embeddings [V, h] (the tokenizer's rows; padding is per layout)
    output: int  # untied output layer [V, h]; 0 when tied
    layers: tuple[LayerCounts, ...]
    final_norm: int

    @property
    def total(self) -> int:
        return self.embedding + self.output + self.final_norm + sum(x.total for x in self.layers)


def _attention(m: ModelConfig) -> tuple[int, int]:
    """(projections, norms) of one layer's attention."""
    h = m.hidden_size
    if m.mla is None:
        q, kv = m.num_attention_heads * m.head_dim, m.num_query_groups * m.head_dim
        return h * (q + 2 * kv) + q * h, 2 * m.head_dim  # q-norm + k-norm (shared over heads)
    a, heads = m.mla, m.num_attention_heads
    q_rows = heads * (a.qk_nope_head_dim + a.qk_rope_head_dim)
    q = h * q_rows if a.q_lora_rank is None else a.q_lora_rank * (h + q_rows)
    kv = h * (a.kv_lora_rank + a.qk_rope_head_dim)
    kv += a.kv_lora_rank * heads * (a.qk_nope_head_dim + a.v_head_dim)
    out = heads * a.v_head_dim * h
    return q + kv + out, (a.q_lora_rank or 0) + a.kv_lora_rank  # the two latent norms


def count_parameters(m: ModelConfig) -> ParamCounts:
    """Count from the architecture: GQA with QK-norm or multi-latent attention, no biases,
    SwiGLU, dense or top-k MoE layers (with shared experts and an expert bias where
    configured), RMSNorm weights only, untied embeddings unless configured otherwise."""
    h = m.hidden_size
    attention, attention_norms = _attention(m)
    layers = []
    for i in range(m.num_layers):
        replicated = 2 * h + attention_norms  # input + pre-MLP RMSNorm
        if i in m.moe_layers:
            replicated += m.num_experts * h + (m.num_experts if m.moe_router_expert_bias else 0)
            mlp = 3 * h * (m.moe_shared_expert_intermediate_size or 0)
            experts = m.num_experts * 3 * h * m.moe_ffn_hidden_size
        else:
            mlp, experts = 3 * h * m.ffn_hidden_size, 0
        layers.append(LayerCounts(attention, replicated, mlp, experts))
    return ParamCounts(
        embedding=m.vocab_size * h,
        output=m.vocab_size * h if m.untie_embeddings_and_output_weights else 0,
        layers=tuple(layers),
        final_norm=h,
    )


def active_parameters(m: ModelConfig) -> int:
    """Parameters a token passes through (top-k experts instead of all)."""
    c = count_parameters(m)
    active = c.embedding + c.output + c.final_norm
    for layer in c.layers:
        active += layer.attention + layer.replicated + layer.mlp
        if layer.experts:
            active += layer.experts // m.num_experts * m.moe_router_topk
    return active


# --------------------------------------------------------------------------------------------
# Layout.
