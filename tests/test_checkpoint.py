"""Checkpoints: verified against their manifest, never holding NaN, and resumable on another
parallel layout as the original layout would have continued."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_gspo.config import Recipe
from tests.support.ranks import run_distributed
from tests.support.runs import (
    comparable,
    loop_recipe,
    run_metrics,
    run_weights,
    straight_and_resumed,
    train_run,
)

EP2 = {"parallel": {"expert_model_parallel_size": 2}}
DP2_DISTOPT = {"memory": {"use_distributed_optimizer": True}}
TP2_SP = {
    "parallel": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    # The in-process engine cannot decode under sequence parallelism; the worker can.
    "rollout": {"local_worker": True},
}
ONE = {}


def _layout(run_dir: Path, **layout) -> dict:
    data = loop_recipe(run_dir, run={"plot_every": 0, "tensorboard": False})
    data["memory"] = {"use_distributed_optimizer": False}
    # Megatron's load-balancing loss is per rank and micro-batch, so another layout changes
    # it (a semantic difference, not round-off); it is off where layouts are compared.
    data["model"]["moe_aux_loss_coeff"] = 0.0
    for section, values in layout.items():
        data.setdefault(section, {}).update(values)
    return data


def _close(a: float, b: float, rel: float = 1e-4) -> bool:
    return abs(a - b) <= rel * max(1.0, abs(a), abs(b))


@pytest.mark.slow
@pytest.mark.parametrize(
    "first,then",
    [
        pytest.param((1, ONE), (2, EP2), id="1rank-to-ep2"),
        pytest.param((2, EP2), (1, ONE), id="ep2-to-1rank"),
        pytest.param((2, DP2_DISTOPT), (1, DP2_DISTOPT), id="dp2-distopt-to-dp1"),
        pytest.param((1, ONE), (2, TP2_SP), id="1rank-to-tp2-sp"),
    ],
)
def test_resume_on_another_layout_continues_as_the_original_would(tmp_path, first, then):
    (world_a, layout_a), (world_b, layout_b) = first, then
    straight = _layout(tmp_path / "straight", **layout_a)
    split_a = _layout(tmp_path / "split", **layout_a)
    split_b = _layout(tmp_path / "split", **layout_b)
    if "rollout" in layout_b:  # the same engine on both sides of the comparison
        for d in (straight, split_a):
            d["rollout"].update(layout_b["rollout"])
    run_distributed(train_run, world_a, straight, 4, True)
    run_distributed(train_run, world_a, split_a, 2, True)
    run_distributed(train_run, world_b, split_b, 4, True)
    a, b = run_metrics(tmp_path / "straight"), run_metrics(tmp_path / "split")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b, strict=True):
        ca, cb = comparable(ra), comparable(rb)
        assert ca.keys() == cb.keys()
        for key in ("reward_mean", "loss", "approx_kl", "clip_fraction", "grad_norm"):
            assert _close(ca[key], cb[key]), f"step {ra['step']} {key}: {ca[key]} vs {cb[key]}"
    wa = run_distributed(run_weights, world_a, straight, 4)[0]
    wb = run_distributed(run_weights, world_b, split_b, 4)[0]
    start = run_distributed(run_weights, world_a, split_a, 2)[0]
    for k in wa:
        update = (wa[k] - start[k]).abs().max().clamp_min(1e-12)
        err = float((wa[k] - wb[k]).abs().max() / update)
        assert err <= 1e-3, f"{k}: resumed weights differ by {err:.2e} of the last updates"


def _save_and_damage(rank, world, data: dict, how: str):
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.run.checkpoint import Checkpointer, CheckpointError
    from megatron_gspo.trainer.policy import Policy
    from megatron_gspo.trainer.step import GSPOTrainer
    from tests.support.rl_fixtures import rollout_batch

    recipe = Recipe.model_validate(data)
    policy = Policy(recipe, init_parallel(recipe.parallel))
    GSPOTrainer(policy).step(rollout_batch(vocab=recipe.model.vocab_size))
    ckpts = Checkpointer(Path(recipe.run.output_dir) / "checkpoints", policy)
    path = ckpts.save(1, {})
    manifest = json.loads((path / "manifest.json").read_text())
    shard = max(manifest["files"], key=lambda f: manifest["files"][f]["bytes"])
    if rank == 0 and how == "zeroed":
        with open(path / shard, "r+b") as f:
            f.seek(manifest["files"][shard]["bytes"] // 2)
            f.write(b"\0" * 64)
    elif rank == 0 and how == "truncated":
        with open(path / shard, "r+b") as f:
            f.truncate(manifest["files"][shard]["bytes"] - 100)
    torch.distributed.barrier()
    try:
        ckpts.load(1)
    except CheckpointError as e:
        return shard, str(e)
    return shard, "loaded"


@pytest.mark.parametrize("how", ["zeroed", "truncated"])
def test_a_damaged_shard_is_named_not_loaded(tmp_path, how):
    data = _layout(tmp_path / "run")
    shard, message = run_distributed(_save_and_damage, 2, data, how)[0]
    assert shard in message and ("corrupt" in message or "truncated" in message), message


def _save_nan(rank, world, data: dict):
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.run.checkpoint import Checkpointer, CheckpointError
    from megatron_gspo.trainer.policy import Policy
    from megatron_gspo.trainer.step import GSPOTrainer
    from tests.support.rl_fixtures import rollout_batch

    recipe = Recipe.model_validate(data)
    policy = Policy(recipe, init_parallel(recipe.parallel))
    GSPOTrainer(policy).step(rollout_batch(vocab=recipe.model.vocab_size))
    ckpts = Checkpointer(Path(recipe.run.output_dir) / "checkpoints", policy)
    ckpts.save(1, {})
    with torch.no_grad():
        next(policy.model.parameters()).fill_(float("nan"))
    try:
        ckpts.save(2, {})
    except CheckpointError as e:
        return str(e), ckpts.latest_step()
    return "saved", ckpts.latest_step()


def test_weights_holding_nan_are_never_checkpointed(tmp_path):
    message, latest = run_distributed(_save_nan, 1, _layout(tmp_path / "run"))[0]
    assert "NaN" in message and latest == 1, (message, latest)


@pytest.mark.slow
def test_distributed_optimizer_resumes_bit_exactly_on_the_same_layout(tmp_path):
    """Adam's step count and moments come back exactly (DP2, distributed optimizer)."""
    straight = _layout(tmp_path / "straight", **DP2_DISTOPT)
    split = _layout(tmp_path / "split", **DP2_DISTOPT)
    a, b = straight_and_resumed(straight, split, world=2)
    assert [comparable(r) for r in a] == [comparable(r) for r in b]
    wa = run_distributed(run_weights, 2, straight, 4)[0]
    wb = run_distributed(run_weights, 2, split, 4)[0]
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "weights differ after resume"


FIXTURES = Path(__file__).parent / "fixtures"


def test_a_checkpoint_written_before_the_package_moved_resumes(tmp_path):
    """Checkpoints name no module of the project (no pickled classes: tensors, numbers and
    JSON), so a run written by the flat layout of earlier releases resumes with this one,
    its queued rollout batch included (tests/fixtures/README.md says how it was written)."""
    import shutil
    import subprocess
    import sys

    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "pre-layers-run", run)
    recipe = run / "recipe-as-run.yaml"
    cmd = [sys.executable, "-m", "megatron_gspo", "train", str(recipe), "--output-dir", str(run)]
    proc = subprocess.run([*cmd, "--steps", "3"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr and "at step 2" in proc.stderr, proc.stderr[-3000:]
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    # Step 3 trains the batch the old run had queued: sampled by the weights of step 1.
    assert records[-1]["staleness_max"] == 1
    assert (run / "checkpoints" / "iter_0000003").is_dir()
