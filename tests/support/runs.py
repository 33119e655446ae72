"""Training runs for tests: the tiny recipe shrunk, runs in process or through the command line,
their metrics and weights."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

from megatron_gspo.config import Recipe
from tests.support.ranks import run_distributed

ROOT = Path(__file__).resolve().parents[2]


def loop_recipe(output_dir: Path, **sections) -> dict:
    """The tiny recipe, shrunk for a test's budget."""
    data = yaml.safe_load((ROOT / "recipes" / "tiny-moe.yaml").read_text())
    data["rollout"].update(prompts_per_step=8, group_size=4)
    data["run"].update(output_dir=str(output_dir), checkpoint_every=2, plot_every=2)
    data["run"]["tensorboard"] = True
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return data


def train_run(rank, world, data: dict, steps: int, resume: bool):
    from megatron_gspo.run.loop import train

    recipe = Recipe.model_validate(data)
    train(recipe, output_dir=recipe.run.output_dir, resume=resume, steps=steps)


def run_weights(rank, world, data: dict, step: int):
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.run.checkpoint import Checkpointer
    from megatron_gspo.trainer.policy import Policy
    from megatron_gspo.weights import gather_full_state_dict

    recipe = Recipe.model_validate(data)
    policy = Policy(recipe, init_parallel(recipe.parallel))
    Checkpointer(Path(recipe.run.output_dir) / "checkpoints", policy).load(step)
    return gather_full_state_dict(policy.model)


def run_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def straight_and_resumed(
    straight: dict, split: dict, *, world: int = 1, steps: int = 4, stop_at: int = 2
) -> tuple[list[dict], list[dict]]:
    """The metrics of a run trained straight through ``steps`` and of the same recipe stopped
    after ``stop_at`` steps and resumed to ``steps``."""
    run_distributed(train_run, world, straight, steps, True)
    run_distributed(train_run, world, split, stop_at, True)
    run_distributed(train_run, world, split, steps, True)
    return run_metrics(Path(straight["run"]["output_dir"])), run_metrics(
        Path(split["run"]["output_dir"])
    )


def cli_train(recipe_path: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "megatron_gspo.cli", "train", str(recipe_path), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # Its own process group, so that a kill reaches checkpoint-writer children too, as a
        # scheduler's kill would.
        start_new_session=True,
    )


def wait_for(predicate, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"training exited early:\n{proc.stdout.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("timed out waiting for the training run")
        time.sleep(0.01)


TIME_KEYS = ("time_", "_s", "_per_s")


def comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not (k.startswith("time_") or k.endswith(TIME_KEYS))}


QUIET = {"plot_every": 0, "tensorboard": False}


def write_recipe(tmp_path: Path, data: dict, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def cli(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_gspo.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
    )


def one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for needle in needles:
        assert needle in proc.stderr, proc.stderr[-3000:]


def assert_no_sample_lost(records: list[dict]) -> None:
    """No reward, environment or group failed at any step of ``records`` (metrics.jsonl)."""
    for r in records:
        for key in ("reward_errors", "reward_timeouts", "env_errors", "env_timeouts",
                    "groups_dropped_on_error"):  # fmt: skip
            assert r.get(key, 0) == 0, f"step {r['step']}: {key} = {r[key]}"
