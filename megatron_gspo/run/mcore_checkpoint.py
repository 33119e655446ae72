"""Megatron-Core's distributed checkpointing as this project runs it: the fixes it needs around
torch Adam's state, the writer helper that survives SIGTERM, and ``common.pt`` across the
megatron-core range. :mod:`.checkpoint` writes and loads through these."""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

import torch

from megatron_gspo.trainer.policy import Policy

__all__ = [
    "COMMON_FILE",
    "SaveStrategy",
    "async_save_kwargs",
    "init_optimizer_state",
    "keep_torch_adam_step",
    "start_writer_queue_ignoring_sigterm",
    "unshare_adam_steps",
    "write_common_file",
]

# megatron-core's name for the non-tensor part of a checkpoint (its COMMON_STATE_FNAME).
COMMON_FILE = "common.pt"


def init_optimizer_state(policy: Policy) -> None:
    """Create empty Adam states so Megatron can build the state dict to load into.

    A fresh optimizer has none until its first step, and Megatron's torch-Adam fallback does
    not create them (its Transformer Engine and apex paths do).
    """
    for opt in getattr(policy.optimizer, "chained_optimizers", [policy.optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)


def keep_torch_adam_step(policy: Policy) -> None:
    """Work around Megatron-Core 0.16 loading ``fully_reshardable`` distributed-optimizer states
    into torch's Adam (its fallback without Transformer Engine or apex): it restores Adam's
    per-parameter ``step`` from the param groups, then copies every state tensor from the
    checkpoint, ``step`` included, which the checkpoint keeps elsewhere (a KeyError). The
    copy of ``step`` onto itself is what the loader means."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(policy.optimizer, "chained_optimizers", [policy.optimizer]):
        if not isinstance(opt, DistributedOptimizer) or getattr(opt, "_gspo_step_kept", False):
            continue
        original = opt._set_main_param_and_optimizer_states

        def set_states(model_param, tensors, opt=opt, original=original):
            group, order = opt.model_param_group_index_map[model_param]
            main = opt.optimizer.param_groups[group]["params"][order]
            step = opt.optimizer.state[main].get("step")
            if step is not None and "step" not in tensors:
                tensors = {**tensors, "step": step}
            original(model_param, tensors)

        opt._set_main_param_and_optimizer_states = set_states
        opt._gspo_step_kept = True


def unshare_adam_steps(policy: Policy) -> None:
    """Give every parameter its own Adam ``step`` again after a load.

    Megatron-Core 0.16's distributed optimizer restores torch Adam's per-parameter ``step`` as
    one tensor object shared by all parameters; torch increments each parameter's ``step`` in
    place, so the shared one would advance once per parameter per update and skew Adam's bias
    correction from the first step after a resume."""
    for opt in getattr(policy.optimizer, "chained_optimizers", [policy.optimizer]):
        for state in opt.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


_WRITER_MANAGER = None


def _writer_manager_init(parent_pid: int) -> None:
    from megatron_gspo.runtime.procs import die_with_parent

    die_with_parent(parent_pid)


def start_writer_queue_ignoring_sigterm() -> None:
    """Start Megatron's checkpoint-writer results queue in a helper that survives SIGTERM
    and dies with the trainer.

    The first ``dist_checkpointing.save`` starts a multiprocessing ``Manager`` process and keeps
    it. Slurm signals every process of a job (requeue, pre-emption, scancel), so that helper
    would die with the SIGTERM whose point is to let the trainer save, and that save would fail
    on a broken pipe; and after a SIGKILL of the trainer it would live on, orphaned. The
    manager started here ignores SIGTERM and is killed by the kernel when the trainer exits.
    """
    global _WRITER_MANAGER
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if _WRITER_MANAGER is not None or filesystem_async._results_queue is not None:
        return
    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(initializer=_writer_manager_init, initargs=(os.getpid(),))
    _WRITER_MANAGER = manager
    filesystem_async._results_queue = manager.Queue()


def write_common_file(directory: Path) -> None:
    """Give a checkpoint the ``common.pt`` that megatron-core before 0.19 reads.

    megatron-core 0.19 keeps the non-tensor state (the optimizer's param groups, ...) inside
    the torch_dist files and writes no common.pt; 0.16.1 to 0.18 read that state from
    common.pt alone and fail without it. The same state, copied out, lets a run saved under
    0.19 resume under any version of the range; 0.19 reads common.pt first when it exists.
    """
    if (directory / COMMON_FILE).exists():  # written by megatron-core before 0.19
        return
    from megatron.core.dist_checkpointing.serialization import load_common_state_dict

    torch.save(load_common_state_dict(str(directory)), directory / COMMON_FILE)


def async_save_kwargs() -> dict[str, Any]:
    """``dist_checkpointing.save``'s arguments for a save whose writer is Megatron's own.

    From 0.19 the asynchronous save defaults to nvidia-resiliency-ext's writer (a GPU package
    this project does not install); its requests would also belong to that package's queue,
    not the ``AsyncCallsQueue`` :mod:`.checkpoint` schedules them on. Older versions have only
    Megatron's writer and no argument to choose it.
    """
    from megatron.core import dist_checkpointing

    if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters:
        return {"async_strategy": "mcore"}
    return {}


class SaveStrategy:
    """Megatron's default save strategy, told that the saves through it have the same structure
    (Megatron-LM's ``--ckpt-assume-constant-structure``): from the third save on it reuses the
    first ones' save plans and global metadata instead of planning and gathering them again,
    and only the first validates the sharding. Megatron never checks a reused plan against the
    state again, so the structure (every key, shape and dtype) is compared here at each save,
    and a change starts a fresh strategy: the optimizer's state is empty until its first step,
    and a plan made before it would leave Adam's moments out of every later checkpoint."""

    def __init__(self) -> None:
        self._structure: object = None
        self._strategy: Any = None

    def __call__(self, sharded: dict) -> tuple[Any, bool]:
        """The strategy for saving ``sharded``, and whether that save validates the sharding."""
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.serialization import (
            get_default_save_sharded_strategy,
        )

        structure = sorted(
            (v.key, str(getattr(v, "global_shape", "")), str(getattr(v, "dtype", "")))
            for v in nested_values(sharded)
            if hasattr(v, "key")
        )
        if structure == self._structure:
            return self._strategy, False
        self._structure, self._strategy = structure, get_default_save_sharded_strategy()
        self._strategy.use_cached_ckpt_structure = True
        return self._strategy, True
