"""Multi-turn episodes through the update: environment tokens get no gradient, turn-level
credit is GSPO-token's per-token weighting, every layout equals one rank, and the loop runs
(and resumes) episodes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from megatron_gspo.config import Recipe
from megatron_gspo.loss import gspo_loss, gspo_token_loss
from megatron_gspo.loss.policy_loss import grpo_loss
from megatron_gspo.trainer.packing import build_microbatch
from tests.support.ranks import run_distributed
from tests.support.rl_fixtures import episode_batch, tiny_recipe
from tests.support.runs import ROOT, comparable, run_metrics, run_weights, train_run
from tests.support.steps import CP2, LINEAR_ADAM, assert_equal_steps, train_steps

EPS = 0.5  # wide enough that nothing clips below: the closed form is the unclipped one


def _env_positions(samples, indices, packed: bool, width: int) -> list[tuple[int, int]]:
    """(row, column) of every target that is an environment token, from the samples alone."""
    out, offset = [], 0
    for r, i in enumerate(indices):
        s = samples[i]
        p = len(s.prompt_ids)
        row, base = (0, offset) if packed else (r, 0)
        out += [(row, base + p - 1 + j) for j, m in enumerate(s.response_mask) if m == 0]
        offset += p + len(s.response_ids) - 1
    return out


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("loss_fn", [gspo_token_loss, grpo_loss], ids=["gspo_token", "grpo"])
def test_environment_tokens_get_exactly_zero_gradient(packed, loss_fn):
    samples = episode_batch()
    indices = list(range(6))
    mb = build_microbatch(samples, indices, packing=packed)
    region = mb.region
    g = torch.Generator().manual_seed(0)
    old = mb.old_logprobs[region]
    lp = (old + 0.01 * torch.randn(old.shape, generator=g)).requires_grad_()
    loss, _ = loss_fn(
        lp,
        old,
        mb.token_advantages[region],
        mb.loss_mask[region],
        cu_seqlens=mb.cu_seqlens,
        eps_low=EPS,
        eps_high=EPS,
    )
    loss.backward()
    full = torch.zeros_like(mb.old_logprobs)
    full[region] = lp.grad
    env = _env_positions(samples, indices, packed, mb.tokens.shape[1])
    assert env, "the batch has no environment tokens"
    assert all(full[r, c] == 0 for r, c in env), "an environment token got a gradient"
    model = mb.loss_mask.bool() & (mb.token_advantages != 0)
    assert bool((full[model] != 0).all()), "a model token got no gradient"
    assert int(mb.loss_mask.sum()) == sum(sum(samples[i].response_mask) for i in indices)


def test_gspo_token_with_turn_credit_is_the_closed_form_and_not_gspo():
    samples = episode_batch()
    indices = list(range(8))
    mb = build_microbatch(samples, indices, packing=True)
    region = mb.region
    old = mb.old_logprobs[region].double()
    g = torch.Generator().manual_seed(1)
    lp0 = old + 0.05 * torch.randn(old.shape, generator=g, dtype=torch.float64)
    mask = mb.loss_mask[region]
    adv_tok = mb.token_advantages[region].double()
    kw = dict(cu_seqlens=mb.cu_seqlens, eps_low=EPS, eps_high=EPS)
    lp = lp0.clone().requires_grad_()
    gspo_token_loss(lp, old, adv_tok, mask, **kw)[0].backward()
    # sg[s_i] / |y_i| * A_{i,t} per model token, over N sequences (nothing clips at EPS).
    want = torch.zeros_like(lp0)
    cu = mb.cu_seqlens.tolist()
    for i in range(len(indices)):
        sl = slice(cu[i], cu[i + 1])
        m = mask[sl].bool()
        s = math.exp(float((lp0[sl] - old[sl])[m].sum()) / int(m.sum()))
        want[sl] = torch.where(m, -s * adv_tok[sl] / int(m.sum()) / len(indices), 0.0)
    torch.testing.assert_close(lp.grad, want, rtol=1e-12, atol=1e-15)
    # GSPO has one advantage per sequence: a different gradient.
    lp_seq = lp0.clone().requires_grad_()
    gspo_loss(lp_seq, old, mb.advantages.double(), mask, **kw)[0].backward()
    assert (lp_seq.grad - lp.grad).abs().max() > 1e-3
    # GSPO-token with each sequence's advantage on all its tokens is GSPO.
    lp_same = lp0.clone().requires_grad_()
    gspo_token_loss(lp_same, old, mb.advantages.double(), mask, **kw)[0].backward()
    torch.testing.assert_close(lp_same.grad, lp_seq.grad, rtol=1e-12, atol=1e-15)


def _one_step(loss: str, turn_credit: bool):
    recipe = tiny_recipe(
        optimizer=LINEAR_ADAM, loss={"name": loss, "eps_low": EPS, "eps_high": EPS}
    )
    samples = episode_batch(turn_credit=turn_credit)
    return run_distributed(train_steps, 1, recipe, samples, 1)[0]


def test_gspo_token_trains_like_gspo_with_sequence_credit_and_unlike_it_with_turn_credit():
    gspo_metrics, start, gspo = _one_step("gspo", turn_credit=False)
    seq_metrics, start2, seq = _one_step("gspo_token", turn_credit=False)
    turn_metrics, _, turn = _one_step("gspo_token", turn_credit=True)
    assert all(torch.equal(start[k], start2[k]) for k in start)
    assert seq_metrics[0]["loss"] == pytest.approx(gspo_metrics[0]["loss"], rel=1e-5, abs=1e-7)
    worst = max(float((seq[k] - gspo[k]).abs().max()) for k in gspo)
    assert worst <= 1e-6, f"GSPO-token with sequence credit moved weights {worst} from GSPO"
    moved = max(float((turn[k] - gspo[k]).abs().max()) for k in gspo)
    assert moved > 1e-3, "turn-level credit trained exactly like GSPO"


@pytest.fixture(scope="module")
def multi_turn_single_rank():
    recipe = tiny_recipe(
        optimizer=LINEAR_ADAM,
        loss={"name": "gspo_token", "eps_low": 0.02, "eps_high": 0.02},
    )
    samples = episode_batch()
    metrics, start, weights = run_distributed(train_steps, 1, recipe, samples, 2)[0]
    return recipe, samples, metrics, weights, start


@pytest.mark.parametrize(
    "parallel,world",
    [
        pytest.param({"tensor_model_parallel_size": 2, "sequence_parallel": True}, 2, id="tp2-sp"),
        pytest.param({"pipeline_model_parallel_size": 2}, 2, id="pp2"),
        pytest.param({"expert_model_parallel_size": 2}, 2, id="ep2"),
        pytest.param(CP2, 2, id="cp2-packed"),
    ],
)
def test_a_multi_turn_batch_trains_alike_in_every_layout(multi_turn_single_rank, parallel, world):
    recipe, samples, ref_metrics, ref_weights, start = multi_turn_single_rank
    data = recipe.model_dump()
    data["parallel"].update(parallel)
    results = run_distributed(train_steps, world, Recipe.model_validate(data), samples, 2, start)
    metrics, _, weights = results[0]
    assert_equal_steps(metrics, ref_metrics, weights, ref_weights, start)


# ------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------


def multi_turn_recipe(output_dir: Path, **sections) -> dict:
    """The tiny multi-turn recipe, shrunk for a test's budget."""
    data = yaml.safe_load((ROOT / "recipes" / "tiny-multi-turn.yaml").read_text())
    data["rollout"].update(prompts_per_step=4, group_size=4)
    data["run"].update(
        output_dir=str(output_dir), checkpoint_every=2, plot_every=0, tensorboard=False
    )
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return data


