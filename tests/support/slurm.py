"""Helpers for the tests that submit jobs to the Slurm cluster of ``.ci/slurm-setup.sh``
(tests/test_slurm.py, tests/test_slurm_vllm.py): job state from ``scontrol`` (there is no
accounting database for sacct), waits that name what they waited for, a requeued job released
at once, and the job's logs for a failure message."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]

# A job that runs longer than this has hung (the tiny recipe takes well under a minute a step).
JOB_TIMEOUT_S = float(os.environ.get("GSPO_SLURM_TEST_TIMEOUT", "900"))

needs_slurm = pytest.mark.skipif(
    shutil.which("sbatch") is None,
    reason="sbatch not on PATH (no Slurm here); CI runs .ci/slurm-setup.sh first",
)


@contextlib.contextmanager
def held_cluster() -> Iterator[str]:
    """The cluster, checked to take jobs and held by one test module at a time: its nodes share
    two CPUs, and another test run's jobs (CI runs its Python 3.12 leg beside the main one, and
    the slow tier's workers side by side) would queue behind these, or slow them, and time them
    out. Yields the first node's state."""
    import fcntl

    with open("/tmp/megatron-gspo-slurm-tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            state = run("sinfo", "-h", "-o", "%T").split()
        except (subprocess.CalledProcessError, FileNotFoundError) as e:
            pytest.fail(
                f"sbatch is installed but Slurm does not answer ({e}); run .ci/slurm-setup.sh"
            )
        if not any(s.startswith(("idle", "mixed", "alloc")) for s in state):
            pytest.fail(f"no Slurm node takes jobs (states: {state}); run .ci/slurm-setup.sh")
        yield state[0]


def run(*cmd: str, env: dict[str, str] | None = None) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout


def job(job_id: str) -> dict[str, str]:
    """``scontrol show job`` as a dict."""
    fields: dict[str, str] = {}
    for token in run("scontrol", "show", "job", "-o", job_id).split():
        key, _, value = token.partition("=")
        fields.setdefault(key, value)
    return fields


def wait_for(
    predicate,
    what: str,
    timeout_s: float = JOB_TIMEOUT_S,
    job_id: str | None = None,
    poll_s: float = 1.0,
):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    state = job(job_id).get("JobState") if job_id else "?"
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what} (job {state})")


def finished(job_id: str) -> str | None:
    state = job(job_id)["JobState"]
    return state if state in {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"} else None


def release_requeued(job_id: str, tmp_path: Path) -> None:
    """Start a requeued job now instead of after Slurm's ~2-minute requeue delay.

    Once the first run has ended, Slurm sets the job's begin time (and may do so after an
    early update), so the update is repeated until the job leaves PENDING.
    """
    wait_for(lambda: job(job_id)["JobState"] == "PENDING", "the requeue", 180, job_id)
    deadline = time.monotonic() + 90  # the first run's batch script ends (or is killed)
    while time.monotonic() < deadline and not any(
        "batch: done (exit" in p.read_text() for p in tmp_path.glob("batch-*.out")
    ):
        time.sleep(1.0)
    # slurmd refuses a credential made in the same second as the one it revoked at the
    # requeue ("Job credential revoked", the job then FAILED): that second must pass first.
    time.sleep(2.0)

    def started() -> bool:
        if job(job_id)["JobState"] != "PENDING":
            return True
        run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
        time.sleep(4.0)
        return job(job_id)["JobState"] != "PENDING"

    wait_for(started, "the requeued job to start", 180, job_id)


def trainer(tmp: Path) -> psutil.Process:
    """The trainer's rank whose command line names ``tmp`` (torchrun's worker, not torchrun)."""
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if ("megatron_gspo.cli" in cmd and "train" in cmd and "torch.distributed.run" not in cmd
                and any(str(tmp) in c for c in cmd)):  # fmt: skip
            return proc
    raise AssertionError(f"no trainer process of {tmp} is running")


def signal_reached(pid: int, signum: int) -> bool:
    """Whether ``signum`` reached ``pid``, a stopped process: it waits there to be delivered, or
    Slurm woke the process itself (it sends SIGCONT with its signals) and it went on or ended."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    fields = dict(line.split(":", 1) for line in status.splitlines())
    if not fields["State"].strip().startswith("T"):
        return True
    pending = int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)
    return bool(pending >> (signum - 1) & 1)


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in records(run_dir)]


def logs(tmp_path: Path, tail: int = 4000) -> str:
    return "\n".join(
        f"==> {p.relative_to(tmp_path)} <==\n{p.read_text(errors='replace')[-tail:]}"
        for p in sorted(tmp_path.rglob("*.log")) + sorted(tmp_path.glob("*.out"))
    )
