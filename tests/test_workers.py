"""The worker pool that runs user code: a deadline per call, a killed worker replaced at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megatron_gspo.runtime.workers import WorkerPool, WorkerPoolError
from tests.support.pausing import paused

_ROOT = Path(__file__).resolve().parents[1]


def _misbehaving_handler(tag: str):
    def handle(x):
        if x == "hang":
            time.sleep(3600)
        if x == "raise":
            raise KeyError("no such thing")
        if x == "exit":
            os._exit(7)
        if x == "work":  # 3 s of steps, each a little further: a stop lands half-way
            for _ in range(30):
                time.sleep(0.1)
        return f"{tag}:{x}"

    return handle


def _broken_setup():
    raise ImportError("no module named 'nowhere'")


def test_each_hung_call_costs_its_own_deadline_and_the_rest_are_answered():
    pool = WorkerPool(_misbehaving_handler, ("t",), workers=2, timeout_s=1.0)
    calls = [("hang",) if i % 5 == 2 else (str(i),) for i in range(20)]
    try:
        start = time.monotonic()
        outcomes = pool.map(calls)
        elapsed = time.monotonic() - start
    finally:
        pool.close()
    statuses = [o.status for o in outcomes]
    hung = [i for i, c in enumerate(calls) if c == ("hang",)]
    assert [i for i, s in enumerate(statuses) if s == "timeout"] == hung, statuses
    assert all(outcomes[i].value == f"t:{i}" for i in range(20) if i not in hung)
    assert "1 s" in outcomes[hung[0]].message
    # With one deadline for the batch, the calls queued behind the hung ones would time out
    # too. Here 4 hangs over 2 workers cost about 2 deadlines (plus worker restarts).
    assert elapsed < 2 * 1.0 + 30, elapsed
    assert pool.replaced == len(hung)


def test_a_raising_or_dying_call_fails_alone():
    pool = WorkerPool(_misbehaving_handler, ("t",), workers=1, timeout_s=30.0)
    try:
        raised, died, fine = pool.map([("raise",), ("exit",), ("ok",)])
    finally:
        pool.close()
    assert raised.status == "error" and "KeyError" in raised.message
    assert "test_workers.py" in raised.message  # where the user code raised
    assert died.status == "error" and "exit code 7" in died.message
    assert fine.ok and fine.value == "t:ok"


def test_a_setup_that_cannot_run_is_named():
    pool = WorkerPool(_broken_setup, workers=2, timeout_s=5.0, name="env")
    try:
        with pytest.raises(WorkerPoolError, match="env workers cannot start.*nowhere"):
            pool.submit("x").result(timeout=120)
        with pytest.raises(WorkerPoolError, match="nowhere"):
            pool.submit("y")
    finally:
        pool.close()


def test_calls_from_many_threads_and_sigterm_ignored():
    pool = WorkerPool(_misbehaving_handler, ("t",), workers=2, timeout_s=30.0)
    try:
        pool.start()
        results: dict[int, str] = {}

        def caller(k: int) -> None:
            results[k] = pool.submit(str(k)).result().value

        threads = [threading.Thread(target=caller, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        # Slurm signals every process of the job: the workers must outlive it.
        for w in pool._workers:
            os.kill(w.proc.pid, signal.SIGTERM)
        for t in threads:
            t.join()
        assert results == {k: f"t:{k}" for k in range(8)}
        assert pool.replaced == 0
    finally:
        pool.close()
    with pytest.raises(WorkerPoolError, match="closed"):
        pool.submit("late")


# A trainer with a pool: one call that works 3 s under a 6 s deadline, one that hangs.
_STOPPED_TRAINER = """
import json
from megatron_gspo.runtime.workers import WorkerPool
from tests.test_workers import _misbehaving_handler
pool = WorkerPool(_misbehaving_handler, ("t",), workers=2, timeout_s=6.0)
pool.start()
work, hang = pool.submit("work"), pool.submit("hang")
print("submitted", flush=True)
out = {k: (f.result().status, f.result().value) for k, f in (("work", work), ("hang", hang))}
print(json.dumps(out), flush=True)
pool.close()
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stop_s", [8.0, 12.0])
def test_a_stopped_trainer_does_not_time_out_the_calls_it_stopped_half_way(stop_s):
    """SIGSTOP of the trainer and its workers (a suspended Slurm job) a second into a 3 s
    call: the call finishes on resume, and a hung one still times out. 12 s is twice the
    deadline; 8 s outlasts what was left of it by less than a wait's own bound plus 5 s, the
    margin an earlier version gave a stop (CI saw such a stop score an environment timeout)."""
    proc = subprocess.Popen([sys.executable, "-c", _STOPPED_TRAINER], cwd=_ROOT,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "submitted"
        time.sleep(1.0)
        with paused(proc.pid):
            time.sleep(stop_s)
        out = json.loads(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()
    assert out["work"] == ["ok", "t:work"], out
    assert out["hang"][0] == "timeout", out
