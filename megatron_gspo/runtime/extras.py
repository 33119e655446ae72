"""Optional GPU dependencies, imported only when a recipe asks for them."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType

from megatron_gspo.runtime.errors import UserError


class MissingExtraError(UserError, ImportError):
    """A recipe needs an optional package that is not installed."""


def _message(module: str, feature: str, extra: str) -> str:
    return (
        f"{feature} needs the '{module}' package, which is not installed. "
        f"Install the '{extra}' extra: pip install 'megatron-gspo[{extra}]'"
        + (" (on a machine with CUDA)." if extra == "gpu" else ".")
    )


def require_extra(module: str, feature: str, *, extra: str = "gpu") -> ModuleType:
    """Import ``module`` or fail with a message naming the extra that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtraError(_message(module, feature, extra)) from e


@dataclass(frozen=True)
class Need:
    """An optional package a recipe needs, the feature that needs it and the extra with it."""

    module: str
    feature: str
    extra: str
    # False: only the nodes that serve rollouts import it, not the trainer's processes.
    trainer: bool = True

    @property
    def installed(self) -> bool:
        return importlib.util.find_spec(self.module) is not None

    @property
    def message(self) -> str:
        return _message(self.module, self.feature, self.extra)


def recipe_needs(recipe) -> list[Need]:
    """Every optional package ``recipe`` needs, installed or not."""
    needs = []
    if recipe.precision.fp8:
        feature = f"FP8 training (precision.fp8={recipe.precision.fp8})"
        needs.append(Need("transformer_engine", feature, "gpu"))
    if recipe.run.wandb_project:
        needs.append(Need("wandb", "Logging to Weights & Biases (run.wandb_project)", "wandb"))
    if recipe.data is not None and (recipe.data.path or "").endswith(".parquet"):
        needs.append(Need("pyarrow", "Parquet data (data.path)", "data"))
    if recipe.rollout.engine == "vllm":
        # The trainer talks HTTP and torch.distributed to the servers; only the machines that
        # serve need vllm (launch --role rollout checks).
        needs.append(Need("vllm", "Serving rollouts (rollout.engine: vllm)", "gpu", trainer=False))
    return needs


def check_recipe_extras(recipe) -> None:
    """Fail early, before any process group exists, when a recipe needs a missing extra."""
    for need in recipe_needs(recipe):
        if need.trainer:
            require_extra(need.module, need.feature, extra=need.extra)
