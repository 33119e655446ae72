"""Asynchronous rollouts (``rollout.max_staleness``): K = 0 is the on-policy loop bit for bit,
the staleness bound holds however slow the trainer, a run with K >= 1 resumes exactly, and the
shipped async recipe trains to its last step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_gspo.config import Recipe
from tests.support.ranks import run_distributed
from tests.support.runs import ROOT, comparable, loop_recipe, run_metrics, run_weights, train_run


def _todays_loop(rank, world, data: dict, steps: int):
    """The on-policy loop written out by hand: sample, score, update, in that order."""
    from megatron_gspo.data.prompts import PromptStream
    from megatron_gspo.episodes.episode import single_turn
    from megatron_gspo.episodes.scoring import Scorer
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.rewards.computer import RewardComputer
    from megatron_gspo.rollout import RolloutRequest, SamplingParams
    from megatron_gspo.rollout.local import LocalEngine
    from megatron_gspo.trainer.policy import Policy
    from megatron_gspo.trainer.step import GSPOTrainer
    from megatron_gspo.weights import gather_full_state_dict

    recipe = Recipe.model_validate(data)
    policy = Policy(recipe, init_parallel(recipe.parallel))
    stream = PromptStream(recipe.data, seed=recipe.rollout.seed)
    rewards, trainer, engine = RewardComputer(recipe.reward), GSPOTrainer(policy), None
    engine = LocalEngine(policy.model)
    r = recipe.rollout
    records = []
    for step in range(1, steps + 1):
        prompts = stream.next_batch(r.prompts_per_step)
        params = SamplingParams(
            group_size=r.group_size,
            temperature=r.temperature,
            top_p=r.top_p,
            max_new_tokens=r.max_new_tokens,
            stop_token_ids=(stream.tokenizer.eos_id,),
            seed=r.seed * 1_000_003 + step,
        )
        result = engine.generate(RolloutRequest([p.token_ids for p in prompts], params))
        score = Scorer(recipe, rewards, stream.tokenizer.decode)
        samples, metrics = score(prompts, single_turn(result))
        metrics.update(trainer.step(samples))
        records.append({"step": step, **metrics})
    rewards.close()
    return records, gather_full_state_dict(policy.model)


def test_max_staleness_0_is_the_on_policy_loop_bit_for_bit(tmp_path):
    data = loop_recipe(tmp_path / "run", run={"plot_every": 0, "tensorboard": False})
    assert Recipe.model_validate(data).rollout.max_staleness == 0
    run_distributed(train_run, 1, data, 3, True)
    reference, ref_weights = run_distributed(_todays_loop, 1, data, 3)[0]
    records = run_metrics(tmp_path / "run")
    for got, want in zip(records, reference, strict=True):
        want = comparable(want)
        got = {k: v for k, v in comparable(got).items() if k in want}
        assert got == want, f"step {want['step']} differs from the on-policy loop"
    weights = run_distributed(run_weights, 1, data, 3)[0]
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)


def _slow_train(rank, world, data: dict, steps: int, delay_s: float):
    """The loop with a trainer that takes ``delay_s`` longer per step than it needs."""
    import time

    from megatron_gspo.trainer.step import GSPOTrainer

    step = GSPOTrainer.step

    def slow(self, samples, *args, **kwargs):
        time.sleep(delay_s)
        return step(self, samples, *args, **kwargs)

    GSPOTrainer.step = slow
    train_run(rank, world, data, steps, True)


@pytest.mark.slow
def test_staleness_never_exceeds_the_bound_even_with_a_slow_trainer(tmp_path):
    k = 2
    data = loop_recipe(
        tmp_path / "run",
        rollout={"max_staleness": k},
        run={"plot_every": 0, "tensorboard": False, "checkpoint_every": 1000},
    )
    # The generator could run far ahead while the trainer sleeps; it must not.
    run_distributed(_slow_train, 1, data, 6, 0.5)
    records = run_metrics(tmp_path / "run")
    lag = [r["staleness_max"] for r in records]
    assert max(lag) <= k, f"a batch staler than {k} versions was trained on: {lag}"
    # The schedule is deterministic: the first batches come from the initial weights.
    assert lag == [0, 1, 2, 2, 2, 2], lag
    assert all(r["staleness_mean"] <= r["staleness_max"] for r in records)
    assert all(r["rollout_batches_dropped"] == 0 for r in records)
    assert records[-1]["rollout_kl_k3"] > 0, "stale samples should differ from the old policy"


@pytest.mark.slow
def test_staleness_1_under_two_ranks_resumes_exactly(tmp_path):
    """Batches queued at a checkpoint are saved with it, the rollout's routes included, so
    2 + 2 steps equal 4 (EP2, rollout routing replay)."""
    parallel = {"expert_model_parallel_size": 2}
    memory = {"use_distributed_optimizer": False}
    common = dict(
        rollout={"max_staleness": 1},
        train={"routing_replay": "rollout"},
        parallel=parallel,
        memory=memory,
        run={"plot_every": 0, "tensorboard": False},
    )
    straight = loop_recipe(tmp_path / "straight", **common)
    split = loop_recipe(tmp_path / "split", **common)
    run_distributed(train_run, 2, straight, 4, True)
    run_distributed(train_run, 2, split, 2, True)
    run_distributed(train_run, 2, split, 4, True)
    a, b = run_metrics(tmp_path / "straight"), run_metrics(tmp_path / "split")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert [r["staleness_max"] for r in a] == [0, 1, 1, 1]
    # The generation worker's routes: its own at step 1, a version behind after.
    disagreement = [r["rollout_routing_disagreement"] for r in a]
    assert disagreement[0] == 0.0 and all(d > 0 for d in disagreement[1:]), disagreement
    for ra, rb in zip(a, b, strict=True):
        assert comparable(ra) == comparable(rb), f"step {ra['step']} differs after resume"
    wa = run_distributed(run_weights, 2, straight, 4)[0]
    wb = run_distributed(run_weights, 2, split, 4)[0]
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "weights differ after resume"
    queued = Path(tmp_path / "split" / "checkpoints" / "iter_0000002" / "trainer_state.json")
    assert '"rollout_queue"' in queued.read_text() and '"routes"' in queued.read_text()


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the recipe's 250 steps: 1.5 min alone on 2 cores
def test_the_async_recipe_as_shipped_trains_to_its_last_step(tmp_path):
    """``megatron-gspo train recipes/tiny-moe-async.yaml`` with nothing changed: one step
    off-policy, the sampler-mismatch guard on at its default. rollout_kl_k3 holds the policy's
    change per update (it passed 0.05 on several steps here, up to 0.9), which must not stop
    the run; rollout_sampler_kl, the generation worker against the trainer on the same
    weights, stays at fp32 round-off.

    How far it learns depends on the float path and the seed, not only on the code: the
    recipe's 25-step means start at 0.03 and end at 0.49 (peak window 0.80; the same seed under
    MKL_CBWR=COMPATIBLE: 0.48, peak 0.61), seed 1 0.64 (0.66), seed 2 0.37 (0.40), measured
    here on one machine; before the batched segment attention changed the float path, the same
    seed ended at 0.85 and seed 2 at 0.46. So the bar is learning at all, ten times the start,
    not one trajectory's height."""
    from megatron_gspo.config import RolloutConfig

    cmd = [sys.executable, "-m", "megatron_gspo", "train", "recipes/tiny-moe-async.yaml"]
    cmd += ["--output-dir", str(tmp_path / "run")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = run_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == list(range(1, 251))
    assert max(r["rollout_sampler_kl"] for r in records) < 1e-6
    limit = RolloutConfig().max_rollout_kl
    assert sum(r["rollout_kl_k3"] > limit for r in records) >= 3, "the drift never got large"
    rewards = [r["reward_mean"] for r in records]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-25:]) / 25
    best = max(sum(rewards[i : i + 25]) / 25 for i in range(len(rewards) - 24))
    print(f"reward: first 10 steps {first:.3f}, last 25 {last:.3f}, best 25 {best:.3f}")
    assert first < 0.06, f"the task starts too easy to show learning: {first:.3f}"
    assert best >= 0.3 and last >= 0.25, f"the async recipe did not learn: {last:.3f} ({best:.3f})"
