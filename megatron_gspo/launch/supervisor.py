"""Servers kept running by whoever started them: a server that exits is started again on the
same port, with a backoff and a cap; SIGTERM or SIGINT to the supervisor stops every server it
started, each whole process tree.

``megatron-gspo launch --role rollout`` supervises a node's vLLM servers this way, and
``tools/serve_vllm.py --servers N`` those of a single machine. The trainer only routes and
syncs (:mod:`megatron_gspo.rollout.vllm.fleet`): a restarted server comes back with the weights
it was started from, so the trainer sees it stale and brings it to the current version before
it serves again.

Each line it logs names the server (its URL) and what happened: started (pid), ready
(``/health`` answers), exited (status), restarting (after how long), given up.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ServerSpec", "Supervisor"]


@dataclass(frozen=True)
class ServerSpec:
    """One server: its command line and environment, the URL it answers at, its log file."""

    cmd: Sequence[str]
    env: Mapping[str, str]
    url: str
    log: Path | None = None
    # Run in the child before exec (CPU pinning, say).
    preexec: Callable[[], None] | None = None
    # Run with the server's pid each time it becomes ready (after every restart).
    on_ready: Callable[[int], object] | None = None
    # An environment variable set, for each start, to a fresh directory removed once that
    # start's process tree is gone: vLLM's ZMQ sockets (VLLM_RPC_BASE_PATH), which a killed
    # server never removes and which pile up in /tmp by the thousand over restarts.
    scratch_env: str | None = None


@dataclass
class _Running:
    spec: ServerSpec
    proc: subprocess.Popen | None = None
    starts: list[float] = field(default_factory=list)
    ready: bool = False
    next_start: float = 0.0
    given_up: bool = False
    scratch: str | None = None


class Supervisor:
    """Starts ``specs`` and keeps them running until :meth:`stop` (or SIGTERM/SIGINT to
    :meth:`run`). A server that exits is started again after ``backoff_s`` (doubling with each
    restart, at most ``max_backoff_s``); one that exited ``max_restarts`` times within
    ``window_s`` is given up (logged), and the others go on."""

    def __init__(
        self,
        specs: Sequence[ServerSpec],
        *,
        log: Callable[[str], None] = print,
        backoff_s: float = 2.0,
        max_backoff_s: float = 60.0,
        max_restarts: int = 5,
        window_s: float = 600.0,
        health_interval_s: float = 2.0,
    ) -> None:
        self.servers = [_Running(s) for s in specs]
        self.log = log
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.max_restarts, self.window_s = max_restarts, window_s
        self.health_interval_s = health_interval_s
        self._stop = threading.Event()
        self.stop_reason = ""

    # -- one server --------------------------------------------------------------------------

    def _start(self, r: _Running) -> None:
        spec = r.spec
        env = dict(spec.env)
        if spec.scratch_env is not None:
            r.scratch = tempfile.mkdtemp(prefix="gspo-server-")
            env[spec.scratch_env] = r.scratch
        out = open(spec.log, "ab") if spec.log is not None else None  # noqa: SIM115
        try:
            r.proc = subprocess.Popen(
                list(spec.cmd),
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT if out is not None else None,
                # Its own process group: a stop reaches vLLM's engine and workers too.
                start_new_session=True,
                preexec_fn=spec.preexec,
            )
        finally:
            if out is not None:
                out.close()
        r.ready = False
        r.starts.append(time.monotonic())
        self.log(f"server {spec.url}: started (pid {r.proc.pid})")

    def _healthy(self, url: str) -> bool:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False

    def _check(self, r: _Running, now: float) -> None:
        if r.given_up:
            return
        if r.proc is None:
            if now >= r.next_start:
                self._start(r)
            return
        code = r.proc.poll()
        if code is None:
            if not r.ready and self._healthy(r.spec.url):
                r.ready = True
                self.log(f"server {r.spec.url}: ready (pid {r.proc.pid})")
                if r.spec.on_ready is not None:
                    try:
                        r.spec.on_ready(r.proc.pid)
                    except Exception as e:  # noqa: BLE001 - a tuning step never stops serving
                        self.log(f"server {r.spec.url}: on ready: {type(e).__name__}: {e}")
            return
        self._kill_group(r.proc)  # what it left behind: vLLM's engine and workers
        self._gone(r)
        recent = [t for t in r.starts if now - t < self.window_s]
        if len(recent) > self.max_restarts:
            r.given_up = True
            self.log(
                f"server {r.spec.url}: exited (status {code}); given up after "
                f"{len(recent)} starts in {self.window_s:.0f} s"
            )
            return
        delay = min(self.max_backoff_s, self.backoff_s * 2 ** max(0, len(recent) - 1))
        r.next_start = now + delay
        self.log(f"server {r.spec.url}: exited (status {code}); restarting in {delay:.0f} s")

    # -- all of them -------------------------------------------------------------------------

    def run(self, *, handle_signals: bool = True) -> int:
        """Start every server and supervise until stopped; returns 0 after a stop, 1 when every
        server was given up."""
        old = {}
        if handle_signals:
            for s in (signal.SIGTERM, signal.SIGINT):
                old[s] = signal.signal(s, self._on_signal)
        try:
            for r in self.servers:
                self._start(r)
            while not self._stop.wait(self.health_interval_s if self._any_unready() else 0.5):
                now = time.monotonic()
                for r in self.servers:
                    self._check(r, now)
                if all(r.given_up for r in self.servers):
                    self.log("supervisor: every server was given up")
                    return 1
            return 0
        finally:
            self.stop_all()
            for s, handler in old.items():
                signal.signal(s, handler)

    def _any_unready(self) -> bool:
        return any(r.proc is not None and not r.ready for r in self.servers)

    def _on_signal(self, signum: int, _frame) -> None:
        self.stop(f"got {signal.Signals(signum).name}")

    def stop(self, reason: str = "stopped") -> None:
        self.stop_reason = reason
        self._stop.set()

    def stop_all(self, timeout_s: float = 30.0) -> None:
        """SIGTERM every server's process group, SIGKILL what is left after ``timeout_s``."""
        running = [r for r in self.servers if r.proc is not None and r.proc.poll() is None]
        if running:
            self.log(f"supervisor: stopping {len(running)} server(s) ({self.stop_reason})")
        for r in running:
            _signal_group(r.proc, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for r in running:
            try:
                r.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            self._kill_group(r.proc)
            self.log(f"server {r.spec.url}: stopped")
        for r in self.servers:
            if r.proc is not None:  # exited, not yet seen: what its group left
                self._kill_group(r.proc)
            self._gone(r)

    @staticmethod
    def _gone(r: _Running) -> None:
        """After a start's process tree is gone: what it left in its scratch directory too."""
        r.proc = None
        if r.scratch is not None:
            shutil.rmtree(r.scratch, ignore_errors=True)
            r.scratch = None

    @staticmethod
    def _kill_group(proc: subprocess.Popen) -> None:
        _signal_group(proc, signal.SIGKILL)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def pids(self) -> dict[str, int | None]:
        """The current process of every server (None: not running)."""
        return {r.spec.url: (r.proc.pid if r.proc is not None else None) for r in self.servers}


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass
