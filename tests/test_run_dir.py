"""The run directory and the command line under a hostile user: nothing of an earlier run is
lost or silently replaced, one trainer per directory, and every mistake is one line naming the
file, key or value (issues 26 and 32)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.data import train_sentencepiece
from tests.support.runs import (
    QUIET,
    ROOT,
    cli,
    cli_train,
    loop_recipe,
    one_line_error,
    run_metrics,
    wait_for,
    write_recipe,
)

CKPT = "checkpoints"


def _hashes(run: Path) -> dict[str, str]:
    """Every file of a run directory and its SHA-256 (the lock file, which a trainer rewrites
    when it takes the lock, aside)."""
    return {
        str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def _corrupt(checkpoint: Path) -> None:
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    shard = max(manifest["files"], key=lambda f: manifest["files"][f]["bytes"])
    data = bytearray((checkpoint / shard).read_bytes())
    data[len(data) // 2 : len(data) // 2 + 16] = bytes(16)
    (checkpoint / shard).write_bytes(bytes(data))


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory) -> Path:
    """A 4-step run with checkpoints of steps 2 and 4; each test works on a copy."""
    root = tmp_path_factory.mktemp("earlier")
    run = root / "run"
    recipe = write_recipe(root, loop_recipe(run, run=QUIET))
    proc = cli("train", str(recipe), "--steps", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def _copy(earlier_run: Path, tmp_path: Path, **changes) -> tuple[Path, Path]:
    """A copy of the earlier run and a recipe for it (with ``changes`` to its sections)."""
    run = tmp_path / "run"
    shutil.copytree(earlier_run, run)
    data = loop_recipe(run, run=QUIET)
    for section, values in changes.items():
        data[section].update(values)
    return run, write_recipe(tmp_path, data)


def _it(run: Path, step: int) -> Path:
    return run / CKPT / f"iter_{step:07d}"


# Damage done to a copy of the earlier run -> what `train --steps 6` must say (exit 1), leaving
# every file as it was.
REFUSED = {
    "latest deleted, newest damaged": (
        lambda run: ((run / CKPT / "latest").unlink(), _corrupt(_it(run, 4))),
        ["latest is missing", "iter_0000004", "corrupt", "--resume-from-last-good", "step 2"],
    ),
    "latest damaged": (
        lambda run: _corrupt(_it(run, 4)),
        ["iter_0000004", "corrupt", "--resume-from-last-good", "step 2"],
    ),
    "manifest missing, shard damaged": (
        lambda run: ((_it(run, 4) / "manifest.json").unlink(), _corrupt_unlisted(_it(run, 4))),
        ["iter_0000004 has no manifest.json", "--trust-unverified-checkpoint"],
    ),
    "manifest not JSON": (
        lambda run: (_it(run, 4) / "manifest.json").write_text("{oops"),
        ["iter_0000004/manifest.json: not a checkpoint manifest", "--resume-from-last-good"],
    ),
    "metrics line 2 of 4 not JSON": (
        lambda run: _cut_metrics_line(run, 1),
        ["metrics.jsonl:2: not a metrics record"],
    ),
    "no checkpoint verifies": (
        lambda run: (_corrupt(_it(run, 4)), _corrupt(_it(run, 2))),
        ["iter_0000004", "iter_0000002", "no checkpoint", "verifies"],
    ),
}


def _corrupt_unlisted(checkpoint: Path) -> None:
    shard = max(checkpoint.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 16] = bytes(16)
    shard.write_bytes(bytes(data))


def _cut_metrics_line(run: Path, index: int) -> None:
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[index] = lines[index][:40]
    path.write_text("".join(f"{line}\n" for line in lines))


# The damaged latest checkpoint is a full load that must fail (the slow tier).
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, marks=pytest.mark.slow) if c.startswith("latest") else c
        for c in sorted(REFUSED)
    ],
)
def test_a_damaged_run_directory_is_refused_and_left_as_it_was(earlier_run, tmp_path, case):
    damage, needles = REFUSED[case]
    run, recipe = _copy(earlier_run, tmp_path)
    damage(run)
    before = _hashes(run)
    one_line_error(cli("train", str(recipe), "--steps", "6"), *needles)
    assert _hashes(run) == before, "a refused run changed the earlier run's files"


# Arguments or recipe changes that do not fit the run in the directory -> the message (exit 1).
MISFITS = {
    "--overwrite without --no-resume": ({}, ["--overwrite"], ["--overwrite", "--no-resume"]),
    "--steps below the run's step": ({}, ["--steps", "3"], ["at step 4", "past --steps 3"]),
    "hidden_size changed": (
        {"model": {"hidden_size": 96}},
        [],
        ["iter_0000004", "model.hidden_size 64, the recipe says 96"],
    ),
    "num_experts changed": (
        {"model": {"num_experts": 8}},
        [],
        ["model.num_experts 4, the recipe says 8", "router.weight"],
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(MISFITS))
def test_a_run_that_does_not_fit_the_directory_is_refused(earlier_run, tmp_path, case):
    changes, args, needles = MISFITS[case]
    run, recipe = _copy(earlier_run, tmp_path, **changes)
    before = _hashes(run)
    one_line_error(cli("train", str(recipe), *(args or ["--steps", "6"])), *needles)
    assert _hashes(run) == before


def test_steps_already_trained_say_so_and_change_nothing(earlier_run, tmp_path):
    run, recipe = _copy(earlier_run, tmp_path)
    before = _hashes(run)
    proc = cli("train", str(recipe), "--steps", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "at step 4 already (--steps 4): nothing to train" in proc.stderr
    assert _hashes(run) == before


@pytest.mark.slow
def test_a_missing_latest_resumes_from_the_newest_checkpoint_saying_so(earlier_run, tmp_path):
    run, recipe = _copy(earlier_run, tmp_path)
    (run / CKPT / "latest").unlink()
    before = (run / "metrics.jsonl").read_text()
    proc = cli("train", str(recipe), "--steps", "5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "latest is missing; resuming from step 4" in proc.stderr
    after = (run / "metrics.jsonl").read_text()
    assert after.startswith(before), "the metrics of steps 1-4 were rewritten: it started over"
    assert [r["step"] for r in run_metrics(run)] == [1, 2, 3, 4, 5]


@pytest.mark.slow
def test_resume_from_last_good_falls_back_loudly(earlier_run, tmp_path):
    run, recipe = _copy(earlier_run, tmp_path)
    _corrupt(_it(run, 4))
    proc = cli("train", str(recipe), "--steps", "5", "--resume-from-last-good")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "NOT RESUMING FROM THE LATEST CHECKPOINT" in proc.stderr
    assert "iter_0000004" in proc.stderr and "resuming from step 2" in proc.stderr
    assert [r["step"] for r in run_metrics(run)] == [1, 2, 3, 4, 5]
    assert (run / CKPT / "latest").read_text().strip() == "5"


@pytest.mark.slow
def test_an_unverified_checkpoint_loads_only_when_trusted(earlier_run, tmp_path):
    run, recipe = _copy(earlier_run, tmp_path)
    (_it(run, 4) / "manifest.json").unlink()
    proc = cli("train", str(recipe), "--steps", "5", "--trust-unverified-checkpoint")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loading it unverified" in proc.stderr
    assert [r["step"] for r in run_metrics(run)] == [1, 2, 3, 4, 5]


@pytest.mark.slow
def test_a_metrics_line_cut_short_is_dropped_on_resume_and_by_plot(earlier_run, tmp_path):
    run, recipe = _copy(earlier_run, tmp_path)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "reward_mean": 0.1, "clip')  # a write interrupted by a kill
    plotted = cli("plot", str(run))
    assert plotted.returncode == 0, plotted.stderr[-3000:]
    assert "cut short" in plotted.stderr
    proc = cli("train", str(recipe), "--steps", "5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dropping a last line cut short" in proc.stderr
    assert [r["step"] for r in run_metrics(run)] == [1, 2, 3, 4, 5]


def test_plot_names_the_line_of_a_bad_metrics_record(earlier_run, tmp_path):
    run, _ = _copy(earlier_run, tmp_path)
    _cut_metrics_line(run, 2)
    one_line_error(cli("plot", str(run)), f"{run / 'metrics.jsonl'}:3")


# -- one trainer per directory ------------------------------------------------------------


@pytest.mark.slow
def test_a_second_trainer_is_refused_and_a_killed_ones_lock_is_not_stale(tmp_path):
    run = tmp_path / "run"
    recipe = write_recipe(tmp_path, loop_recipe(run, run={**QUIET, "checkpoint_every": 1}))
    first = cli_train(recipe, "--steps", "1000")
    wait_for(lambda: (run / CKPT / "latest").is_file(), 240, first)
    second = cli("train", str(recipe), "--steps", "1000")
    one_line_error(second, f"{run} is in use by another trainer", f"pid {first.pid}", "host")
    os.killpg(first.pid, signal.SIGKILL)
    first.communicate(timeout=30)
    steps = [r["step"] for r in run_metrics(run)]
    assert steps == list(range(1, len(steps) + 1)), f"two trainers wrote metrics: {steps}"
    latest = int((run / CKPT / "latest").read_text())
    # The lock died with the killed trainer: the next one starts at once and resumes.
    third = cli("train", str(recipe), "--steps", str(latest + 1))
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"at step {latest}" in third.stderr


def test_a_filesystem_without_locks_is_warned_about(tmp_path, monkeypatch, caplog):
    import fcntl

    from megatron_gspo.run import rundir

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "lockf", no_locks)
    lock = rundir.RunLock.acquire(tmp_path / "run")
    try:
        assert "does not lock files (No locks available)" in caplog.text
        assert f"pid {os.getpid()}" in (tmp_path / "run" / ".lock").read_text()
    finally:
        lock.release()


# -- signals --------------------------------------------------------------------------------


def _importing_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.parametrize("resumed", [False, True])
def test_sigterm_during_start_up_exits_75_having_changed_nothing(earlier_run, tmp_path, resumed):
    if resumed:
        run, recipe = _copy(earlier_run, tmp_path)
    else:
        run = tmp_path / "run"
        recipe = write_recipe(tmp_path, loop_recipe(run, run=QUIET))
    before = _hashes(run) if resumed else {}
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_gspo.cli", "train", str(recipe), "--steps", "6"],
        stderr=subprocess.PIPE,
        text=True,
    )
    # SIGTERM while the trainer imports torch and Megatron, seconds before its first step
    # (torch's libraries are mapped, its modules not yet run).
    deadline = time.monotonic() + 60
    while proc.poll() is None and not _importing_torch(proc.pid):
        assert time.monotonic() < deadline, "torch never loaded"
        time.sleep(0.002)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 75, err[-3000:]
    assert "stopped on SIGTERM during start-up (nothing to save)" in err
    after = {k: v for k, v in _hashes(run).items() if k != ".preempted"}
    assert after == before, "a run stopped before its first step changed the directory"
    assert (run / ".preempted").read_text().strip() == ("4" if resumed else "0")


# -- files that cannot be written -------------------------------------------------------------


def test_an_output_dir_under_a_regular_file_is_one_line(tmp_path):
    (tmp_path / "afile").write_text("")
    recipe = write_recipe(tmp_path, loop_recipe(tmp_path / "afile" / "run", run=QUIET))
    for command in ("train", "validate"):
        proc = cli(command, str(recipe))
        one_line_error(proc, "run directory", "afile is a file, not a directory")


@pytest.mark.slow
def test_a_full_disk_is_one_line_naming_the_checkpoint(tmp_path):
    """On a 1 MiB tmpfs (mounting needs root): the first checkpoint (2.4 MB) does not fit."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)])
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        recipe = write_recipe(tmp_path, loop_recipe(disk / "run", run=QUIET))
        proc = cli("train", str(recipe), "--steps", "2")
        one_line_error(proc, f"cannot write checkpoint {disk / 'run' / CKPT}", "MiB free")
    finally:
        subprocess.run(["umount", str(disk)], check=True)


