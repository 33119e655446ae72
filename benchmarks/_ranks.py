"""Several trainer ranks on this machine for a benchmark: spawned processes in a gloo world."""

from __future__ import annotations

import os


def join_world(rank: int, world: int, port: int) -> None:
    """In a spawned rank: one thread, the environment torchrun would set, the gloo group."""
    from megatron_gspo.runtime.procs import local_world_env

    os.environ.update(local_world_env(rank, world, port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def run_ranks(target, world: int, *args):
    """Run ``target(rank, world, port, *args, results)`` on ``world`` ranks; returns the first
    object a rank puts on ``results``."""
    import torch.multiprocessing as mp

    from megatron_gspo.runtime.procs import free_port

    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [
        ctx.Process(target=target, args=(r, world, port, *args, results)) for r in range(world)
    ]
    for p in procs:
        p.start()
    got = results.get(timeout=3600)
    for p in procs:
        p.join(timeout=120)
    if any(p.exitcode for p in procs):
        raise SystemExit(f"a rank of {world} failed; see the output above")
    return got
