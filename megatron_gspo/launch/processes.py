"""The side effects of launch: waiting for servers, running processes with signals passed on."""

from __future__ import annotations

import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

import click

from megatron_gspo.launch.errors import LaunchError

__all__ = ["run_forwarding_term", "wait_for_servers"]


def wait_for_servers(
    urls: Sequence[str], *, timeout_s: float, interval_s: float = 5.0, log=print
) -> None:
    """Block until every server answers ``GET /health`` with 200; vLLM only does once the
    model is loaded, so a trainer that starts after this never sees a refused connection."""
    pending = list(urls)
    deadline = time.monotonic() + timeout_s
    last_report = 0.0
    while pending:
        still = []
        for url in pending:
            try:
                with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=5) as r:
                    ok = r.status == 200
            except (urllib.error.URLError, OSError):
                ok = False
            if not ok:
                still.append(url)
        pending = still
        if not pending:
            break
        now = time.monotonic()
        if now >= deadline:
            raise LaunchError(
                f"rollout servers not healthy after {timeout_s:.0f}s: {', '.join(pending)} "
                "(see the rollout logs)"
            )
        if now - last_report >= 60:
            log(f"launch: waiting for {len(pending)} rollout server(s): {', '.join(pending)}")
            last_report = now
        time.sleep(interval_s)
    log(f"launch: {len(urls)} rollout server(s) healthy")


def run_forwarding_term(
    commands: Sequence[tuple[list[str], dict[str, str]]], *, workers_only: bool
) -> int:
    """Run ``(cmd, env)`` processes and pass SIGTERM/SIGINT on; returns the first non-zero
    exit status (0 when all succeed). When one process exits, the others are stopped.

    With ``workers_only`` (torchrun) the signal goes to each process's children, the trainer
    ranks, and not to torchrun: the ranks checkpoint and exit 0, and torchrun then exits 0 as
    it would after any successful run. Signalling torchrun itself starts its shutdown timer.
    """
    import psutil

    procs = [subprocess.Popen(cmd, env=env) for cmd, env in commands]

    def send(signum: int) -> None:
        for proc in procs:
            targets = []
            if workers_only:
                try:
                    targets = psutil.Process(proc.pid).children(recursive=False)
                except psutil.NoSuchProcess:
                    targets = []
            for p in targets or [proc]:
                try:
                    p.send_signal(signum)
                except (psutil.NoSuchProcess, ProcessLookupError):
                    pass

    def forward(signum: int, _frame) -> None:
        click.echo(f"launch: got {signal.Signals(signum).name}, forwarding", err=True)
        send(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while all(p.poll() is None for p in procs):
            time.sleep(0.2)
        first = next(p for p in procs if p.returncode is not None)
        if any(p.poll() is None for p in procs):
            click.echo(
                f"launch: process {first.pid} exited ({first.returncode}); stopping the others",
                err=True,
            )
            send(signal.SIGTERM)
        codes = [p.wait() for p in procs]
        return next((c for c in codes if c), 0)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
