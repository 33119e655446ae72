"""The sbatch recipes: static checks, and the tiny recipe through a real Slurm.

The Slurm tests submit ``slurm/cpu_tiny.sbatch`` (the same body the GPU recipes use) to the
cluster that ``.ci/slurm-setup.sh`` starts on this machine, and check what a user relies on: the
job completes with a checkpoint and metrics, and after ``scontrol requeue`` the second run
resumes from the checkpoint instead of starting over. They skip only where ``sbatch`` is not
installed; with ``sbatch`` present and no working cluster they fail and say how to start one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((REPO / "slurm").glob("*.sbatch")) + [REPO / "slurm" / "job.sh"]
SHELL_FILES = SCRIPTS + [REPO / ".ci" / "slurm-setup.sh"]

# A job that runs longer than this has hung (the tiny recipe takes well under a minute a step).
JOB_TIMEOUT_S = float(os.environ.get("GSPO_SLURM_TEST_TIMEOUT", "900"))


@pytest.mark.parametrize("script", SHELL_FILES, ids=lambda p: p.name)
def test_script_parses(script: Path) -> None:
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, f"bash -n {script.name}:\n{result.stderr}"


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_scripts_pass_shellcheck() -> None:
    # -x follows `source slurm/job.sh` from the sbatch files, so variables set there and used
    # in job.sh are checked together.
    result = subprocess.run(
        ["shellcheck", "-x", *[str(p.relative_to(REPO)) for p in SHELL_FILES]],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_sbatch_recipes_declare_requeue_and_a_checkpoint_signal() -> None:
    for script in (REPO / "slurm").glob("*.sbatch"):
        text = script.read_text()
        assert "#SBATCH --requeue" in text, f"{script.name}: no --requeue"
        assert "#SBATCH --signal=B:USR1@" in text, f"{script.name}: no checkpoint signal"
        assert "slurm/job.sh" in text, f"{script.name}: does not use the shared body"


# --------------------------------------------------------------------------------------------
# A real Slurm.

needs_slurm = pytest.mark.skipif(
    shutil.which("sbatch") is None,
    reason="sbatch not on PATH (no Slurm here); CI runs .ci/slurm-setup.sh first",
)


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def _job(job_id: str) -> dict[str, str]:
    """``scontrol show job`` as a dict (there is no accounting database for sacct here)."""
    fields: dict[str, str] = {}
    for token in _run("scontrol", "show", "job", "-o", job_id).split():
        key, _, value = token.partition("=")
        fields.setdefault(key, value)
    return fields


def _wait(predicate, what: str, timeout_s: float = JOB_TIMEOUT_S, job_id: str | None = None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(1.0)
    state = _job(job_id).get("JobState") if job_id else "?"
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what} (job {state})")


def _finished(job_id: str) -> str | None:
    state = _job(job_id)["JobState"]
    return state if state in {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"} else None


def _release_requeued(job_id: str, tmp_path: Path) -> None:
    """Start a requeued job now instead of after Slurm's ~2-minute requeue delay.

    Once the first run has ended, Slurm sets the job's begin time (and may do so after an
    early update), so the update is repeated until the job leaves PENDING.
    """
    _wait(lambda: _job(job_id)["JobState"] == "PENDING", "the requeue", 180, job_id)
    deadline = time.monotonic() + 90  # the first run's batch script ends (or is killed)
    while time.monotonic() < deadline and not any(
        "batch: done (exit" in p.read_text() for p in tmp_path.glob("batch-*.out")
    ):
        time.sleep(1.0)

    def started() -> bool:
        if _job(job_id)["JobState"] != "PENDING":
            return True
        _run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
        time.sleep(4.0)
        return _job(job_id)["JobState"] != "PENDING"

    _wait(started, "the requeued job to start", 180, job_id)


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in _records(run_dir)]


def _logs(tmp_path: Path) -> str:
    return "\n".join(
        f"==> {p.relative_to(tmp_path)} <==\n{p.read_text(errors='replace')[-4000:]}"
        for p in sorted(tmp_path.rglob("*.log")) + sorted(tmp_path.glob("*.out"))
    )


@pytest.fixture(scope="module")
def slurm_cluster() -> str:
    try:
        state = _run("sinfo", "-h", "-o", "%T").split()
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        pytest.fail(f"sbatch is installed but Slurm does not answer ({e}); run .ci/slurm-setup.sh")
    if not any(s.startswith(("idle", "mixed", "alloc")) for s in state):
        pytest.fail(f"no Slurm node takes jobs (states: {state}); run .ci/slurm-setup.sh")
    return state[0]


def _recipe(tmp_path: Path, checkpoint_every: int) -> Path:
    data = yaml.safe_load((REPO / "recipes" / "tiny-moe.yaml").read_text())
    data.setdefault("run", {})["checkpoint_every"] = checkpoint_every
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _submit(tmp_path: Path, recipe: Path, steps: int, name: str) -> tuple[str, Path]:
    run_dir = tmp_path / "run"
    env = dict(os.environ)
    env.update(
        RECIPE=str(recipe),
        STEPS=str(steps),
        OUTPUT_DIR=str(run_dir),
        LOG_DIR=str(tmp_path / "logs"),
        # The checkout's CLI with this interpreter: the test checks this tree, however (or
        # whether) the package is installed.
        GSPO=f"{sys.executable} -m megatron_gspo.cli",
    )
    cmd = ["sbatch", "--parsable", f"--job-name={name}", f"--chdir={REPO}"]
    cmd += [f"--output={tmp_path}/batch-%j.out", str(REPO / "slurm" / "cpu_tiny.sbatch")]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return out.strip().split(";")[0], run_dir


@pytest.mark.slow
@needs_slurm
def test_cpu_tiny_job_completes_with_checkpoint_and_metrics(slurm_cluster, tmp_path) -> None:
    t0 = time.monotonic()
    job_id, run_dir = _submit(tmp_path, _recipe(tmp_path, checkpoint_every=2), 2, "gspo-test")
    try:
        state = _wait(lambda: _finished(job_id), "the job to finish", job_id=job_id)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    print(f"cpu_tiny job {job_id}: {state} in {time.monotonic() - t0:.0f}s")
    assert state == "COMPLETED", f"job {job_id} ended {state}\n{_logs(tmp_path)}"
    assert _steps(run_dir) == [1, 2], f"metrics steps {_steps(run_dir)}\n{_logs(tmp_path)}"
    latest = run_dir / "checkpoints" / "latest"
    assert latest.exists() and latest.read_text().strip() == "2", _logs(tmp_path)
    assert list((run_dir / "checkpoints").glob("iter_*")), "no iter_* checkpoint directory"
    assert (tmp_path / "logs" / f"trainer-{_job(job_id)['NodeList']}.log").exists()


@pytest.mark.slow
@needs_slurm
def test_requeued_job_resumes_from_its_checkpoint(slurm_cluster, tmp_path) -> None:
    steps = 8
    t0 = time.monotonic()
    job_id, run_dir = _submit(tmp_path, _recipe(tmp_path, checkpoint_every=2), steps, "gspo-rq")
    latest = run_dir / "checkpoints" / "latest"
    try:
        _wait(latest.exists, "the first checkpoint", job_id=job_id)
        saved = int(latest.read_text().strip())
        assert saved < steps, f"the run finished ({saved}) before it could be requeued"
        _run("scontrol", "requeue", job_id)
        _wait(lambda: _job(job_id)["JobState"] == "PENDING", "the requeue", 120, job_id)
        first_run = _records(run_dir)
        # Requeue SIGTERMs every process of the job; the trainer finishes its step and saves
        # (KillWait in .ci/slurm-setup.sh leaves it 60 s), so there is a newer checkpoint.
        saved_on_term = int(latest.read_text().strip())
        assert saved_on_term > saved, (
            f"no checkpoint written on SIGTERM (latest still {saved})\n{_logs(tmp_path)}"
        )
        _release_requeued(job_id, tmp_path)
        state = _wait(lambda: _finished(job_id), "the requeued job to finish", job_id=job_id)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    print(f"requeue job {job_id}: {state} in {time.monotonic() - t0:.0f}s")
    info = _job(job_id)
    assert state == "COMPLETED", f"job {job_id} ended {state}\n{_logs(tmp_path)}"
    assert info["Restarts"] == "1", f"Restarts={info['Restarts']}"
    records = _records(run_dir)
    assert first_run and first_run[-1]["step"] < steps, f"first run wrote {first_run}"
    # A resumed run rewrites only the records after its checkpoint (the trainer drops lines
    # past the step it resumes from); a run that started over would rewrite step 1 too, with
    # its own timings. So step 1 must be the first run's record, byte for byte.
    assert [r["step"] for r in records] == list(range(1, steps + 1)), (
        f"metrics steps {[r['step'] for r in records]}\n{_logs(tmp_path)}"
    )
    assert records[0] == first_run[0], (
        f"step 1 was recomputed after the requeue: the run restarted instead of resuming\n"
        f"{_logs(tmp_path)}"
    )
    assert latest.read_text().strip() == str(steps)
    batch_log = next(tmp_path.glob("batch-*.out")).read_text()
    assert " run 2 on " in batch_log, batch_log


@pytest.mark.slow
@needs_slurm
def test_time_limit_warning_checkpoints_exits_75_and_requeues_itself(slurm_cluster, tmp_path):
    """USR1 (what --signal=B:USR1@N sends before the time limit): the trainer saves and exits
    with the pre-emption status 75, which job.sh turns into a requeue; the next run resumes."""
    steps = 8
    job_id, run_dir = _submit(tmp_path, _recipe(tmp_path, checkpoint_every=2), steps, "gspo-tl")
    latest = run_dir / "checkpoints" / "latest"
    try:
        _wait(latest.exists, "the first checkpoint", job_id=job_id)
        saved = int(latest.read_text().strip())
        assert saved < steps, f"the run finished ({saved}) before the warning"
        _run("scancel", "--batch", "--signal=USR1", job_id)
        _wait(lambda: _job(job_id)["JobState"] == "PENDING", "the self-requeue", 180, job_id)
        assert int(latest.read_text().strip()) > saved, "no checkpoint written on the warning"
        _release_requeued(job_id, tmp_path)
        state = _wait(lambda: _finished(job_id), "the requeued job to finish", job_id=job_id)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    batch_log = next(tmp_path.glob("batch-*.out")).read_text()
    assert state == "COMPLETED", f"job {job_id} ended {state}\n{_logs(tmp_path)}"
    assert "trainer finished with status 75" in batch_log, batch_log
    assert "requeueing job" in batch_log and " run 2 on " in batch_log, batch_log
    assert _steps(run_dir) == list(range(1, steps + 1)), _logs(tmp_path)


# The orchestration in slurm/job.sh (servers started, stopped when training ends, the job
# failing when they die), with a stand-in for `megatron-gspo launch` so no GPU or vLLM is needed.
_STUB = """
import pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
role = sys.argv[sys.argv.index("--role") + 1]
mode = sys.argv[2]

