"""The RL loop end to end: metrics, checkpoints, plots, resume, pre-emption, bad input."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml

from megatron_gspo.config import Recipe
from tests.support.ranks import run_distributed
from tests.support.runs import cli_train, loop_recipe, run_metrics, run_weights, train_run, wait_for


def test_short_run_writes_metrics_checkpoints_and_plots(tmp_path):
    data = loop_recipe(tmp_path / "run")
    run_distributed(train_run, 1, data, 3, True)
    run = tmp_path / "run"
    records = run_metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3]
    for key in (
        "reward_mean",
        "reward_std",
        "clip_fraction",
        "clip_fraction_tok",
        "seq_log_ratio_abs_max",
        "approx_kl",
        "entropy",
        "response_length_mean",
        "routing_flip_rate",
        "rollout_logprob_abs_diff",
        "step_time_s",
    ):
        assert key in records[-1], f"metric {key} missing"
    # Rollout log-probs come from the same weights as the recomputed old log-probs.
    assert records[0]["rollout_logprob_abs_diff"] < 1e-4
    assert (run / "checkpoints" / "latest").read_text().strip() == "3"
    assert sorted(p.name for p in (run / "checkpoints").glob("iter_*")) == [
        "iter_0000002",
        "iter_0000003",
    ]
    assert (run / "plots" / "training.png").stat().st_size > 10_000
    assert list((run / "tensorboard").glob("events.*"))


LEARN_STEPS = 60
LEARN_SEEDS = (0, 1, 2)
# The median reward over the second half of a run must reach this; it starts near 0.02.
LEARNED_MEDIAN = 0.15


def _learning_recipe(output_dir: Path, seed: int) -> dict:
    """Copy one digit with two new tokens: ~0.02 reward at random, learnable in 60 steps."""
    return loop_recipe(
        output_dir,
        data={"task_options": {"min_len": 1, "max_len": 1}},
        rollout={"prompts_per_step": 16, "group_size": 8, "max_new_tokens": 2, "seed": seed},
        parallel={"seed": 1234 + seed},
        optimizer={"lr": 0.003},
        run={"checkpoint_every": 1000, "plot_every": 0, "tensorboard": False},
    )


def _train_with_flipped_advantages(rank, world, data: dict, steps: int, resume: bool):
    """The loop with the sign of every advantage flipped: a broken update that must not learn."""
    import megatron_gspo.episodes.scoring as scoring

    correct = scoring.group_advantages
    scoring.group_advantages = lambda *args, **kwargs: -correct(*args, **kwargs)
    train_run(rank, world, data, steps, resume)


def _median_of_second_half(rewards: list[float]) -> float:
    return statistics.median(rewards[len(rewards) // 2 :])


@pytest.mark.slow
def test_reward_improves_on_an_easy_task(tmp_path):
    """Every seed learns, and the same recipe with flipped advantages does not.

    Runs differ between machines (MKL picks GEMM kernels by CPU, and a run amplifies a 1e-9
    difference within ~20 steps), so this asserts a margin, not a trajectory: at lr 0.003 the
    median reward over steps 31-60 was 0.25-0.50 for seeds 0-5 under MKL's default,
    ``MKL_CBWR=COMPATIBLE`` and ``MKL_CBWR=AVX2`` paths, against 0.15 required. The median of
    the second half cannot be decided by a late collapse or a lucky step alone. A broken update
    fails it: flipped advantages drive the reward to 0.000 (checked here, every run), zeroed
    advantages leave it flat at ~0.02. A wrong constant normalization is invisible to any
    learning test under Adam (scale-invariant); the gradient tests (test_loss_policy.py) and the
    layout tests (test_train_step.py) pin that down.
    """
    runs = {
        seed: (train_run, _learning_recipe(tmp_path / f"seed{seed}", seed)) for seed in LEARN_SEEDS
    }
    runs["flipped"] = (_train_with_flipped_advantages, _learning_recipe(tmp_path / "flipped", 0))
    # Single-threaded runs, two cores: run them side by side.
    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        futures = {
            name: pool.submit(run_distributed, fn, 1, data, LEARN_STEPS, True)
            for name, (fn, data) in runs.items()
        }
        for future in futures.values():
            future.result()
    rewards = {
        name: [r["reward_mean"] for r in run_metrics(Path(data["run"]["output_dir"]))]
        for name, (_, data) in runs.items()
    }
    summary = ", ".join(
        f"{name}: {sum(r[:5]) / 5:.3f} -> {_median_of_second_half(r):.3f}"
        for name, r in rewards.items()
    )
    for seed in LEARN_SEEDS:
        assert _median_of_second_half(rewards[seed]) >= LEARNED_MEDIAN, (
            f"seed {seed} did not learn: median reward of steps {LEARN_STEPS // 2 + 1}-"
            f"{LEARN_STEPS} below {LEARNED_MEDIAN} (first 5 steps -> median of the second half: "
            f"{summary})"
        )
    assert _median_of_second_half(rewards["flipped"]) < LEARNED_MEDIAN, (
        f"flipped advantages passed the learning criterion, so it proves nothing: {summary}"
    )


@pytest.mark.slow
def test_resume_continues_exactly(tmp_path):
    straight = loop_recipe(tmp_path / "straight")
    split = loop_recipe(tmp_path / "split")
    run_distributed(train_run, 1, straight, 4, True)
    run_distributed(train_run, 1, split, 2, True)
    run_distributed(train_run, 1, split, 4, True)
    a, b = run_metrics(tmp_path / "straight"), run_metrics(tmp_path / "split")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    skip = {k for k in a[0] if k.startswith("time_") or k.endswith("_s") or k.endswith("_per_s")}
    for ra, rb in zip(a, b, strict=True):
        assert {k: v for k, v in ra.items() if k not in skip} == {
            k: v for k, v in rb.items() if k not in skip
        }, f"step {ra['step']} differs after resume"
    wa = run_distributed(run_weights, 1, straight, 4)[0]
    wb = run_distributed(run_weights, 1, split, 4)[0]
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "weights differ after resume"


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    run = tmp_path / "run"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(loop_recipe(run, run={"checkpoint_every": 1000, "plot_every": 0}))
    )
    proc = cli_train(recipe, "--steps", "1000")
    metrics = run / "metrics.jsonl"
    wait_for(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 2, 240, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, f"a run stopped after a checkpoint exits 75\n{out}"
    assert (run / ".preempted").read_text().strip() == str(run_metrics(run)[-1]["step"])
    last = run_metrics(run)[-1]["step"]
    assert (run / "checkpoints" / "latest").read_text().strip() == str(last)
    assert "SIGTERM: saved a checkpoint" in out


@pytest.mark.slow
def test_kill_during_checkpoint_write_leaves_previous_checkpoint_loadable(tmp_path):
    run = tmp_path / "run"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(loop_recipe(run, run={"checkpoint_every": 1, "plot_every": 0}))
    )
    proc = cli_train(recipe, "--steps", "1000")
    ckpts = run / "checkpoints"
    # Wait until a checkpoint exists and the next one is being written, then kill -9.
    wait_for(lambda: (ckpts / "latest").is_file() and any(ckpts.glob(".iter_*.tmp")), 240, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    latest = int((ckpts / "latest").read_text())
    assert (ckpts / f"iter_{latest:07d}" / "trainer_state.json").is_file()
    resumed = cli_train(recipe, "--steps", str(latest + 1))
    out, _ = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, out
    assert f"resumed from {ckpts} at step {latest}" in out
    assert not list(ckpts.glob(".iter_*.tmp")), "the partial checkpoint was not cleaned up"


@pytest.mark.parametrize(
    "change,message",
    [
        (
            {"data": {"task": None, "path": "missing.jsonl", "tokenizer": "tok.model"}},
            "missing.jsonl",
        ),
        ({"reward": {"functions": [{"name": "nosuch"}]}}, "unknown reward 'nosuch'"),
        ({"rollout": {"max_new_tokens": "six"}}, "rollout.max_new_tokens"),
        ({"train": {"mini_bathces": 2}}, "train.mini_bathces: unknown key"),
        # Raised in the first update, with the reward workers (which ignore SIGTERM) running:
        # the trainer must still exit.
        ({"train": {"micro_batch_tokens": 4}}, "exceeds train.micro_batch_tokens"),
    ],
)
def test_bad_input_gives_a_clear_message(tmp_path, change, message):
    data = loop_recipe(tmp_path / "run")
    for section, values in change.items():
        data[section] = {**data.get(section, {}), **values}
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data))
    (tmp_path / "tok.model").write_bytes(b"")
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_gspo.cli", "train", str(recipe)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=240,
    )
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def _draw_from_every_generator() -> None:
    import random

    import numpy as np
    from megatron.core import tensor_parallel

    torch.rand(7)
    random.random()
    np.random.rand(3)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        torch.rand(5)


def _save_rng(rank, world, data: dict):
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.run.checkpoint import Checkpointer
    from megatron_gspo.run.rng import get_rng_state
    from megatron_gspo.trainer.policy import Policy
    from megatron_gspo.trainer.step import GSPOTrainer
    from tests.support.rl_fixtures import rollout_batch

    recipe = Recipe.model_validate(data)
    policy = Policy(recipe, init_parallel(recipe.parallel))
    # Megatron saves Adam's states only once there are some.
    GSPOTrainer(policy).step(rollout_batch(vocab=recipe.model.vocab_size))
    # Ranks draw different amounts, so each rank's own state must come back to it.
    for _ in range(rank + 1):
        _draw_from_every_generator()
    saved = get_rng_state()
    Checkpointer(Path(recipe.run.output_dir) / "checkpoints", policy).save(1, {})
    return saved


def _load_rng(rank, world, data: dict):
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.run.checkpoint import Checkpointer
    from megatron_gspo.run.rng import get_rng_state
    from megatron_gspo.trainer.policy import Policy

    recipe = Recipe.model_validate(data)
    policy = Policy(recipe, init_parallel(recipe.parallel))
    for _ in range(3):
        _draw_from_every_generator()
    before = get_rng_state()
    Checkpointer(Path(recipe.run.output_dir) / "checkpoints", policy).load(1)
    return before, get_rng_state()


def _same_state(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, tuple | list):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_resume_restores_every_random_generator_of_every_rank(tmp_path):
    data = loop_recipe(tmp_path / "run", memory={"use_distributed_optimizer": False})
    saved = run_distributed(_save_rng, 2, data)
    loaded = run_distributed(_load_rng, 2, data)
    assert saved[0]["megatron"], "Megatron's RNG tracker holds no state; nothing is checked"
    assert {"torch", "python", "numpy", "megatron"} <= saved[0].keys()
    for rank, (state, (before, after)) in enumerate(zip(saved, loaded, strict=True)):
        for name in state:
            assert not _same_state(before[name], state[name]), (
                f"rank {rank}: generator {name!r} already had the saved state before the load"
            )
            assert _same_state(after[name], state[name]), (
                f"rank {rank}: generator {name!r} differs from its saved state after the load"
            )
