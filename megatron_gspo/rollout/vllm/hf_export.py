"""Trainer side: the disk fallback's checkpoint, the trainer's weights as a Hugging Face
directory."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

from megatron_gspo.config import ModelConfig

__all__ = ["write_hf_checkpoint"]


def write_hf_checkpoint(
    directory: Path,
    model_config: ModelConfig,
    hf_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    dtype: torch.dtype,
) -> None:
    """Write ``(HF name, tensor)`` pairs, in model order, as an HF safetensors checkpoint.

    ``directory`` must not exist; it appears (by rename) only once complete, so a server never
    reads a partial checkpoint.
    """
    from megatron_gspo.model.hf_config import hf_config_from_model_config
    from megatron_gspo.weights.hf import HFMapping
    from megatron_gspo.weights.safetensors_io import ShardedSafetensorsWriter, fsync_dir

    mapping = HFMapping(model_config)
    tmp = directory.parent / f".{directory.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        planned = [(h, shape, mapping.hf_dtype(h, dtype)) for h, shape in mapping.hf_shapes.items()]
        writer = ShardedSafetensorsWriter(tmp, planned, max_shard_size=4 << 30)
        try:
            for name, tensor in hf_tensors:
                writer.write(name, tensor.to(device="cpu", dtype=mapping.hf_dtype(name, dtype)))
            writer.close()
        except BaseException:
            writer.abort()
            raise
        config = hf_config_from_model_config(model_config)
        config["dtype"] = config["torch_dtype"] = str(dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        os.replace(tmp, directory)
        fsync_dir(directory.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
