"""The sbatch recipes: static checks, and the tiny recipe through a real Slurm.

The Slurm tests submit ``slurm/cpu_tiny.sbatch`` (the same body the GPU recipes use) to the
cluster that ``.ci/slurm-setup.sh`` starts on this machine, and check what a user relies on: the
job completes with a checkpoint and metrics, and after ``scontrol requeue`` the second run
resumes from the checkpoint instead of starting over. They skip only where ``sbatch`` is not
installed; with ``sbatch`` present and no working cluster they fail and say how to start one.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.support import slurm as cluster
from tests.support.pausing import paused
from tests.support.slurm import REPO, needs_slurm

SCRIPTS = sorted((REPO / "slurm").glob("*.sbatch")) + [REPO / "slurm" / "job.sh"]
SHELL_FILES = SCRIPTS + [REPO / ".ci" / "slurm-setup.sh"]


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
        state = cluster.wait_for(
            lambda: cluster.finished(job_id), "the job to finish", job_id=job_id
        )
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    print(f"cpu_tiny job {job_id}: {state} in {time.monotonic() - t0:.0f}s")
    assert state == "COMPLETED", f"job {job_id} ended {state}\n{cluster.logs(tmp_path)}"
    assert cluster.steps(run_dir) == [1, 2], (
        f"metrics steps {cluster.steps(run_dir)}\n{cluster.logs(tmp_path)}"
    )
    latest = run_dir / "checkpoints" / "latest"
    assert latest.exists() and latest.read_text().strip() == "2", cluster.logs(tmp_path)
    assert list((run_dir / "checkpoints").glob("iter_*")), "no iter_* checkpoint directory"
    assert (tmp_path / "logs" / f"trainer-{cluster.job(job_id)['NodeList']}.log").exists()


def _signal_mid_run(tmp_path: Path, job_id: str, latest: Path, steps: int, *cmd: str) -> int:
    """Once the run's first checkpoint is written (``latest``), ``cmd`` (a requeue, the
    time-limit warning) with the trainer stopped until the SIGTERM it leads to reaches it: a
    step takes 0.15 s, and the run would otherwise end first. The step saved before it."""
    cluster.wait_for(latest.exists, "the first checkpoint", job_id=job_id, poll_s=0.05)
    pid = cluster.trainer(tmp_path).pid
    with paused(pid):
        saved = int(latest.read_text().strip())
        assert saved < steps, f"the run finished ({saved}) before {' '.join(cmd)}"
        cluster.run(*cmd)
        cluster.wait_for(
            lambda: cluster.signal_reached(pid, signal.SIGTERM),
            f"the trainer's SIGTERM after {' '.join(cmd)}",
            120,
            job_id,
            poll_s=0.1,
        )
    return saved


@pytest.mark.slow
@needs_slurm
def test_requeued_job_resumes_from_its_checkpoint(slurm_cluster, tmp_path) -> None:
    steps = 8
    t0 = time.monotonic()
    job_id, run_dir = _submit(tmp_path, _recipe(tmp_path, checkpoint_every=2), steps, "gspo-rq")
    latest = run_dir / "checkpoints" / "latest"
    try:
        saved = _signal_mid_run(tmp_path, job_id, latest, steps, "scontrol", "requeue", job_id)
        cluster.wait_for(
            lambda: cluster.job(job_id)["JobState"] == "PENDING", "the requeue", 120, job_id
        )
        first_run = cluster.records(run_dir)
        # Requeue SIGTERMs every process of the job; the trainer finishes its step and saves
        # (KillWait in .ci/slurm-setup.sh leaves it 60 s), so there is a newer checkpoint.
        saved_on_term = int(latest.read_text().strip())
        assert saved_on_term > saved, (
            f"no checkpoint written on SIGTERM (latest still {saved})\n{cluster.logs(tmp_path)}"
        )
        cluster.release_requeued(job_id, tmp_path)
        state = cluster.wait_for(
            lambda: cluster.finished(job_id), "the requeued job to finish", job_id=job_id
        )
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    at = first_run[-1]["step"] if first_run else None
    print(f"requeue job {job_id}: {state} in {time.monotonic() - t0:.0f}s; the first run "
          f"saved step {saved}, was requeued at step {at} of {steps}")  # fmt: skip
    info = cluster.job(job_id)
    assert state == "COMPLETED", f"job {job_id} ended {state}\n{cluster.logs(tmp_path)}"
    assert info["Restarts"] == "1", f"Restarts={info['Restarts']}"
    records = cluster.records(run_dir)
    assert first_run and first_run[-1]["step"] < steps, f"first run wrote {first_run}"
    # A resumed run rewrites only the records after its checkpoint (the trainer drops lines
    # past the step it resumes from); a run that started over would rewrite step 1 too, with
    # its own timings. So step 1 must be the first run's record, byte for byte.
    assert [r["step"] for r in records] == list(range(1, steps + 1)), (
        f"metrics steps {[r['step'] for r in records]}\n{cluster.logs(tmp_path)}"
    )
    assert records[0] == first_run[0], (
        f"step 1 was recomputed after the requeue: the run restarted instead of resuming\n"
        f"{cluster.logs(tmp_path)}"
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
        saved = _signal_mid_run(
            tmp_path, job_id, latest, steps, "scancel", "--batch", "--signal=USR1", job_id
        )
        cluster.wait_for(
            lambda: cluster.job(job_id)["JobState"] == "PENDING", "the self-requeue", 180, job_id
        )
        assert int(latest.read_text().strip()) > saved, "no checkpoint written on the warning"
        cluster.release_requeued(job_id, tmp_path)
        state = cluster.wait_for(
            lambda: cluster.finished(job_id), "the requeued job to finish", job_id=job_id
        )
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    batch_log = next(tmp_path.glob("batch-*.out")).read_text()
    assert state == "COMPLETED", f"job {job_id} ended {state}\n{cluster.logs(tmp_path)}"
    assert "trainer finished with status 75" in batch_log, batch_log
    assert "requeueing job" in batch_log and " run 2 on " in batch_log, batch_log
    assert cluster.steps(run_dir) == list(range(1, steps + 1)), cluster.logs(tmp_path)


# The orchestration in slurm/job.sh (servers started, stopped when training ends, training
# going on when a rollout step ends, the job ended when every one has), with a stand-in for
# `megatron-gspo launch` so no GPU or vLLM is needed. tests/test_slurm_vllm.py runs the real one.
_STUB = """
import os, pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
role = sys.argv[sys.argv.index("--role") + 1]
mode = sys.argv[2]
node = os.environ.get("SLURMD_NODENAME", "")

