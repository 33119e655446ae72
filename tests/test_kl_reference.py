"""The KL penalty against a frozen reference policy (loss.kl_coef): its closed form, zero
gradient at the reference, the pull back once the policy has moved, and exact resume."""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.loss.kl import reference_kl
from tests.support.ranks import run_distributed
from tests.support.rl_fixtures import rollout_batch, tiny_recipe
from tests.support.runs import comparable, loop_recipe, straight_and_resumed
from tests.support.steps import LINEAR_ADAM, assert_equal_steps, train_steps


def test_reference_kl_is_k3_per_sequence_mean_over_n_with_its_closed_form_gradient():
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(3, 5, generator=g, dtype=torch.float64) * 3).requires_grad_()
    ref = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 3
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 0, 0]], dtype=torch.bool)
    loss, m = reference_kl(lp, ref, mask, num_sequences=4)
    r = (ref - lp.detach()) * mask
    k3 = (r.exp() - r - 1) * mask
    n_i = mask.sum(1)
    assert torch.allclose(loss, (k3.sum(1) / n_i).sum() / 4)
    assert torch.allclose(m["kl_ref"], k3.sum() / mask.sum())
    loss.backward()
    expected = (1 - r.exp()) / (n_i[:, None] * 4) * mask
    assert torch.allclose(lp.grad, expected)
    # Packed: the same sequences back to back.
    flat = [lp.detach()[i, mask[i]] for i in range(3)]
    cu = torch.tensor([0, *torch.cumsum(n_i, 0).tolist()])
    packed, _ = reference_kl(
        torch.cat(flat),
        torch.cat([ref[i, mask[i]] for i in range(3)]),
        torch.ones(int(cu[-1]), dtype=torch.bool),
        num_sequences=4,
        cu_seqlens=cu,
    )
    assert torch.allclose(packed, loss.detach())


def _recipe(kl: float, mini_batches: int):
    return tiny_recipe(
        optimizer=LINEAR_ADAM, loss={"kl_coef": kl}, train={"mini_batches": mini_batches}
    )


def test_the_penalty_has_no_gradient_at_the_reference_and_pulls_back_once_moved():
    samples = rollout_batch()
    (off,), start, w_off = run_distributed(train_steps, 1, _recipe(0.0, 1), samples)[0]
    (on,), _, w_on = run_distributed(train_steps, 1, _recipe(0.5, 1), samples, 1, start)[0]
    # First update: the policy is the reference, k3 and its gradient are exactly 0.
    assert on["kl_ref"] == 0.0
    assert all(torch.equal(w_off[k], w_on[k]) for k in w_off), "KL moved the first update"
    # Two mini-batches: the second starts away from the reference, and the penalty acts.
    (off2,), _, w_off2 = run_distributed(train_steps, 1, _recipe(0.0, 2), samples, 1, start)[0]
    (on2,), _, w_on2 = run_distributed(train_steps, 1, _recipe(0.5, 2), samples, 1, start)[0]
    assert on2["kl_ref"] > 0
    assert any(not torch.equal(w_off2[k], w_on2[k]) for k in w_off2)


def test_plan_counts_the_reference_weights():
    from megatron_gspo.launch.plan import plan_memory

    def rows(kl):
        recipe = tiny_recipe(loss={"kl_coef": kl})
        return plan_memory(recipe, nodes=1, gpus_per_node=1, gpu="h100").rows

    with_ref, without = rows(0.1), rows(0.0)
    assert "reference policy (loss.kl_coef)" not in without
    weights = next(v for k, v in with_ref.items() if k.startswith("weights"))
    assert with_ref["reference policy (loss.kl_coef)"] == pytest.approx(weights)


@pytest.mark.slow
def test_a_run_with_the_penalty_resumes_exactly(tmp_path):
    quiet = {"plot_every": 0, "tensorboard": False, "checkpoint_every": 2}
    straight = loop_recipe(tmp_path / "straight", run=quiet, loss={"kl_coef": 0.1})
    split = loop_recipe(tmp_path / "split", run=quiet, loss={"kl_coef": 0.1})
    a, b = straight_and_resumed(straight, split)
    assert [comparable(r) for r in a] == [comparable(r) for r in b]
    assert a[-1]["kl_ref"] > 0


@pytest.mark.parametrize(
    "parallel",
    [
        pytest.param({"pipeline_model_parallel_size": 2}, id="pp2"),
        pytest.param({"tensor_model_parallel_size": 2, "sequence_parallel": True}, id="tp2-sp"),
        pytest.param({"expert_model_parallel_size": 2}, id="ep2-dp2"),
    ],
)
def test_the_penalty_under_parallel_layouts_equals_single_rank(parallel):
    from megatron_gspo.config import Recipe

    recipe = _recipe(0.5, 2)
    samples = rollout_batch()
    ref_metrics, start, ref_weights = run_distributed(train_steps, 1, recipe, samples, 2)[0]
    data = recipe.model_dump()
    data["parallel"].update(parallel)
    metrics, _, weights = run_distributed(
        train_steps, 2, Recipe.model_validate(data), samples, 2, start
    )[0]
    for m, r in zip(metrics, ref_metrics, strict=True):
        assert abs(m["kl_ref"] - r["kl_ref"]) <= 1e-5 * max(1e-3, r["kl_ref"]), (m, r)
    assert_equal_steps(metrics, ref_metrics, weights, ref_weights, start)