# -- bad recipes and arguments ----------------------------------------------------------------

BAD_RECIPES = {
    "run.checkpoint_every: 0": ({"run": {"checkpoint_every": 0}}, "run.checkpoint_every"),
    "run.steps: -5": ({"run": {"steps": -5}}, "run.steps"),
    "misspelt reward": (
        {"reward": {"functions": [{"name": "digit_mach"}]}},
        "reward.functions[0]: unknown reward 'digit_mach'",
    ),
    "kwargs the reward does not take": (
        {"reward": {"functions": [{"name": "digit_match", "kwargs": {"scale": 2}}]}},
        "unexpected keyword argument 'scale'",
    ),
    "max_new_tokens fills the sequence": (
        {"rollout": {"max_new_tokens": 64}},
        "rollout.max_new_tokens (64) leaves no room",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_RECIPES))
def test_validate_refuses_what_train_would(tmp_path, case):
    changes, needle = BAD_RECIPES[case]
    data = loop_recipe(tmp_path / "run", run=QUIET)
    for section, values in changes.items():
        data[section].update(values)
    recipe = write_recipe(tmp_path, data)
    one_line_error(cli("validate", str(recipe)), needle)


def test_validate_refuses_a_run_directory_of_another_model(earlier_run, tmp_path):
    run, recipe = _copy(earlier_run, tmp_path, model={"hidden_size": 96})
    proc = cli("validate", str(recipe), "--output-dir", str(run))
    one_line_error(proc, "iter_0000004", "model.hidden_size 64, the recipe says 96")