def stopped(*_):
    (out / f"{role}-stopped").write_text("")
    sys.exit(0)

signal.signal(signal.SIGTERM, stopped)
(out / f"{role}-started").write_text(" ".join(sys.argv[3:]))
if role == "rollout":
    if mode == "all_rollouts_die" or (mode == "rollout_dies" and node == "gspo-n3"):
        time.sleep(2)
        sys.exit(3)
    time.sleep(300)
else:
    time.sleep(3 if mode == "ok" else 8)
"""


def _submit_stub(tmp_path: Path, mode: str, rollout_nodes: int = 0) -> str:
    """``rollout_nodes`` 0: one node whose trainer shares it with a server (ROLLOUT_GPUS);
    otherwise a trainer node and that many rollout nodes of the emulated partition."""
    (tmp_path / "stub.py").write_text(_STUB)
    script = tmp_path / "job.sbatch"
    layout = f"ROLLOUT_NODES={rollout_nodes}\n" if rollout_nodes else "ROLLOUT_GPUS=1\n"
    script.write_text(
        "#!/usr/bin/env bash\n"
        f"RECIPE={REPO / 'recipes' / 'tiny-moe.yaml'}\n"
        f"{layout}"
        f"GSPO='{sys.executable} {tmp_path / 'stub.py'} {tmp_path} {mode}'\n"
        f"LOG_DIR={tmp_path / 'logs'}\n"
        f"OUTPUT_DIR={tmp_path / 'run'}\n"
        f"source {REPO / 'slurm' / 'job.sh'}\n"
    )
    cmd = ["sbatch", "--parsable", "--job-name=gspo-orch", f"--chdir={REPO}", "--requeue"]
    if rollout_nodes:
        cmd += ["--partition=nodes", f"--nodes={rollout_nodes + 1}", "--no-kill"]
    cmd += [f"--output={tmp_path}/batch-%j.out", str(script)]
    return cluster.run(*cmd).strip().split(";")[0]


def _stub_job(tmp_path: Path, mode: str, rollout_nodes: int = 0) -> tuple[str, str, str]:
    """Runs a stub job to its end: its id, final state and batch log."""
    job_id = _submit_stub(tmp_path, mode, rollout_nodes)
    try:
        state = cluster.wait_for(lambda: cluster.finished(job_id), "the job to finish", 180, job_id)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    return job_id, state, next(tmp_path.glob("batch-*.out")).read_text()


@needs_slurm
def test_job_stops_the_rollout_servers_when_training_ends(slurm_cluster, tmp_path) -> None:
    _, state, _ = _stub_job(tmp_path, "ok")
    assert state == "COMPLETED", cluster.logs(tmp_path)
    for marker in ["rollout-started", "trainer-started", "rollout-stopped"]:
        assert (tmp_path / marker).exists(), f"no {marker}\n{cluster.logs(tmp_path)}"
    # The trainer got the vLLM split and the rendezvous flags.
    assert "--rollout-gpus 1" in (tmp_path / "trainer-started").read_text()


@needs_slurm
def test_a_rollout_step_that_ends_leaves_the_trainer_running(slurm_cluster, tmp_path) -> None:
    """The trainer decides what too few servers mean (rollout.vllm.min_servers: exit 75 after
    a checkpoint, and a requeue); the job only says that a rollout step ended."""
    _, state, batch_log = _stub_job(tmp_path, "rollout_dies", rollout_nodes=2)
    assert state == "COMPLETED", cluster.logs(tmp_path)
    assert not (tmp_path / "trainer-stopped").exists(), f"trainer stopped\n{cluster.logs(tmp_path)}"
    assert "a rollout step ended (status 3)" in batch_log, batch_log
    assert "every rollout step ended" not in batch_log, batch_log


@needs_slurm
def test_when_every_rollout_step_has_ended_the_job_stops_the_trainer_and_fails(
    slurm_cluster, tmp_path
) -> None:
    """Nothing in the allocation brings them back, and a requeue would loop on a command that
    fails at start: the trainer is stopped (it saves) and the job FAILS without a requeue."""
    job_id, state, batch_log = _stub_job(tmp_path, "all_rollouts_die", rollout_nodes=2)
    assert state == "FAILED", f"{state}\n{cluster.logs(tmp_path)}"
    assert (tmp_path / "trainer-stopped").exists(), cluster.logs(tmp_path)
    assert "every rollout step ended; stopping the trainer" in batch_log, batch_log
    assert "requeueing" not in batch_log and cluster.job(job_id)["Restarts"] == "0", batch_log
