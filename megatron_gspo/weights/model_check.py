"""Whether a checkpoint was written for a model: its tensors' shapes from Megatron's metadata,
and the model config it recorded (a training checkpoint's manifest, or the ``model_config.yaml``
of a converted one). Used where a checkpoint is loaded (the policy, resuming) and by
``validate``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from megatron_gspo.config import ModelConfig
from megatron_gspo.runtime.errors import InputError

_NOT_MODEL = re.compile(r"(chained_\d+\.)?optimizer\.|reference\.")


class ModelMismatchError(InputError):
    """A checkpoint written for another model than the recipe's."""


def model_mismatch(
    directory: Path,
    expected: dict[str, tuple[int, ...]],
    model: ModelConfig,
    *,
    recorded: dict[str, Any] | None,
    any_vocab_rows: bool,
) -> str | None:
    """Why the checkpoint in ``directory`` does not fit a model whose tensors have the
    ``expected`` global shapes, or None.

    The shapes are read from Megatron's checkpoint metadata, so any checkpoint is compared;
    where the checkpoint recorded its model (``recorded``: training checkpoints, and
    ``model_config.yaml`` of converted ones), the message names the keys that differ.
    ``any_vocab_rows``: the vocabulary's padded rows may differ (``run.init_from``)."""
    from megatron_gspo.weights.dist_ckpt import _saved_shapes
    from megatron_gspo.weights.shards import VOCAB_TENSORS

    # The optimizer's state (under "chained_<i>.optimizer." in Megatron's dp_reshardable
    # format) and the frozen reference policy are not the model's.
    saved = {k: v for k, v in _saved_shapes(directory).items() if not _NOT_MODEL.match(k)}
    first = None
    for key, shape in expected.items():
        have = saved.get(key)
        rows = 1 if any_vocab_rows and key in VOCAB_TENSORS else 0
        if have is None or have[rows:] != shape[rows:]:
            first = f"{key}: {list(have) if have else 'absent'} saved, {list(shape)} here"
            break
    if first is None:
        extra = sorted(set(saved) - set(expected))
        if not extra:
            return None
        first = f"{extra[0]}: saved, absent here"
    fields = _differing_fields(recorded, model) if recorded else []
    why = f"it was written for {', '.join(fields)}" if fields else "its tensors differ"
    return f"checkpoint {directory} does not fit the recipe's model: {why} ({first})"


def _differing_fields(recorded: dict[str, Any], model: ModelConfig) -> list[str]:
    now = model.model_dump(mode="json")
    return [
        f"model.{k} {recorded[k]!r}, the recipe says {now[k]!r}"
        for k in now
        if k in recorded and recorded[k] != now[k]
    ]


def module_shapes(module) -> dict[str, tuple[int, ...]]:
    """The global shape of every tensor ``module`` saves in a distributed checkpoint."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    sharded = module.sharded_state_dict()
    apply_factories(sharded)
    return {
        v.key: tuple(v.global_shape) for v in nested_values(sharded) if isinstance(v, ShardedTensor)
    }


def check_checkpoint_model(
    directory: Path, policy, *, recorded: dict[str, Any] | None, any_vocab_rows: bool = False
) -> None:
    """Refuse, on every rank, a checkpoint written for another model (collective: each rank
    knows the shapes of its own stage)."""
    import torch.distributed as dist

    parts: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(parts, module_shapes(policy.model))
    expected = {k: v for part in parts for k, v in part.items()}
    why = model_mismatch(
        directory,
        expected,
        policy.recipe.model,
        recorded=recorded,
        any_vocab_rows=any_vocab_rows,
    )
    if why:
        raise ModelMismatchError(why)


def recorded_model(directory: Path) -> dict[str, Any] | None:
    """The model a checkpoint says it holds: a training checkpoint's manifest, or the
    ``model_config.yaml`` that ``convert hf-to-megatron`` writes."""
    from megatron_gspo.weights.manifest import read_manifest

    manifest = read_manifest(directory)
    if manifest is not None:
        return manifest.get("model")
    config = directory / "model_config.yaml"
    if config.is_file():
        return (yaml.safe_load(config.read_text()) or {}).get("model")
    return None
