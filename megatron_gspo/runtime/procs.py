"""Helper processes that end with the process that started them.

A trainer killed with SIGKILL cannot clean up, so every helper it starts (reward workers, the
generation worker, Megatron's checkpoint-writer queue) asks the kernel to kill it when its
parent dies (Linux ``PR_SET_PDEATHSIG``; elsewhere that part does nothing). Helpers also
ignore SIGTERM and SIGINT: Slurm (requeue, pre-emption, scancel) and a terminal's Ctrl-C signal
every process of the job, and those signals are meant for the trainer, which still needs its
helpers to finish the step and save. A helper ends when the trainer stops it or exits.

Exiting needs one more step: Python's multiprocessing, at interpreter exit, sends its daemonic
children SIGTERM and then waits for them, which a helper ignores; a trainer leaving by an
exception (one that never reached its helpers' ``close``) would wait forever. Helpers started
through :func:`kill_at_exit` are killed before that wait.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import socket
import sys
import weakref

__all__ = [
    "die_with_parent",
    "exiting",
    "forks_die_with_parent",
    "free_port",
    "kill_at_exit",
    "local_world_env",
]

_HELPERS: weakref.WeakSet = weakref.WeakSet()
_exiting = False


def exiting() -> bool:
    """Whether the interpreter is exiting and its helpers are being killed: whoever would
    replace a helper that died (the worker pools) must not start a new one now."""
    return _exiting


def _kill_helpers() -> None:
    global _exiting
    _exiting = True
    for proc in list(_HELPERS):
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


def kill_at_exit(proc) -> None:
    """SIGKILL the started ``multiprocessing`` process ``proc`` at interpreter exit if it still
    runs (before multiprocessing waits for it)."""
    if not _HELPERS:
        # atexit runs handlers last-registered first: this runs before multiprocessing's own,
        # which it registered when imported.
        atexit.unregister(_kill_helpers)
        atexit.register(_kill_helpers)
    _HELPERS.add(proc)


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


# Whether a process forked now is a helper that must end with its parent (the flag is copied
# into the child, so what the child forks in turn ends with it), and who its parent is.
_FORKS_DIE = False
_FORKING_PID = 0


def _before_fork() -> None:
    global _FORKING_PID
    _FORKING_PID = os.getpid()


def _after_fork_in_child() -> None:
    if _FORKS_DIE:
        die_with_parent(_FORKING_PID)


_HOOKED = False


@contextlib.contextmanager
def forks_die_with_parent():
    """Processes forked in this scope by code we do not control (Megatron-Core's checkpoint
    writers fork without an initializer) end with their parent, as :func:`die_with_parent`
    children do, and so do the processes they fork."""
    global _FORKS_DIE, _HOOKED
    if not _HOOKED:
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
        _HOOKED = True
    previous, _FORKS_DIE = _FORKS_DIE, True
    try:
        yield
    finally:
        _FORKS_DIE = previous


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
