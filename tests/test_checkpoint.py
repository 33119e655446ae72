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


def _saved_before_adams_state_exists(rank, world, data: dict):
    """Two saves before the optimizer's first step (no Adam moments yet: steps whose update was
    skipped), then a step and a save: the third must hold the moments, although Megatron
    reuses the plans of earlier saves while the structure stays the same."""
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.run.checkpoint import Checkpointer
    from megatron_gspo.trainer.policy import Policy
    from megatron_gspo.trainer.step import GSPOTrainer
    from tests.support.rl_fixtures import rollout_batch

    recipe = Recipe.model_validate(data)
    policy = Policy(recipe, init_parallel(recipe.parallel))
    ckpts = Checkpointer(Path(recipe.run.output_dir) / "checkpoints", policy)
    ckpts.save(1, {})
    ckpts.save(2, {})
    GSPOTrainer(policy).step(rollout_batch(vocab=recipe.model.vocab_size))
    inner = [
        o.optimizer for o in getattr(policy.optimizer, "chained_optimizers", [policy.optimizer])
    ]
    moments = [
        {k: v.clone() for k, v in s.items() if torch.is_tensor(v)}
        for o in inner
        for s in o.state.values()
    ]
    ckpts.save(3, {})
    for o in inner:
        for s in o.state.values():
            for v in s.values():
                if torch.is_tensor(v) and v.is_floating_point():
                    v.add_(1.0)
    ckpts.load(3)
    loaded = [s for o in inner for s in o.state.values()]
    worst = max(
        float((loaded[i][k].float() - v.float()).abs().max())
        for i, m in enumerate(moments)
        for k, v in m.items()
    )
    return {"moments": sum(len(m) for m in moments), "worst": worst}


def test_a_save_after_saves_without_adams_state_holds_the_moments(tmp_path):
    (got,) = run_distributed(_saved_before_adams_state_exists, 1, _layout(tmp_path / "run"))
    assert got["moments"] > 0 and got["worst"] == 0.0, got


def _save_in_the_background(rank, world, data: dict):
    """An asynchronous save while the weights go on changing: what is published later must be
    the weights of the step saved."""
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.run.checkpoint import Checkpointer
    from megatron_gspo.trainer.policy import Policy
    from megatron_gspo.trainer.step import GSPOTrainer
    from megatron_gspo.weights.manifest import HASHES_FILE
    from tests.support.rl_fixtures import rollout_batch

    recipe = Recipe.model_validate(data)
    policy = Policy(recipe, init_parallel(recipe.parallel))
    GSPOTrainer(policy).step(rollout_batch(vocab=recipe.model.vocab_size))
    ckpts = Checkpointer(Path(recipe.run.output_dir) / "checkpoints", policy, async_save=True)
    published_at_once = []
    # Three saves: from the third on, Megatron reuses the first saves' plans and metadata.
    for step in (1, 2, 3):
        saved = {
            k: v.detach().clone() for k, v in policy.model.state_dict().items() if v is not None
        }
        path = ckpts.save(step, {"marker": 7 * step})
        with torch.no_grad():  # the loop trains on while the writer writes
            for p in policy.model.parameters():
                p.add_(1.0)
        published_at_once.append(ckpts.latest_step())
    ckpts.wait()
    leftovers = [p.name for p in path.iterdir() if p.name.startswith(HASHES_FILE[:8])]
    manifest = ckpts.verify(3)
    state = ckpts.load(3, manifest=manifest)
    loaded = policy.model.state_dict()
    worst = max(
        float((loaded[k].float() - v.float()).abs().max())
        for k, v in saved.items()
        if isinstance(v, torch.Tensor) and v.is_floating_point()
    )
    return {
        "published_at_once": published_at_once,
        "latest": ckpts.latest_step(),
        "leftovers": leftovers,
        "hashed": len(manifest["files"]),
        "files": sum(1 for p in path.rglob("*") if p.is_file()) - 1,
        "marker": state.get("marker"),
        "worst": worst,
    }


@pytest.mark.parametrize("layout", [{}, EP2], ids=["1rank", "ep2"])
def test_an_asynchronous_save_holds_its_steps_weights_and_is_published_when_written(
    tmp_path, layout
):
    world = 2 if layout else 1
    out = run_distributed(_save_in_the_background, world, _layout(tmp_path / "run", **layout))
    for got in out:
        # A save due while one is in flight publishes that one first (1 before 2's hand-over).
        assert got["published_at_once"] == [None, 1, 2], "latest flipped before its writers"
        assert got["latest"] == 3 and got["marker"] == 21, got
        assert got["leftovers"] == [] and got["hashed"] == got["files"], got
        assert got["worst"] == 0.0, f"the checkpoint holds weights changed after its save: {got}"
