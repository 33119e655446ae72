"""rollout.max_rollout_kl: a sampler that keeps disagreeing with the trainer stops the run.

The guard alone (fed metrics step by step), the recipe keys, and the real loop through the CLI
with a generation worker that samples from perturbed weights
(``tests.support.perturbed_sampler``): it
stops with one line and exit 1, on-policy and one step off-policy (where the probe after each
sync sees it); a one-off spike, healthy steps and a policy that changes fast do not stop it.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_gspo.config import Recipe, RolloutConfig
from megatron_gspo.run.kl_guard import METRIC, RolloutKLGuard, RolloutMismatchError
from tests.support.runs import ROOT, loop_recipe, run_metrics


def _guard(limit=0.05, steps=3, **kw) -> RolloutKLGuard:
    return RolloutKLGuard(limit=limit, steps=steps, engine="vllm", family="deepseek_v3", **kw)


def _feed(guard: RolloutKLGuard, values) -> int | None:
    """The step at which the guard stops (None: it never does)."""
    for step, value in enumerate(values, 1):
        try:
            guard.check(step, {} if value is None else {METRIC: value})
        except RolloutMismatchError:
            return step
    return None


def test_a_figure_that_stays_above_the_limit_stops_at_the_nth_step():
    assert _feed(_guard(), [1e-6, 0.2, 0.3, 0.4, 0.5]) == 4


def test_the_error_names_the_figure_the_engine_the_model_and_the_causes():
    guard = _guard(steps=2, staleness=1)
    with pytest.raises(RolloutMismatchError) as e:
        for step in (7, 8):
            guard.check(step, {METRIC: 0.25, "rollout_kl_k3": 0.5})
    message = str(e.value)
    for needle in (
        "rollout_sampler_kl",
        "rollout.max_rollout_kl = 0.05",
        "step 7: 0.25, step 8: 0.25",
        "same weights",
        "vllm engine",
        "deepseek_v3",
        "rollout_kl_k3, sampled against trained tokens, was 0.5",
        "dtype",
        "kernel",
        "sync",
    ):
        assert needle in message, f"{needle!r} not in: {message}"
    assert "\n" not in message


def test_the_drift_alone_never_stops_a_run():
    """rollout_kl_k3 holds the policy's own change under max_staleness; not watched."""
    guard = _guard()
    for step in range(1, 10):
        guard.check(step, {"rollout_kl_k3": 0.5, METRIC: 1e-9})


def test_one_off_spikes_and_the_figure_at_the_limit_do_not_stop_a_run():
    spiky = [1e-6, 0.9, 1e-6, 0.9, 0.9, 1e-6, 0.05, 0.05, 0.05, 0.9]
    assert _feed(_guard(), spiky) is None


def test_steps_without_the_figure_neither_count_nor_reset():
    assert _feed(_guard(), [0.2, None, 0.3, None, None, 0.4]) == 6
    assert _feed(_guard(), [None] * 10) is None


def test_non_finite_figures_count_as_above():
    assert _feed(_guard(steps=2), [math.nan, math.inf]) == 2


def test_no_limit_never_stops():
    assert _feed(_guard(limit=None, steps=1), [1e9] * 5) is None


def test_the_recipe_keys_are_checked():
    assert RolloutConfig().max_rollout_kl > 0 and RolloutConfig().max_rollout_kl_steps >= 1
    assert RolloutConfig(max_rollout_kl=None).max_rollout_kl is None
    with pytest.raises(ValueError, match="rollout.max_rollout_kl must be > 0"):
        RolloutConfig(max_rollout_kl=0)
    with pytest.raises(ValueError, match="rollout.max_rollout_kl_steps must be >= 1"):
        RolloutConfig(max_rollout_kl_steps=0)
    recipe = Recipe.model_validate(loop_recipe(Path("run")))
    guard = RolloutKLGuard.from_recipe(recipe)
    assert (guard.engine, guard.family) == ("local", "qwen3_moe")


# The real loop, through the CLI ------------------------------------------------------------


