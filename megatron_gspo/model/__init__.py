"""Megatron-Core model providers for the policy."""

from megatron_gspo.model.provider import build_model, check_layout, transformer_config
from megatron_gspo.model.spec import transformer_engine_available

__all__ = ["build_model", "check_layout", "transformer_config", "transformer_engine_available"]
