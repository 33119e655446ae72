"""Several trainer ranks on this machine for a benchmark: spawned processes in a gloo world.

A rank that fails ends the benchmark within seconds, with its error: the others, left waiting
in a collective for it, are killed rather than waited for."""

from __future__ import annotations

import os
import queue
import time
import traceback

# How often the parent looks for a rank that died without a word (killed, a crash in C).
POLL_S = 1.0


def join_world(rank: int, world: int, port: int) -> None:
    """In a spawned rank: one thread, the environment torchrun would set, the gloo group."""
    from megatron_gspo.runtime.procs import local_world_env

    os.environ.update(local_world_env(rank, world, port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _rank_main(target, rank: int, world: int, port: int, args: tuple, results, errors) -> None:
    try:
        target(rank, world, port, *args, results)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise


def run_ranks(target, world: int, *args, timeout_s: float = 3600.0):
    """Run ``target(rank, world, port, *args, results)`` on ``world`` ranks; returns the first
    object a rank puts on ``results``. Raises ``SystemExit`` naming the rank and its error as
    soon as one fails or dies, or after ``timeout_s``."""
    import torch.multiprocessing as mp

    from megatron_gspo.runtime.procs import free_port

    ctx = mp.get_context("spawn")
    results, errors, port = ctx.Queue(), ctx.Queue(), free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(target, r, world, port, args, results, errors))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                got = results.get(timeout=POLL_S)
                break
            except queue.Empty:
                pass
            failure = _failure(procs, errors)
            if failure is None and time.monotonic() > deadline:
                failure = f"no result from {world} rank(s) within {timeout_s:.0f} s"
            if failure is not None:
                raise SystemExit(f"benchmark ranks failed: {failure}")
        for p in procs:
            p.join(timeout=120)
        failure = _failure(procs, errors)
        if failure is not None:
            raise SystemExit(f"benchmark ranks failed after their result: {failure}")
        return got
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)


def _failure(procs, errors) -> str | None:
    """What failed, once a rank has: every rank's error and every silent exit (a rank that died
    without a word is usually why its peers then raised), or None while all are well."""
    first: list = []
    try:
        first.append(errors.get_nowait())
    except queue.Empty:
        pass
    if not first and all(p.exitcode in (None, 0) for p in procs):
        return None
    time.sleep(2 * POLL_S)  # the others' errors, which a dead peer sets off
    while True:
        try:
            first.append(errors.get_nowait())
        except queue.Empty:
            break
    raised = {rank for rank, _ in first}
    silent = [
        f"rank {r} exited with code {p.exitcode} and no Python error"
        for r, p in enumerate(procs)
        if p.exitcode not in (None, 0) and r not in raised
    ]
    return "\n".join(silent + [f"rank {rank} raised:\n{trace}" for rank, trace in sorted(first)])
