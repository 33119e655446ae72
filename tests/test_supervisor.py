"""Whoever starts the servers supervises them (launch/supervisor.py, used by ``launch --role
rollout`` and ``tools/serve_vllm.py``): a server whose process tree is killed comes back on the
same port; one that keeps dying is given up; SIGTERM to the supervisor stops every server,
children included. Stand-in servers (tests/support/health_server.py) here; real vLLM servers in
tests/test_fleet_vllm.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from megatron_gspo.launch.supervisor import ServerSpec, Supervisor
from megatron_gspo.runtime.procs import free_port
from tests.support.runs import ROOT
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(120)


def _spec(port: int, *extra: str) -> ServerSpec:
    cmd = [sys.executable, "-m", "tests.support.health_server", str(port), *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return ServerSpec(cmd, env, f"http://127.0.0.1:{port}", scratch_env="STANDIN_SCRATCH")


def _scratch(pid: int) -> Path:
    return Path(psutil.Process(pid).environ()["STANDIN_SCRATCH"])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _tree(pid: int) -> list[int]:
    try:
        p = psutil.Process(pid)
        return [pid] + [c.pid for c in p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def test_a_killed_server_tree_comes_back_on_its_port_and_a_crashing_one_is_given_up():
    lines: list[str] = []
    good, bad = free_port(), free_port()
    sup = Supervisor(
        [_spec(good), _spec(bad, "--exit-after", "0.5")],
        log=lines.append,
        backoff_s=0.2,
        max_backoff_s=0.4,
        max_restarts=2,
        health_interval_s=0.2,
    )
    runner = threading.Thread(target=sup.run, kwargs={"handle_signals": False})
    runner.start()
    try:
        url = f"http://127.0.0.1:{good}"
        assert eventually(lambda: _healthy(url), timeout_s=20)
        first = sup.pids()[url]
        tree = _tree(first)
        assert len(tree) == 2, "the stand-in did not start its engine child"
        scratch = _scratch(first)
        assert (scratch / "engine.sock").exists()
        for pid in tree:  # what a node's OOM killer or an operator's kill -9 does
            os.kill(pid, signal.SIGKILL)
        assert eventually(lambda: sup.pids()[url] not in (None, first), timeout_s=20)
        assert eventually(lambda: _healthy(url), timeout_s=20), "not back on its port"
        # What the killed one left is gone; the new one has its own.
        assert not scratch.exists(), "a killed server's sockets were left behind"
        scratch = _scratch(sup.pids()[url])
        assert (scratch / "engine.sock").exists()
        assert eventually(lambda: any("given up" in line for line in lines), timeout_s=30)
        assert _healthy(url), "the other server's troubles stopped this one"
    finally:
        sup.stop()
        runner.join(timeout=60)
    assert not scratch.exists(), "a stopped server's sockets were left behind"
    text = "\n".join(lines)
    for said in (
        f"server {url}: started",
        f"server {url}: ready",
        "exited (status -9)",
        "restarting in",
        f"server http://127.0.0.1:{bad}: exited (status 3); given up",
    ):
        assert said in text, f"{said!r} not logged:\n{text}"  # fmt: skip
    assert not _healthy(url), "a server outlived its supervisor's stop"


def test_sigterm_to_the_supervisor_stops_every_server_and_their_children():
    ports = [free_port(), free_port()]
    script = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {str(ROOT)!r})
        from megatron_gspo.launch.supervisor import Supervisor
        from tests.test_supervisor import _spec
        sys.exit(Supervisor([_spec(p) for p in {ports!r}], log=print).run())
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        assert eventually(lambda: all(_healthy(u) for u in urls), timeout_s=30)
        family = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        assert len(family) == 4, family  # two servers, each with its child
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "stopping 2 server(s) (got SIGTERM)" in out, out
    time.sleep(0.5)
    alive = [
        pid for pid in family if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
    ]
    assert not alive, f"processes left running after SIGTERM: {alive}"
