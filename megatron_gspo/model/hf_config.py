"""Hugging Face ``config.json`` of Qwen3, Qwen3-MoE and DeepSeek-V3 ⇄ our :class:`ModelConfig`.

Only what our Megatron model can represent exactly is accepted: a config that asks for
something it cannot build (sliding-window attention, attention biases, RoPE scaling other than
DeepSeek's YaRN, group-limited routing that Megatron scores another way, ...) is refused with an
error that names the file and the key, instead of converting into a model that silently
computes something else.

The DeepSeek-V3 family (DeepSeek-V3, Kimi K2, Moonlight) maps onto Megatron-Core's multi-latent
attention and sigmoid routing with an expert-score correction bias. Megatron-Core scores a group
of experts by the sum of its top ``topk / topk_group`` scores where transformers sums its top 2,
so group-limited routing is accepted only where ``num_experts_per_tok / topk_group == 2`` (as in
DeepSeek-V3 itself: 8 / 4).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatron_gspo.config import MLAConfig, ModelConfig, YarnScaling
from megatron_gspo.runtime.errors import InputError

__all__ = [
    "HFConfigError",
    "hf_config_from_model_config",
    "load_hf_config",
    "model_config_from_hf",
    "model_family",
]

_ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}


class HFConfigError(InputError):
    """A config.json we cannot convert; the message names the file and the key."""


def load_hf_config(path_or_dict: str | Path | Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """The config as a dict, and a name for it in error messages (the file path)."""
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict), "config"
    path = Path(path_or_dict)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise HFConfigError(f"{path}: config.json not found")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise HFConfigError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise HFConfigError(f"{path}: expected a JSON object at the top level")
    return data, str(path)


def _rope(cfg: Mapping[str, Any], where: str, *, yarn: bool) -> tuple[float, YarnScaling | None]:
    """RoPE theta, and YaRN scaling where the family supports it (DeepSeek's MLA)."""
    # transformers 5 writes rope_parameters={"rope_theta", "rope_type", ...}; 4.x wrote
    # rope_theta and rope_scaling at the top level. Accept both.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        rope_type = value.get("rope_type", value.get("type", "default"))
        if rope_type not in ("default", "yarn") or (rope_type == "yarn" and not yarn):
            supported = "default RoPE or YaRN" if yarn else "only default RoPE"
            raise HFConfigError(
                f"{where}: {key}.rope_type={rope_type!r} is not supported ({supported})"
            )
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise HFConfigError(f"{where}: missing key 'rope_theta' (or rope_parameters.rope_theta)")
    scaled = next(
        (v for v in (params, scaling) if v.get("rope_type", v.get("type")) == "yarn"), None
    )
    if scaled is None:
        return float(theta), None
    return float(theta), _yarn(scaled, cfg, where)


def _yarn(p: Mapping[str, Any], cfg: Mapping[str, Any], where: str) -> YarnScaling:
    original = p.get("original_max_position_embeddings")
    if original is None:
        raise HFConfigError(f"{where}: YaRN needs rope_parameters.original_max_position_embeddings")
    factor = p.get("factor") or _require(cfg, "max_position_embeddings", where) / original
    if p.get("attention_factor") is not None or p.get("truncate", True) is not True:
        raise HFConfigError(
            f"{where}: YaRN with attention_factor or truncate: false is not supported"
        )
    mscale, all_dim = float(p.get("mscale") or 0.0), float(p.get("mscale_all_dim") or 0.0)
    # transformers scales cos/sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim)
    # only when both are set (else by mscale(factor)); Megatron always takes the ratio.
    if not (mscale and all_dim) and (mscale not in (0.0, 1.0) or all_dim):
        raise HFConfigError(
            f"{where}: YaRN with mscale={mscale} and mscale_all_dim={all_dim} is not supported "
            "(set both, or neither)"
        )
    return YarnScaling(
        factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(p.get("beta_fast", 32.0)),
        beta_slow=float(p.get("beta_slow", 1.0)),
        mscale=mscale or 1.0,
        mscale_all_dim=all_dim,
    )


def _require(cfg: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise HFConfigError(f"{where}: missing key {key!r}")
    return cfg[key]


def _refuse_unless(cfg: Mapping[str, Any], key: str, ok: Any, where: str, why: str) -> None:
    value = cfg.get(key, ok)
    if value != ok:
        raise HFConfigError(f"{where}: {key}={value!r} is not supported ({why}; need {ok!r})")


def model_config_from_hf(path_or_dict: str | Path | Mapping[str, Any]) -> ModelConfig:
    """Read a Qwen3, Qwen3-MoE or DeepSeek-V3 ``config.json`` (a file, its directory, or the
    dict)."""
    cfg, where = load_hf_config(path_or_dict)
    model_type = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    if model_type not in _ARCHITECTURES:
        raise HFConfigError(
            f"{where}: model_type={model_type!r} is not supported "
            f"(supported: {', '.join(sorted(_ARCHITECTURES))})"
        )
    if archs and archs != [_ARCHITECTURES[model_type]]:
        raise HFConfigError(
            f"{where}: architectures={archs!r} is not supported for model_type={model_type!r} "
            f"(expected [{_ARCHITECTURES[model_type]!r}])"
        )
    _refuse_unless(cfg, "hidden_act", "silu", where, "the model uses SwiGLU")
    _refuse_unless(cfg, "attention_bias", False, where, "linear layers have no bias")
    _refuse_unless(cfg, "use_sliding_window", False, where, "attention is full causal")
    if cfg.get("quantization_config"):
        raise HFConfigError(f"{where}: quantization_config is not supported (a quantized model)")
    dtype = cfg.get("dtype", cfg.get("torch_dtype")) or "float32"
    if dtype not in _DTYPES:
        raise HFConfigError(
            f"{where}: dtype={dtype!r} is not supported (supported: {', '.join(_DTYPES)})"
        )
    hidden = int(_require(cfg, "hidden_size", where))
    heads = int(_require(cfg, "num_attention_heads", where))
    fields: dict[str, Any] = dict(
        num_layers=int(_require(cfg, "num_hidden_layers", where)),
        hidden_size=hidden,
        num_attention_heads=heads,
        vocab_size=int(_require(cfg, "vocab_size", where)),
        max_seq_length=int(cfg.get("max_position_embeddings", 2048)),
        ffn_hidden_size=cfg.get("intermediate_size"),
        norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
        init_method_std=float(cfg.get("initializer_range", 0.02)),
        untie_embeddings_and_output_weights=not cfg.get("tie_word_embeddings", False),
        params_dtype=_DTYPES[dtype],
    )
    if model_type == "deepseek_v3":
        fields.update(_deepseek_v3(cfg, where, heads))
    else:
        fields.update(
            num_query_groups=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rotary_base=_rope(cfg, where, yarn=False)[0],
        )
        if model_type == "qwen3_moe":
            fields.update(_qwen3_moe(cfg, where, fields["num_layers"]))
    if not fields.get("num_experts") and fields["ffn_hidden_size"] is None:
        raise HFConfigError(f"{where}: missing key 'intermediate_size'")
    try:
        return ModelConfig(**fields)
    except ValueError as e:
        raise HFConfigError(f"{where}: {e}") from e


def _qwen3_moe(cfg: Mapping[str, Any], where: str, num_layers: int) -> dict[str, Any]:
    if cfg.get("shared_expert_intermediate_size"):
        raise HFConfigError(f"{where}: shared_expert_intermediate_size is not supported")
    # transformers 5 stores the expert count as num_local_experts (num_experts is an alias).
    num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if not num_experts:
        raise HFConfigError(f"{where}: missing key 'num_experts' (or 'num_local_experts')")
    step = int(cfg.get("decoder_sparse_step") or 1)
    # transformers: layer i is MoE unless listed in mlp_only_layers or (i + 1) % step != 0.
    only = set(cfg.get("mlp_only_layers") or [])
    dense = sorted(i for i in range(num_layers) if i in only or (i + 1) % step)
    return dict(
        num_experts=int(num_experts),
        moe_ffn_hidden_size=int(_require(cfg, "moe_intermediate_size", where)),
        moe_router_topk=int(_require(cfg, "num_experts_per_tok", where)),
        moe_aux_loss_coeff=float(cfg.get("router_aux_loss_coef", 1e-3)),
        dense_layers=dense,
        # transformers 5 reads a missing norm_topk_prob as false.
        moe_norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
    )


def _deepseek_v3(cfg: Mapping[str, Any], where: str, heads: int) -> dict[str, Any]:
    kv_heads = cfg.get("num_key_value_heads") or heads
    if kv_heads != heads:
        raise HFConfigError(
            f"{where}: num_key_value_heads={kv_heads} is not supported (multi-latent attention "
            f"has one key/value head per query head; need {heads})"
        )
    _refuse_unless(cfg, "rope_interleave", True, where, "Megatron's MLA reads interleaved RoPE")
    _refuse_unless(cfg, "scoring_func", "sigmoid", where, "DeepSeek-V3 scores with a sigmoid")
    _refuse_unless(cfg, "topk_method", "noaux_tc", where, "the routing bias is aux-loss-free")
    _refuse_unless(cfg, "moe_layer_freq", 1, where, "dense layers come first only")
    mla = MLAConfig(
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=int(_require(cfg, "kv_lora_rank", where)),
        qk_nope_head_dim=int(_require(cfg, "qk_nope_head_dim", where)),
        qk_rope_head_dim=int(_require(cfg, "qk_rope_head_dim", where)),
        v_head_dim=int(_require(cfg, "v_head_dim", where)),
    )
    num_experts = cfg.get("n_routed_experts", cfg.get("num_local_experts"))
    if not num_experts:
        raise HFConfigError(f"{where}: missing key 'n_routed_experts'")
    topk = int(_require(cfg, "num_experts_per_tok", where))
    moe_width = int(_require(cfg, "moe_intermediate_size", where))
    norm = bool(cfg.get("norm_topk_prob", True))
    if norm != (topk > 1):
        raise HFConfigError(
            f"{where}: norm_topk_prob={norm} with num_experts_per_tok={topk} is not supported "
            "(Megatron's sigmoid routing renormalizes the weights exactly when top-k > 1)"
        )
    groups, group_topk = _groups(cfg, where, int(num_experts), topk)
    theta, yarn = _rope(cfg, where, yarn=True)
    shared = int(cfg.get("n_shared_experts") or 0)
    scale = cfg.get("routed_scaling_factor")
    return dict(
        num_query_groups=heads,
        head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim,
        mla=mla,
        rotary_base=theta,
        rope_scaling=yarn,
        num_experts=int(num_experts),
        moe_ffn_hidden_size=moe_width,
        dense_layers=list(range(int(cfg.get("first_k_dense_replace") or 0))),
        moe_router_topk=topk,
        moe_router_score_function="sigmoid",
        moe_norm_topk_prob=norm,
        moe_router_topk_scaling_factor=None if scale in (None, 1, 1.0) else float(scale),
        moe_router_expert_bias=True,
        moe_router_num_groups=groups,
        moe_router_group_topk=group_topk,
        moe_shared_expert_intermediate_size=shared * moe_width or None,
        # DeepSeek-V3 balances its experts with the bias, not an auxiliary loss.
        moe_aux_loss_coeff=0.0,
    )


def _groups(
    cfg: Mapping[str, Any], where: str, num_experts: int, topk: int
) -> tuple[int | None, int | None]:
    groups, group_topk = cfg.get("n_group"), cfg.get("topk_group")
    if not groups or groups == 1 or group_topk in (None, groups):
        return None, None  # every group stays: no group limit
    if num_experts % groups or num_experts // groups < 2 or topk != 2 * group_topk:
        raise HFConfigError(
            f"{where}: n_group={groups}, topk_group={group_topk} with num_experts_per_tok="
            f"{topk} is not supported: Megatron-Core scores a group by its top "
            f"num_experts_per_tok / topk_group experts, transformers by its top 2, so they "
            "agree only where num_experts_per_tok = 2 x topk_group"
        )
    return int(groups), int(group_topk)


def model_family(model: ModelConfig) -> str:
    """The Hugging Face ``model_type`` of the model: qwen3, qwen3_moe or deepseek_v3."""
    if model.mla is not None:
        return "deepseek_v3"
    return "qwen3_moe" if model.is_moe else "qwen3"


def hf_config_from_model_config(model: ModelConfig) -> dict[str, Any]:
    """A ``config.json`` dict that transformers (4.x and 5.x) and vLLM read as this model.

    RoPE theta is written both ways (``rope_theta`` for 4.x readers such as older vLLM,
    ``rope_parameters`` for 5.x), and the expert count of Qwen3-MoE as ``num_experts``, which
    5.x maps to ``num_local_experts``. A model no Hugging Face family represents exactly (an
    MoE with multi-latent attention but softmax routing, say) is refused.
    """
    family = model_family(model)
    rope: dict[str, Any] = {"rope_theta": model.rotary_base, "rope_type": "default"}
    if model.rope_scaling is not None:
        rope.update(rope_type="yarn", **model.rope_scaling.model_dump())
    cfg: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[family]],
        "model_type": family,
        "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_query_groups,
        "vocab_size": model.vocab_size,
        "max_position_embeddings": model.max_seq_length,
        "rms_norm_eps": model.norm_epsilon,
        "rope_theta": model.rotary_base,
        "rope_scaling": None if model.rope_scaling is None else dict(rope),
        "rope_parameters": rope,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": model.init_method_std,
        "tie_word_embeddings": not model.untie_embeddings_and_output_weights,
        "dtype": model.params_dtype,
        "torch_dtype": model.params_dtype,
        "use_cache": True,
    }
    if model.ffn_hidden_size is not None:
        cfg["intermediate_size"] = model.ffn_hidden_size
    if family == "deepseek_v3":
        cfg.update(_deepseek_v3_export(model))
        return cfg
    _export_refuses(
        model,
        sigmoid_routing=model.moe_router_score_function == "sigmoid",
        shared_experts=bool(model.moe_shared_expert_intermediate_size),
        group_limited_routing=model.moe_router_num_groups is not None,
        routed_scaling_factor=model.moe_router_topk_scaling_factor is not None,
        yarn=model.rope_scaling is not None,
    )
    cfg.update(head_dim=model.head_dim, use_sliding_window=False, sliding_window=None)
    if model.is_moe:
        cfg.update(
            num_experts=model.num_experts,
            moe_intermediate_size=model.moe_ffn_hidden_size,
            num_experts_per_tok=model.moe_router_topk,
            norm_topk_prob=model.moe_norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=list(model.dense_layers),
            router_aux_loss_coef=model.moe_aux_loss_coeff,
            output_router_logits=False,
        )
    return cfg