def _run(tmp_path: Path, perturb: str, steps: int, **rollout) -> subprocess.CompletedProcess:
    data = loop_recipe(
        tmp_path / "run",
        rollout={"local_worker": True, **rollout},
        run={"plot_every": 0, "tensorboard": False, "checkpoint_every": 1},
    )
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data))
    cmd = [sys.executable, "-m", "tests.support.perturbed_sampler", "train", str(recipe)]
    return subprocess.run(
        [*cmd, "--steps", str(steps)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PERTURB_VERSIONS": perturb},
        timeout=600,
    )


@pytest.mark.slow
def test_a_sampler_with_perturbed_weights_stops_the_run_with_one_line(tmp_path):
    """Stopped at its second bad step even across a resume between the two: the streak is in
    the checkpoint."""
    first = _run(tmp_path, perturb="all", steps=1, max_rollout_kl_steps=2)
    assert first.returncode == 0, first.stderr[-3000:]
    proc = _run(tmp_path, perturb="all", steps=5, max_rollout_kl_steps=2)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for needle in ("rollout_kl_k3", "rollout.max_rollout_kl", "local (generation worker)"):
        assert needle in proc.stderr, proc.stderr[-3000:]
    records = run_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2], "the run went on past the second step"
    limit = RolloutConfig().max_rollout_kl
    assert all(r["rollout_kl_k3"] > limit for r in records), records


@pytest.mark.slow
def test_a_spike_and_healthy_steps_do_not_stop_the_run(tmp_path):
    """Only the snapshot of version 1 (the weights step 2 samples from) is perturbed."""
    proc = _run(tmp_path, perturb="1", steps=4, max_rollout_kl_steps=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    kl = [r["rollout_kl_k3"] for r in run_metrics(tmp_path / "run")]
    limit = RolloutConfig().max_rollout_kl
    print(f"rollout_kl_k3 by step: {kl}")
    assert kl[1] > limit, f"the perturbed step was not above the limit: {kl}"
    healthy = kl[:1] + kl[2:]
    assert max(healthy) < limit / 100, f"healthy steps near the limit: {kl}"


@pytest.mark.slow
def test_an_off_policy_run_with_a_perturbed_sampler_is_stopped_by_the_probe(tmp_path):
    """One step off-policy every batch is sampled by weights the trainer no longer holds, so
    the batch's own tokens cannot tell the sampler's error from the policy's change; the probe
    after each sync scores the same tokens with the same weights on both sides and can."""
    proc = _run(tmp_path, perturb="all", steps=5, max_staleness=1, max_rollout_kl_steps=2)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "rollout_sampler_kl stayed above" in proc.stderr, proc.stderr[-3000:]
    records = run_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2], records
    assert all(r["rollout_sampler_kl"] > RolloutConfig().max_rollout_kl for r in records)


@pytest.mark.slow
def test_an_honest_off_policy_sampler_measures_no_error_beside_the_drift(tmp_path):
    """A healthy sampler one step stale: the probe's figure is fp32 round-off while
    rollout_kl_k3 holds the policy's change per update (a large learning rate makes it
    large), and the run goes on."""
    data = loop_recipe(
        tmp_path / "run",
        rollout={"max_staleness": 1},
        optimizer={"lr": 0.01},
        run={"plot_every": 0, "tensorboard": False},
    )
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data))
    cmd = [sys.executable, "-m", "megatron_gspo", "train", str(recipe), "--steps", "6"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = run_metrics(tmp_path / "run")
    probe = RolloutConfig().sampler_probe
    for r in records[1:]:
        assert r["rollout_sampler_kl"] < 1e-6, r
        assert r["rollout_sampler_kl_tokens"] >= probe, r
    drift = max(r["rollout_kl_k3"] for r in records[1:])
    assert drift > 100 * max(r["rollout_sampler_kl"] for r in records[1:]), records


def test_the_streak_survives_a_checkpoint_so_frequent_resumes_still_stop_a_run():
    """Requeued every 2 steps with a limit of 3: without the saved streak no segment of the run
    ever sees 3 bad steps in a row."""
    import json

    saved: list = []
    for segment in range(3):
        guard = _guard(steps=3)
        guard.restore(json.loads(json.dumps(saved)))  # as trainer_state.json holds it
        try:
            for step in (2 * segment + 1, 2 * segment + 2):
                guard.check(step, {METRIC: math.inf if step == 2 else 0.3, "rollout_kl_k3": 0.6})
        except RolloutMismatchError as e:
            assert "step 1: 0.3, step 2: inf, step 3: 0.3" in str(e), str(e)
            assert segment == 1
            return
        saved = guard.state()
    pytest.fail("a run resumed every 2 steps was never stopped")
