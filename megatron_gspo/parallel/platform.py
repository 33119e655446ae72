"""Let the real Megatron-Core run on a machine without CUDA.

Megatron-Core assumes a GPU in a few scattered places: tensors created with ``device="cuda"``,
``torch.cuda.current_device()`` used as a device, the CUDA RNG state behind its RNG tracker,
``torch.cuda.synchronize()`` in the pipeline p2p code, ``pin_memory=True`` host tensors,
``Tensor.type()`` compared with
``'torch.cuda.FloatTensor'`` in the optimizer and gradient clipping, and one name
(``te_general_gemm``) that the MoE router reads without defining it when Transformer Engine
is missing. On a CPU-only
machine :func:`enable_cpu_platform` redirects exactly these to the CPU, so tests and the embedded
recipe exercise Megatron's own model, router, expert dispatch and pipeline schedule rather than
a re-implementation. With CUDA available it does nothing.

It is applied in one place, :func:`megatron_gspo.parallel.setup.init_parallel`, and is
idempotent. What it changes is process-wide (a torch function mode on the stack and a handful of
patched attributes), which is why callers never apply it themselves. The measurements behind the
list of redirections are in ``shared/facts/cpu-megatron.md``.

The torch function mode sees every torch call made while it is on the stack, tensor methods
included: a Python call each, which on the tiny recipe's step was most of the step's time. The
CUDA device arguments it rewrites are in construction, the optimizer, the schedules' set-up,
checkpoint loading and the distributed optimizer's state dict, none in the model's forward,
its backward, a decode step or ``dist_checkpointing.save`` (those use the patched
``current_device`` and their inputs' devices). So these run without it
(:func:`cuda_redirect_suspended`): Megatron's ``forward_step`` and ``backward_step`` of every
schedule, the embedded engine's generation, and checkpoint saves. ``SCOPED = False`` keeps it
everywhere (the behaviour before, which ``benchmarks/step_time.py`` measures against).
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["cpu_platform_active", "cuda_redirect_suspended", "enable_cpu_platform"]

# Whether the hot paths run without the device-rewriting mode (see the module's docstring).
SCOPED = True

_CPU = torch.device("cpu")
_MODE: _CudaToCpuMode | None = None


def _is_cuda(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    # A bare integer is how Megatron spells "the current CUDA device" (torch.cuda.current_device).
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU in every torch call made while it is active.

    One mode covers the ~60 ``device="cuda"`` sites in megatron/core instead of patching each.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Megatron's optimizer and grad clipping assert 'torch.cuda.FloatTensor' and kin.
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if "cuda" not in name else name
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": _CPU}
        if kwargs.get("pin_memory"):
            # Pinned host memory only exists beside a GPU (Megatron pins the index tensor it
            # moves to the GPU when splitting RoPE over context-parallel ranks).
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


def _cpu_rng_get_state(device: object = None, clone: bool = False, graph_safe: bool = False):
    return torch.get_rng_state()


def _cpu_rng_set_state(new_state: torch.Tensor, device: object = -1, graph_safe: bool = False):
    torch.set_rng_state(new_state)


def _noop(*args, **kwargs) -> None:
    return None


class _HostStream:
    """What Megatron-Core asks of a CUDA stream, on the host: everything is already ordered."""

    wait_event = wait_stream = synchronize = record_event = staticmethod(_noop)

    def __enter__(self) -> _HostStream:
        return self

    def __exit__(self, *exc) -> None:
        return None


def cpu_platform_active() -> bool:
    return _MODE is not None


@contextlib.contextmanager
def cuda_redirect_suspended():
    """Torch calls in this scope are not rewritten (a hot path that needs no rewriting)."""
    from torch.overrides import _get_current_function_mode, _pop_mode_temporarily

    if not SCOPED or _MODE is None or _get_current_function_mode() is not _MODE:
        yield
        return
    with _pop_mode_temporarily():
        yield


def _suspending(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with cuda_redirect_suspended():
            return fn(*args, **kwargs)

    run.__wrapped_by_gspo__ = True
    return run


def _redirecting(fn):
    """``fn`` with the mode back on, for the few calls inside the hot paths that need it."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        from torch.overrides import _get_current_function_mode

        if _MODE is None or _get_current_function_mode() is _MODE:
            return fn(*args, **kwargs)
        with _MODE:
            return fn(*args, **kwargs)

    run.__wrapped_by_gspo__ = True
    return run


def enable_cpu_platform() -> bool:
    """Redirect Megatron-Core's CUDA-only calls to the CPU; returns whether it did anything."""
    global _MODE
    if torch.cuda.is_available():
        return False
    if _MODE is not None:
        return True

    # The RNG tracker forks the "CUDA" generator around tensor-parallel regions (dropout,
    # initialization); on the CPU the default CPU generator plays that role.
    import megatron.core.tensor_parallel.random as mrandom

    mrandom._get_cuda_rng_state = _cpu_rng_get_state
    mrandom._set_cuda_rng_state = _cpu_rng_set_state
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    # Not torch.manual_seed: that calls torch.cuda.manual_seed_all, which must stay lazy.
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))

    torch.cuda.current_device = lambda: _CPU
    torch.cuda.synchronize = _noop
    # megatron-core 0.19's gradient buffers wait on the current stream for CUDA-graph replays.
    torch.cuda.current_stream = lambda device=None: _HostStream()

    # Referenced by the router when Transformer Engine is absent, but only imported with it.
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    # The schedules' forward and backward of one micro-batch: the model, the loss and
    # autograd, which rewrite nothing (module-level names: every schedule calls them so).
    import megatron.core.pipeline_parallel.schedules as schedules

    for name in ("forward_step", "backward_step"):
        fn = getattr(schedules, name)
        if not getattr(fn, "__wrapped_by_gspo__", False):
            setattr(schedules, name, _suspending(fn))
    # Inside them, the rotary embedding's context-parallel split pins host memory.
    import megatron.core.models.common.embeddings.rope_utils as rope_utils
    import megatron.core.models.common.embeddings.rotary_pos_embedding as rotary

    for module in (rope_utils, rotary):
        fn = getattr(module, "get_pos_emb_on_this_cp_rank", None)
        if fn is not None and not getattr(fn, "__wrapped_by_gspo__", False):
            module.get_pos_emb_on_this_cp_rank = _redirecting(fn)

    # Megatron's RNG tracker warns on every fork that the CPU state moved, which on this
    # platform is the point of the fork; keep the log readable.
    logging.getLogger(mrandom.__name__).setLevel(logging.ERROR)

    _MODE = _CudaToCpuMode()
    _MODE.__enter__()
    return True