def _export_refuses(model: ModelConfig, **features: bool) -> None:
    used = [name for name, on in features.items() if on]
    if used:
        raise HFConfigError(
            f"a {model_family(model)} model has no Hugging Face form with {', '.join(used)}"
        )


def _deepseek_v3_export(model: ModelConfig) -> dict[str, Any]:
    mla, k = model.mla, len(model.dense_layers)
    shared = model.moe_shared_expert_intermediate_size or 0
    _export_refuses(
        model,
        softmax_routing=model.moe_router_score_function != "sigmoid",
        routing_without_expert_bias=not model.moe_router_expert_bias,
        dense_layers_after_moe_layers=model.dense_layers != list(range(k)),
        shared_experts_not_a_multiple_of_an_expert=bool(shared % model.moe_ffn_hidden_size),
    )
    groups = model.moe_router_num_groups
    return {
        "head_dim": mla.qk_rope_head_dim,
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "qk_head_dim": mla.qk_nope_head_dim + mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "rope_interleave": True,
        "n_routed_experts": model.num_experts,
        "n_shared_experts": shared // model.moe_ffn_hidden_size,
        "moe_intermediate_size": model.moe_ffn_hidden_size,
        "num_experts_per_tok": model.moe_router_topk,
        "first_k_dense_replace": k,
        "n_group": groups or 1,
        "topk_group": model.moe_router_group_topk or 1,
        "routed_scaling_factor": model.moe_router_topk_scaling_factor or 1.0,
        "norm_topk_prob": model.moe_norm_topk_prob,
        # What vLLM reads to route as the model does (transformers ignores them).
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "moe_layer_freq": 1,
        # Multi-token-prediction layers are not trained (nor exported).
        "num_nextn_predict_layers": 0,
    }
