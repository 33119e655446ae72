"""The RL loop under faults and bad input: nothing lost, nothing hung, one-line errors."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.data import train_sentencepiece
from tests.support.runs import (
    QUIET,
    cli,
    cli_train,
    comparable,
    loop_recipe,
    one_line_error,
    run_metrics,
    wait_for,
    write_recipe,
)

# Fault injection at random moments and whole runs per case: the slow tier, every test here.
pytestmark = pytest.mark.slow


def test_hanging_and_nan_rewards_neither_stall_nor_poison_the_run(tmp_path):
    # About a quarter of the tiny model's responses hold a 3 or a 5: every step goes on
    # (the error-fraction stop is tested in tests/test_episodes.py).
    reward = {
        "functions": [{"name": "tests.support.faulty_rewards:nan_or_hang"}],
        "timeout_s": 2,
        "max_error_fraction": 1.0,
    }
    data = loop_recipe(tmp_path / "run", reward=reward, run=QUIET)
    start = time.monotonic()
    proc = cli("train", str(write_recipe(tmp_path, data)), "--steps", "3", cwd=Path.cwd())
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = run_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert sum(r["reward_errors"] for r in records) > 0, "no NaN reward was counted"
    assert sum(r["reward_timeouts"] for r in records) > 0, "no hung reward was counted"
    # A deadline per hung call, spread over the workers, not one a batch for every sample.
    hangs = sum(r["reward_timeouts"] for r in records)
    assert elapsed < hangs * 2 + 120, f"the run took {elapsed:.0f} s for {hangs} hung calls"
    # Under reward.on_error: drop_group no failed score reaches the update.
    assert all(r["groups_dropped_on_error"] > 0 for r in records)


def test_no_resume_never_destroys_a_run_without_being_told(tmp_path):
    run = tmp_path / "run"
    recipe = write_recipe(tmp_path, loop_recipe(run, run=QUIET))
    assert cli("train", str(recipe), "--steps", "2").returncode == 0
    before = (run / "metrics.jsonl").read_text()
    refused = cli("train", str(recipe), "--steps", "2", "--no-resume")
    one_line_error(refused, str(run), "--overwrite")
    assert (run / "metrics.jsonl").read_text() == before, "the refused run touched the metrics"
    assert (run / "checkpoints" / "latest").read_text().strip() == "2"
    again = cli("train", str(recipe), "--steps", "1", "--no-resume", "--overwrite")
    assert again.returncode == 0, again.stderr[-3000:]
    assert [r["step"] for r in run_metrics(run)] == [1]
    assert sorted(p.name for p in (run / "checkpoints").glob("iter_*")) == ["iter_0000001"]


def _jsonl(path: Path, prompts: list[str]) -> None:
    path.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in prompts))


def _data_recipe(tmp_path: Path, data_file: Path, **data) -> dict:

    tok = train_sentencepiece(tmp_path)
    recipe = loop_recipe(tmp_path / "run", run=QUIET)
    recipe["data"] = {"path": str(data_file), "tokenizer": str(tok), "shuffle": False, **data}
    recipe["model"]["vocab_size"] = 64
    return recipe


def test_overlong_prompts_are_skipped_and_counted_or_fatal_by_name(tmp_path):
    data_file = tmp_path / "prompts.jsonl"
    huge = "1 2 3 " * 2_000_000  # a 12 MB line
    _jsonl(data_file, ["1 2", huge, "3 4", "5", "6 7"] * 4)
    skip = _data_recipe(tmp_path, data_file)
    proc = cli("train", str(write_recipe(tmp_path, skip)), "--steps", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert run_metrics(tmp_path / "run")[0]["prompts_skipped_overlong"] >= 1
    fail = _data_recipe(tmp_path, data_file, overlong_prompts="fail")
    fail["run"]["output_dir"] = str(tmp_path / "run2")
    proc = cli("train", str(write_recipe(tmp_path, fail, "fail.yaml")), "--steps", "1")
    one_line_error(proc, f"{data_file}:2", "tokens")


def test_non_utf8_data_names_the_file_and_line(tmp_path):
    data_file = tmp_path / "prompts.jsonl"
    data_file.write_bytes(
        b'{"prompt": "1", "answer": "1"}\n{"prompt": "\xff\xfe", "answer": "1"}\n'
    )
    proc = cli("train", str(write_recipe(tmp_path, _data_recipe(tmp_path, data_file))))
    one_line_error(proc, f"{data_file}:2", "UTF-8")


def test_validate_names_missing_inputs(tmp_path):
    data = loop_recipe(tmp_path / "run", run={"init_from": str(tmp_path / "nowhere")})
    proc = cli("validate", str(write_recipe(tmp_path, data)))
    assert proc.returncode == 3 and "run.init_from" in proc.stderr, proc.stderr


def test_broken_or_damaged_checkpoints_are_one_line_errors(tmp_path):
    run = tmp_path / "run"
    recipe = write_recipe(tmp_path, loop_recipe(run, run=QUIET))
    assert cli("train", str(recipe), "--steps", "2").returncode == 0
    ckpt = run / "checkpoints" / "iter_0000002"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    shard = max(manifest["files"], key=lambda f: manifest["files"][f]["bytes"])
    data = bytearray((ckpt / shard).read_bytes())
    data[len(data) // 2 : len(data) // 2 + 16] = bytes(16)
    (ckpt / shard).write_bytes(bytes(data))
    one_line_error(cli("train", str(recipe), "--steps", "3"), shard, "corrupt")
    converted = cli("convert", "megatron-to-hf", str(ckpt), str(tmp_path / "hf"))
    assert converted.returncode == 1 and shard in converted.stderr, converted.stderr[-2000:]
    assert "Traceback" not in converted.stderr
    (run / "checkpoints" / "latest").write_text("7\n")
    one_line_error(cli("train", str(recipe), "--steps", "3"), "latest", "iter_0000002")


def _session_processes(sid: int) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,sid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines()[1:] if int(line.split()[1]) == sid]


def test_kill_9_of_the_trainer_leaves_no_helper_process_behind(tmp_path):
    run = tmp_path / "run"
    recipe = write_recipe(tmp_path, loop_recipe(run, run={**QUIET, "checkpoint_every": 1}))
    proc = cli_train(recipe, "--steps", "1000")
    metrics = run / "metrics.jsonl"
    wait_for(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 2, 240, proc)
    helpers = _session_processes(proc.pid)
    assert len(helpers) > 1, f"no helper processes to check: {helpers}"
    os.kill(proc.pid, signal.SIGKILL)  # the trainer alone, as an OOM killer would
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 15
    while _session_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _session_processes(proc.pid), "\n".join(_session_processes(proc.pid))


@pytest.mark.parametrize(
    "seed, async_save", [(0, False), (1, True)], ids=["synchronous", "asynchronous"]
)
def test_killing_the_trainer_at_random_moments_loses_no_step_and_resumes_exactly(
    tmp_path, seed, async_save
):
    """SIGKILL (of the whole process group, mid-step or mid-save: with run.async_save, while
    the background writer writes or hashes under a training step) over several rounds until
    the run completes: the checkpoint never goes back, and the result equals a run never
    interrupted."""
    total = 10
    straight = tmp_path / "straight"
    interrupted = tmp_path / "interrupted"
    common = {**QUIET, "checkpoint_every": 1, "keep_checkpoints": 2, "async_save": async_save}
    r_straight = write_recipe(tmp_path, loop_recipe(straight, run=common), "straight.yaml")
    r_killed = write_recipe(tmp_path, loop_recipe(interrupted, run=common), "killed.yaml")
    assert cli("train", str(r_straight), "--steps", str(total)).returncode == 0
    rng = random.Random(seed)
    latest_path = interrupted / "checkpoints" / "latest"
    saved, kills = 0, 0
    metrics = interrupted / "metrics.jsonl"

    def progress() -> int:
        return len(metrics.read_text().splitlines()) if metrics.is_file() else 0

    while True:
        proc = cli_train(r_killed, "--steps", str(total))
        # Kill once this run has trained a step of its own, somewhere in the next step or the
        # save after it.
        mark = progress()
        deadline = time.monotonic() + 240
        while proc.poll() is None and progress() <= mark and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.4))
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
            kills += 1
        else:
            out = proc.stdout.read()
            assert proc.returncode == 0, out[-3000:]
            break
        now = int(latest_path.read_text()) if latest_path.exists() else 0
        assert now >= saved, f"the latest checkpoint went back from {saved} to {now}"
        saved = now
        assert kills < 20, "the run makes no progress between kills"
    assert kills >= 2, f"only {kills} kill(s) landed; the test checked little"
    a, b = run_metrics(straight), run_metrics(interrupted)
    assert [r["step"] for r in b] == list(range(1, total + 1))
    for ra, rb in zip(a, b, strict=True):
        assert comparable(ra) == comparable(rb), f"step {ra['step']} differs after the kills"


KILL_POINTS = ["writing", "hashing", "publish", "renamed", "pruning"]


@pytest.mark.parametrize("point", KILL_POINTS)
def test_a_trainer_killed_at_any_point_of_an_asynchronous_save_resumes_exactly(tmp_path, point):
    """SIGKILL of the trainer at one point of the background save of step 3 (inside the
    writer, before the manifest, between the rename and the flip of ``latest``, in the middle
    of pruning an older one): ``latest`` names a checkpoint that verifies, the debris goes,
    and the restarted run trains exactly what an uninterrupted one does."""
    import sys

    from megatron_gspo.run.checkpoint_files import debris
    from megatron_gspo.weights.manifest import verify_checkpoint

    total = 5
    common = {**QUIET, "checkpoint_every": 1, "keep_checkpoints": 2, "async_save": True}
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    r_straight = write_recipe(tmp_path, loop_recipe(straight, run=common), "straight.yaml")
    r_killed = write_recipe(tmp_path, loop_recipe(killed, run=common), "killed.yaml")
    assert cli("train", str(r_straight), "--steps", str(total)).returncode == 0
    env = {**os.environ, "KILL_AT": point, "KILL_AT_STEP": "3"}
    cmd = [sys.executable, "-m", "tests.support.kill_points", "train", str(r_killed)]
    first = subprocess.run([*cmd, "--steps", str(total)], env=env, capture_output=True,
                           text=True, timeout=600)  # fmt: skip
    assert first.returncode == -signal.SIGKILL, (first.returncode, first.stdout[-2000:])
    ckpts = killed / "checkpoints"
    latest = int((ckpts / "latest").read_text())
    assert latest == (3 if point == "pruning" else 2), f"{point}: latest is {latest}"
    verify_checkpoint(ckpts / f"iter_{latest:07d}")
    again = cli("train", str(r_killed), "--steps", str(total))
    assert again.returncode == 0, again.stderr[-3000:]
    assert not debris(ckpts), f"the killed save left {debris(ckpts)} behind"
    a, b = run_metrics(straight), run_metrics(killed)
    assert [r["step"] for r in b] == list(range(1, total + 1))
    for ra, rb in zip(a, b, strict=True):
        assert comparable(ra) == comparable(rb), f"step {ra['step']} differs after the kill"
    for step in sorted(int(p.name[5:]) for p in ckpts.glob("iter_*")):
        verify_checkpoint(ckpts / f"iter_{step:07d}")
