"""Optional GPU dependencies, imported only when a recipe asks for them."""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtraError(ImportError):
    """A recipe needs an optional package that is not installed."""


def require_extra(module: str, feature: str, *, extra: str = "gpu") -> ModuleType:
    """Import ``module`` or fail with a message naming the extra that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtraError(
            f"{feature} needs the '{module}' package, which is not installed. "
            f"Install the '{extra}' extra: pip install 'megatron-gspo[{extra}]' "
            f"(on a machine with CUDA)."
        ) from e


def check_recipe_extras(recipe) -> None:
    """Fail early, before any process group exists, when a recipe needs a missing extra."""
    if recipe.precision.fp8:
        require_extra("transformer_engine", f"FP8 training (precision.fp8={recipe.precision.fp8})")
    # rollout.engine=vllm needs nothing here: the trainer talks HTTP and torch.distributed to
    # the servers, and only the machines that serve need vllm (launch --role rollout checks).