@pytest.mark.slow
def test_episodes_queued_ahead_resume_exactly(tmp_path):
    """Episodes sampled a step ahead are saved with the checkpoint: 2 + 2 steps equal 4."""
    common = dict(rollout={"max_staleness": 1}, train={"routing_replay": "rollout"})
    straight = multi_turn_recipe(tmp_path / "straight", **common)
    split = multi_turn_recipe(tmp_path / "split", **common)
    run_distributed(train_run, 1, straight, 4, True)
    run_distributed(train_run, 1, split, 2, True)
    run_distributed(train_run, 1, split, 4, True)
    a, b = run_metrics(tmp_path / "straight"), run_metrics(tmp_path / "split")
    assert all(r["turns_mean"] > 1 for r in a), "no episode had a second turn"
    assert all(r["model_token_fraction"] < 1 for r in a)
    for ra, rb in zip(a, b, strict=True):
        assert comparable(ra) == comparable(rb), f"step {ra['step']} differs after resume"
    wa = run_distributed(run_weights, 1, straight, 4)[0]
    wb = run_distributed(run_weights, 1, split, 4)[0]
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "weights differ after resume"
    state = (tmp_path / "split" / "checkpoints" / "iter_0000002" / "trainer_state.json").read_text()
    assert '"episodes"' in state and '"turn_ids"' in state


@pytest.mark.slow
def test_a_raising_and_a_hanging_environment_are_counted_and_the_run_goes_on(tmp_path):
    data = multi_turn_recipe(
        tmp_path / "run",
        rollout={"multi_turn": {
            "env": "tests.support.faulty_envs:FlakyRelay",
            "env_kwargs": {"raise_on": "7", "hang_on": "8"},
            "max_turns": 3,
        }},
        reward={"timeout_s": 2, "max_error_fraction": 1.0, "on_error": "drop_group"},
    )  # fmt: skip
    run_distributed(train_run, 1, data, 2, True)
    records = run_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    assert sum(r["env_errors"] for r in records) > 0, "no raising step was counted"
    assert sum(r["env_timeouts"] for r in records) > 0, "no hanging step was counted"
    assert all(r["groups_dropped_on_error"] > 0 for r in records)