def stopped(*_):
    (out / f"{role}-stopped").write_text("")
    sys.exit(0)

signal.signal(signal.SIGTERM, stopped)
(out / f"{role}-started").write_text(" ".join(sys.argv[3:]))
if role == "rollout":
    if mode == "rollout_dies":
        time.sleep(2)
        sys.exit(3)
    time.sleep(300)
else:
    time.sleep(3 if mode == "ok" else 300)
"""


def _submit_stub(tmp_path: Path, mode: str) -> str:
    (tmp_path / "stub.py").write_text(_STUB)
    script = tmp_path / "job.sbatch"
    script.write_text(
        "#!/usr/bin/env bash\n"
        f"RECIPE={REPO / 'recipes' / 'tiny-moe.yaml'}\n"
        "ROLLOUT_GPUS=1\n"
        f"GSPO='{sys.executable} {tmp_path / 'stub.py'} {tmp_path} {mode}'\n"
        f"LOG_DIR={tmp_path / 'logs'}\n"
        f"OUTPUT_DIR={tmp_path / 'run'}\n"
        f"source {REPO / 'slurm' / 'job.sh'}\n"
    )
    cmd = ["sbatch", "--parsable", "--job-name=gspo-orch", f"--chdir={REPO}", "--requeue"]
    cmd += [f"--output={tmp_path}/batch-%j.out", str(script)]
    return _run(*cmd).strip().split(";")[0]


@needs_slurm
def test_job_stops_the_rollout_servers_when_training_ends(slurm_cluster, tmp_path) -> None:
    job_id = _submit_stub(tmp_path, "ok")
    try:
        state = _wait(lambda: _finished(job_id), "the job to finish", 120, job_id)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    assert state == "COMPLETED", _logs(tmp_path)
    for marker in ["rollout-started", "trainer-started", "rollout-stopped"]:
        assert (tmp_path / marker).exists(), f"no {marker}\n{_logs(tmp_path)}"
    # The trainer got the vLLM split and the rendezvous flags.
    assert "--rollout-gpus 1" in (tmp_path / "trainer-started").read_text()


@needs_slurm
def test_job_fails_and_stops_the_trainer_when_the_servers_die(slurm_cluster, tmp_path) -> None:
    job_id = _submit_stub(tmp_path, "rollout_dies")
    try:
        state = _wait(lambda: _finished(job_id), "the job to finish", 180, job_id)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    assert state == "FAILED", _logs(tmp_path)
    assert (tmp_path / "trainer-stopped").exists(), f"trainer not stopped\n{_logs(tmp_path)}"
    assert "the rollout servers exited" in next(tmp_path.glob("batch-*.out")).read_text()
