"""Hugging Face ``config.json`` of Qwen3 / Qwen3-MoE ⇄ our :class:`ModelConfig`.

Only what our Megatron model can represent exactly is accepted: a config that asks for
something it cannot build (sliding-window attention, dense layers inside an MoE stack,
un-renormalized top-k routing, RoPE scaling, attention biases) is refused with an error that
names the file and the key, instead of converting into a model that silently computes something
else.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatron_gspo.config import ModelConfig

__all__ = [
    "HFConfigError",
    "hf_config_from_model_config",
    "load_hf_config",
    "model_config_from_hf",
]

_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}


class HFConfigError(ValueError):
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


def _rope_theta(cfg: Mapping[str, Any], where: str) -> float:
    # transformers 5 writes rope_parameters={"rope_theta", "rope_type"}; 4.x wrote rope_theta
    # and rope_scaling at the top level. Accept both, but only un-scaled ("default") RoPE.
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling")
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling or {})):
        rope_type = value.get("rope_type", value.get("type", "default"))
        if rope_type != "default":
            raise HFConfigError(
                f"{where}: {key}.rope_type={rope_type!r} is not supported (only default RoPE)"
            )
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise HFConfigError(f"{where}: missing key 'rope_theta' (or rope_parameters.rope_theta)")
    return float(theta)


def _require(cfg: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise HFConfigError(f"{where}: missing key {key!r}")
    return cfg[key]


def _refuse_unless(cfg: Mapping[str, Any], key: str, ok: Any, where: str, why: str) -> None:
    value = cfg.get(key, ok)
    if value != ok:
        raise HFConfigError(f"{where}: {key}={value!r} is not supported ({why}; need {ok!r})")


def model_config_from_hf(path_or_dict: str | Path | Mapping[str, Any]) -> ModelConfig:
    """Read a Qwen3 / Qwen3-MoE ``config.json`` (a file, its directory, or the dict)."""
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
    is_moe = model_type == "qwen3_moe"

    _refuse_unless(cfg, "hidden_act", "silu", where, "the model uses SwiGLU")
    _refuse_unless(cfg, "attention_bias", False, where, "linear layers have no bias")
    _refuse_unless(cfg, "use_sliding_window", False, where, "attention is full causal")
    if is_moe:
        _refuse_unless(
            cfg, "norm_topk_prob", True, where, "the router renormalizes the top-k probabilities"
        )
        _refuse_unless(cfg, "decoder_sparse_step", 1, where, "every layer is an MoE layer")
        if cfg.get("mlp_only_layers"):
            raise HFConfigError(
                f"{where}: mlp_only_layers={cfg['mlp_only_layers']!r} is not supported "
                "(every layer is an MoE layer; need [])"
            )
        if cfg.get("shared_expert_intermediate_size"):
            raise HFConfigError(f"{where}: shared_expert_intermediate_size is not supported")

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
        num_query_groups=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        vocab_size=int(_require(cfg, "vocab_size", where)),
        max_seq_length=int(cfg.get("max_position_embeddings", 2048)),
        ffn_hidden_size=cfg.get("intermediate_size"),
        rotary_base=_rope_theta(cfg, where),
        norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
        init_method_std=float(cfg.get("initializer_range", 0.02)),
        untie_embeddings_and_output_weights=not cfg.get("tie_word_embeddings", False),
        params_dtype=_DTYPES[dtype],
    )
    if is_moe:
        # transformers 5 stores the expert count as num_local_experts (num_experts is an alias).
        num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        if not num_experts:
            raise HFConfigError(f"{where}: missing key 'num_experts' (or 'num_local_experts')")
        fields.update(
            num_experts=int(num_experts),
            moe_ffn_hidden_size=int(_require(cfg, "moe_intermediate_size", where)),
            moe_router_topk=int(_require(cfg, "num_experts_per_tok", where)),
            moe_aux_loss_coeff=float(cfg.get("router_aux_loss_coef", 1e-3)),
        )
    elif fields["ffn_hidden_size"] is None:
        raise HFConfigError(f"{where}: missing key 'intermediate_size'")
    try:
        return ModelConfig(**fields)
    except ValueError as e:
        raise HFConfigError(f"{where}: {e}") from e


def hf_config_from_model_config(model: ModelConfig) -> dict[str, Any]:
    """A ``config.json`` dict that transformers 4.x and 5.x both read as this model.

    RoPE theta is written both ways (``rope_theta`` for 4.x readers such as older vLLM,
    ``rope_parameters`` for 5.x), and the expert count as ``num_experts``, which 5.x maps to
    ``num_local_experts``.
    """
    model_type = "qwen3_moe" if model.is_moe else "qwen3"
    cfg: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[model_type]],
        "model_type": model_type,
        "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_query_groups,
        "head_dim": model.head_dim,
        "vocab_size": model.vocab_size,
        "max_position_embeddings": model.max_seq_length,
        "rms_norm_eps": model.norm_epsilon,
        "rope_theta": model.rotary_base,
        "rope_scaling": None,
        "rope_parameters": {"rope_theta": model.rotary_base, "rope_type": "default"},
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "initializer_range": model.init_method_std,
        "tie_word_embeddings": not model.untie_embeddings_and_output_weights,
        "dtype": model.params_dtype,
        "torch_dtype": model.params_dtype,
        "use_cache": True,
    }
    if model.ffn_hidden_size is not None:
        cfg["intermediate_size"] = model.ffn_hidden_size
    if model.is_moe:
        cfg.update(
            num_experts=model.num_experts,
            moe_intermediate_size=model.moe_ffn_hidden_size,
            num_experts_per_tok=model.moe_router_topk,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            router_aux_loss_coef=model.moe_aux_loss_coeff,
            output_router_logits=False,
        )
    return cfg
