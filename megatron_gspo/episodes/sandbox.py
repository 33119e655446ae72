"""Running a model's Python code: a separate process with a wall-clock limit, a memory limit
and no network.

The code runs in a fresh interpreter (``python -I``: no user site, no environment variables
of ours) in an empty temporary directory, in a session of its own so that a timeout kills
everything it started. Before it starts, the child process:

- enters a network namespace of its own with no interface but loopback (``unshare``; as root
  ``CLONE_NEWNET``, otherwise within a new user namespace): nothing outside can be reached.
  Where the kernel allows neither, the code is not run at all and the call fails, naming why;
- limits its address space (``RLIMIT_AS``), CPU seconds, file size and open files.

What comes back is stdout and stderr, each cut to ``max_output_chars`` (stdout's start,
stderr's end, where a traceback says what went wrong). This is a sandbox
against accidents and runaway code (an infinite loop, a memory bomb, a download), not against
an adversary with kernel exploits: run untrusted models' code on machines you can afford to
lose, as for any RL-with-code setup.
"""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

__all__ = ["PythonResult", "network_isolation", "run_python"]

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class PythonResult:
    ok: bool
    output: str
    seconds: float


def _unshare_network() -> str | None:
    """Move this (single-threaded, freshly forked) process into a network namespace of its
    own; None when done, else why not."""
    libc = ctypes.CDLL(None, use_errno=True)
    for flags in (_CLONE_NEWNET, _CLONE_NEWUSER | _CLONE_NEWNET):
        if libc.unshare(flags) == 0:
            return None
    return os.strerror(ctypes.get_errno())


_isolation: str | None = "unknown"


def network_isolation() -> str | None:
    """Whether code can be run without network here: None if so, else the reason (checked
    once, in a throwaway child)."""
    global _isolation
    if _isolation == "unknown":
        pid = os.fork()
        if pid == 0:
            os._exit(0 if _unshare_network() is None else 1)
        _, status = os.waitpid(pid, 0)
        _isolation = None if os.waitstatus_to_exitcode(status) == 0 else (
            "the kernel refuses a private network namespace (unshare CLONE_NEWNET, also "
            "within a user namespace)"
        )  # fmt: skip
    return _isolation


def _limits(memory_mb: int, cpu_s: int):
    def apply() -> None:
        why = _unshare_network()
        if why is not None:
            os._exit(97)
        mem = memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 2**20, 16 * 2**20))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

    return apply


def _cut(text: str, limit: int, *, keep_end: bool = False) -> str:
    """At most ``limit`` characters of ``text``: its start, or its end (a traceback's last
    lines say what went wrong)."""
    if len(text) <= limit:
        return text
    cut = f"[{len(text) - limit} chars cut]"
    return f"{cut} ...{text[-limit:]}" if keep_end else f"{text[:limit]}... {cut}"


def run_python(
    code: str, *, timeout_s: float = 5.0, memory_mb: int = 512, max_output_chars: int = 1000
) -> PythonResult:
    """Run ``code``; ``ok`` is False for a non-zero exit, a timeout, or no isolation."""
    why = network_isolation()
    if why is not None:
        return PythonResult(False, f"python is unavailable here: {why}", 0.0)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gspo-python-") as cwd:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", code],
            cwd=cwd,
            env={"PATH": "/usr/bin:/bin", "HOME": cwd, "PYTHONIOENCODING": "utf-8"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=_limits(memory_mb, max(1, int(timeout_s) + 1)),
        )
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.communicate()
            seconds = time.monotonic() - start
            return PythonResult(False, f"timed out after {timeout_s:g} s (killed)", seconds)
    seconds = time.monotonic() - start
    text = out.decode(errors="replace")
    errors = err.decode(errors="replace")
    if proc.returncode == 97:
        return PythonResult(False, "python is unavailable here: no network isolation", seconds)
    if proc.returncode < 0:
        errors += f"\nkilled by signal {-proc.returncode} (memory or CPU limit?)"
    body = _cut(text, max_output_chars)
    if errors.strip():
        tail = _cut(errors.strip(), max_output_chars, keep_end=True)
        body += ("\n" if body else "") + "stderr:\n" + tail
    return PythonResult(proc.returncode == 0, body, seconds)
