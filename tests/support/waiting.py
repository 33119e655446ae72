"""Polling for what another thread does, with a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable


def eventually(check: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Whether ``check()`` became true within ``timeout_s`` (polled every 10 ms)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
