"""Megatron-Core model providers for the policy.

The names below are imported on first use: :mod:`megatron_gspo.model.hf_config` (which reading
a recipe needs) must not import Megatron-Core, so that the command line starts quickly.
"""

import importlib

_EXPORTS = {
    "build_model": "megatron_gspo.model.provider",
    "check_layout": "megatron_gspo.model.provider",
    "transformer_config": "megatron_gspo.model.provider",
    "transformer_engine_available": "megatron_gspo.model.spec",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
