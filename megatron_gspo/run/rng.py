"""Every random generator a training process draws from, captured and restored as one state.

An exact resume needs all of them, not only torch's default CPU generator: Megatron-Core's RNG
tracker keeps its own named states (forked around tensor-parallel regions; on the CPU platform
they are CPU generator states), the CUDA generators where there is a GPU, and Python's and
NumPy's global generators for anything user code (rewards, datasets) draws. The rollout engines
seed a generator of their own per step, so they need nothing here.

The state holds only tensors, numbers and tuples: it loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from megatron.core import tensor_parallel

__all__ = ["get_rng_state", "set_rng_state"]


def _numpy_state() -> tuple:
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss


def _set_numpy_state(state: tuple) -> None:
    name, keys, pos, has_gauss, gauss = state
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


def get_rng_state() -> dict[str, Any]:
    """This process's generator states (copies: drawing afterwards does not change them)."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": _numpy_state(),
        "megatron": {
            k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()
        },
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`get_rng_state` returned (in a process of the same layout)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    _set_numpy_state(state["numpy"])
    tensor_parallel.get_cuda_rng_tracker().set_states(
        {k: v.clone() for k, v in state["megatron"].items()}
    )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
