"""Helper processes that end with the process that started them.

A trainer killed with SIGKILL cannot clean up, so every helper it starts (reward workers, the
generation worker, Megatron's checkpoint-writer queue) asks the kernel to kill it when its
parent dies (Linux ``PR_SET_PDEATHSIG``; elsewhere that part does nothing). Helpers also
ignore SIGTERM and SIGINT: Slurm (requeue, pre-emption, scancel) and a terminal's Ctrl-C signal
every process of the job, and those signals are meant for the trainer, which still needs its
helpers to finish the step and save. A helper ends when the trainer stops it or exits.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys

__all__ = ["die_with_parent", "free_port", "local_world_env"]

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Call in a child process started by ``parent_pid``: the kernel sends it ``sig`` when its
    parent exits, and SIGTERM/SIGINT no longer end it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    # The parent may have died before the call: then nobody would send the signal.
    if os.getppid() != parent_pid:
        os._exit(1)


def free_port() -> int:
    """A TCP port of this host that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_world_env(rank: int, world: int, port: int) -> dict[str, str]:
    """What torchrun would set for ``rank`` of a ``world`` of processes on this host."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        # Under torchrun, children inherit this: their rendezvous would then wait, as a
        # client, for torchrun's agent store on a port where no one listens.
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }
