"""Run a function on several gloo ranks (processes on this machine) and collect its results."""

from __future__ import annotations

import os
import pickle
import queue as queue_module
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_gspo.runtime.procs import free_port, local_world_env


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue) -> None:
    os.environ.update(local_world_env(rank, world_size, port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # Plain pickle: torch.multiprocessing would hand over shared memory that dies with us.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - the parent re-raises with the child's traceback
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# Ranks are forked from a server process that has imported these once, instead of each
# spawned rank importing torch and Megatron-Core again (~3.5 s a rank, most of a test's time).
# A fork copies no state but the imported modules: every rank starts as a fresh process would.
_PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron_gspo.trainer.policy"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class _PortTaken(RuntimeError):
    """Rank 0's store could not listen: the free port was taken before it bound it."""


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 600
) -> list:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    ``fn`` must be importable (module level) and its result picklable; tensors come back on CPU.
    A port found free can be taken by another process (CI runs two test sessions side by side)
    before rank 0 listens on it; the ranks then fail in ``init_process_group``, before ``fn``
    ran, and are started again on another port.
    """
    for attempt in range(3):
        try:
            return _run_once(fn, world_size, args, timeout)
        except _PortTaken:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _run_once(fn: Callable[..., Any], world_size: int, args: tuple, timeout: float) -> list:
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        deadline = time.monotonic() + timeout
        while len(results) < world_size:
            try:
                rank, status, payload = queue.get(timeout=1.0)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if errors and time.monotonic() > deadline:
                    break
                if dead or time.monotonic() > deadline:
                    why = f"ranks {dead} died" if dead else f"timed out after {timeout} s"
                    errors.append(f"no result from every rank: {why}")
                    break
                continue
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                # The first rank to report is often a victim of another's failure (a reset
                # connection); give the others a moment to report the cause.
                deadline = min(deadline, time.monotonic() + 10)
                if len(errors) + len(results) == world_size:
                    break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else timeout)
            if p.is_alive():
                p.kill()
    if errors:
        text = "\n".join(errors)
        if "EADDRINUSE" in text and "init_process_group" in text:
            raise _PortTaken(text)
        raise RuntimeError(text)
    return [results[r] for r in range(world_size)]
