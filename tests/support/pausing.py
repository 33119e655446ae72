"""Pausing a process tree (SIGSTOP) while something slower than its run happens beside it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import psutil


@contextlib.contextmanager
def paused(pid: int) -> Iterator[None]:
    """``pid`` and every process under it suspended for the block, and resumed on leaving it
    whatever happened (those suspended before a failure included)."""
    root = psutil.Process(pid)
    stopped: list[psutil.Process] = []
    try:
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.suspend()
                stopped.append(p)
        yield
    finally:
        for p in stopped:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.resume()
