"""Process-group set-up: the one entry point that every job and test goes through."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megatron_gspo.config import ParallelConfig
from megatron_gspo.parallel.platform import enable_cpu_platform
from megatron_gspo.runtime.errors import InputError


@dataclass(frozen=True)
class ParallelGroups:
    """The process groups the training step hands to the functions that communicate."""

    tp: dist.ProcessGroup
    pp: dist.ProcessGroup
    cp: dist.ProcessGroup
    ep: dist.ProcessGroup
    dp: dist.ProcessGroup
    # Data parallel with context parallel folded in: what loss normalization counts over.
    dp_cp: dist.ProcessGroup

    @property
    def dp_rank(self) -> int:
        return dist.get_rank(self.dp)

    @property
    def dp_size(self) -> int:
        return dist.get_world_size(self.dp)

    @property
    def dp_cp_size(self) -> int:
        return dist.get_world_size(self.dp_cp)


def _init_default_group() -> None:
    if dist.is_initialized():
        return
    # On a GPU, CPU tensors (step metrics, flags every rank agrees on) go over gloo and CUDA
    # tensors over NCCL: a default group of NCCL alone refuses the CPU ones.
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" in os.environ:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
        return
    # A plain `python` run: a world of one, whose store lives in this process. A TCP store
    # would need a free port, and one found free here can be taken by another process before
    # the store binds it (EADDRINUSE under a loaded CI). Nothing goes into os.environ: a
    # process this one starts (a test's `train`, a worker) would read RANK there and look
    # for a rendezvous that does not exist.
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def init_parallel(parallel: ParallelConfig) -> ParallelGroups:
    """Initialize torch.distributed and Megatron-Core's parallel state for ``parallel``.

    On a machine without CUDA this is where the CPU platform layer is switched on
    (see :mod:`megatron_gspo.parallel.platform`).
    """
    enable_cpu_platform()
    _init_default_group()
    world = dist.get_world_size()
    if world % parallel.model_parallel_size:
        raise InputError(
            f"world size {world} is not divisible by tensor x pipeline x context parallel size "
            f"{parallel.model_parallel_size}"
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
    )
    model_parallel_cuda_manual_seed(parallel.seed)
    return ParallelGroups(
        tp=parallel_state.get_tensor_model_parallel_group(),
        pp=parallel_state.get_pipeline_model_parallel_group(),
        cp=parallel_state.get_context_parallel_group(),
        ep=parallel_state.get_expert_model_parallel_group(),
        dp=parallel_state.get_data_parallel_group(),
        dp_cp=parallel_state.get_data_parallel_group(with_context_parallel=True),
    )


def destroy_parallel() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