def test_a_binary_recipe_is_one_line(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes(b"\x80\x81" + os.urandom(200))
    for command in ("train", "validate"):
        one_line_error(cli(command, str(recipe)), f"{recipe}: not a text file")


def test_plan_refuses_zero_nodes(tmp_path):
    proc = cli("plan", str(ROOT / "recipes" / "tiny-moe.yaml"), "--nodes", "0")
    assert proc.returncode == 2 and "'--nodes': 0 is not in the range" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_debug_adds_the_traceback_to_the_one_line(tmp_path, monkeypatch):
    data = loop_recipe(tmp_path / "run", run=QUIET)
    data["reward"]["functions"] = [{"name": "digit_mach"}]
    recipe = write_recipe(tmp_path, data)
    monkeypatch.setenv("MEGATRON_GSPO_DEBUG", "1")
    proc = cli("train", str(recipe))
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "Error: reward.functions[0]" in proc.stderr


@pytest.mark.parametrize("args", [["convert", "--help"], ["validate", "tiny-moe.yaml"]])
def test_commands_print_no_megatron_import_warnings(args):
    proc = cli(*args, cwd=ROOT / "recipes")
    assert proc.returncode in (0, 3), proc.stderr[-3000:]
    assert "not installed" not in proc.stdout + proc.stderr, proc.stderr


# -- a huge prompt ----------------------------------------------------------------------------

_PEAK = """
import resource, sys
from megatron_gspo.config import DataConfig
from megatron_gspo.data.prompts import PromptStream
s = PromptStream(DataConfig(path=sys.argv[1], tokenizer=sys.argv[2], shuffle=False), seed=0,
                 max_prompt_tokens=60)
s.next_batch(8)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, s.skipped)
"""


def test_a_10_mb_prompt_costs_a_few_copies_of_itself_not_its_tokens(tmp_path):
    """Tokenizing a 10 MB line whole took 0.5 GB (50 times the line) in this process alone
    (4.24 GB in a trainer); only its first characters need tokenizing to know it is too long."""

    tok = train_sentencepiece(tmp_path)
    prompts = ["1 2", "3 4", "5", "6 7"] * 3
    huge = "1 2 3 " * 1_750_000

    def peak(name: str, lines: list[str]) -> tuple[int, int]:
        path = tmp_path / name
        path.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in lines))
        out = subprocess.run(
            [sys.executable, "-c", _PEAK, str(path), str(tok)],
            capture_output=True,
            text=True,
            check=True,
        )
        rss, skipped = out.stdout.split()
        return int(rss), int(skipped)

    base, _ = peak("base.jsonl", prompts)
    with_huge, skipped = peak("huge.jsonl", prompts[:2] + [huge] + prompts[2:])
    assert skipped == 1
    extra = with_huge - base
    assert extra < 4 * len(huge), f"{extra / 2**20:.0f} MiB for a {len(huge) / 2**20:.0f} MB line"
