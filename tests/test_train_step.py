"""The distributed GSPO step equals the single-rank step, whatever the layout or batching.

Adam runs with an epsilon far above every gradient, where its first step is lr/eps times the
gradient: equal updated weights then mean equal gradients (Megatron's distributed optimizer
supports Adam only).
"""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.config import Recipe
from tests.support.ranks import run_distributed
from tests.support.rl_fixtures import rollout_batch, tiny_recipe
from tests.support.steps import LINEAR_ADAM, assert_equal_steps, max_rel_weight_diff, train_steps


@pytest.fixture(scope="module")
def single_rank():
    recipe = tiny_recipe(optimizer=LINEAR_ADAM, loss={"eps_low": 0.02, "eps_high": 0.02})
    samples = rollout_batch()
    metrics, start, weights = run_distributed(train_steps, 1, recipe, samples, 2)[0]
    return recipe, samples, metrics, weights, start


def test_single_rank_step_updates_weights_and_reports_metrics(single_rank):
    recipe, _, metrics, weights, start = single_rank
    assert metrics[0]["routing_flip_rate"] > 0, "routes never changed after two updates"
    for key in ("loss", "clip_fraction", "approx_kl", "entropy", "rollout_logprob_abs_diff"):
        assert key in metrics[0] and torch.isfinite(torch.tensor(metrics[0][key])), key
    # The second step starts off-policy relative to its own old log-probs only after its
    # first mini-batch update, so some sequences clip with eps 0.02 and lr 0.5.
    assert any(m["clip_fraction"] > 0 for m in metrics), "nothing was ever clipped"
    changed = [k for k in start if not torch.equal(start[k], weights[k])]
    assert len(changed) == len(start), f"not updated: {set(start) - set(changed)}"


LAYOUTS = [
    pytest.param(
        {"expert_model_parallel_size": 2},
        {"use_distributed_optimizer": True},
        {},
        id="ep2-dp2-distopt",
    ),
    pytest.param({}, {"use_distributed_optimizer": True}, {}, id="dp2-distopt"),
    pytest.param({"pipeline_model_parallel_size": 2}, {}, {}, id="pp2"),
    pytest.param({"tensor_model_parallel_size": 2, "sequence_parallel": True}, {}, {}, id="tp2-sp"),
    # A 24-token budget gives the ranks 2 and 3 micro-batches in the second mini-batch: rank 0
    # runs a filler one so that expert dispatch stays in step.
    pytest.param(
        {"expert_model_parallel_size": 2}, {}, {"micro_batch_tokens": 24}, id="ep2-dp2-filler"
    ),
]


@pytest.mark.parametrize("parallel,memory,train", LAYOUTS)
def test_two_rank_layout_step_equals_single_rank(single_rank, parallel, memory, train):
    recipe, samples, ref_metrics, ref_weights, start = single_rank
    data = recipe.model_dump()
    data["parallel"].update(parallel)
    data["memory"].update(memory)
    data["train"].update(train)
    results = run_distributed(train_steps, 2, Recipe.model_validate(data), samples, 2, start)
    metrics, start2, weights = results[0]
    assert all(torch.equal(start[k], start2[k]) for k in start), "layouts started apart"
    assert_equal_steps(metrics, ref_metrics, weights, ref_weights, start)


# The router's load-balancing loss on, at a weight where its gradient shows in the update.
AUX = {"moe_aux_loss_coeff": 0.1}


@pytest.fixture(scope="module")
def single_rank_aux():
    recipe = tiny_recipe(model=AUX, optimizer=LINEAR_ADAM, loss={"eps_low": 0.02, "eps_high": 0.02})
    samples = rollout_batch()
    metrics, start, weights = run_distributed(train_steps, 1, recipe, samples, 2)[0]
    return recipe, samples, metrics, weights, start


@pytest.mark.parametrize(
    "parallel",
    [
        # Sequence parallelism pads each micro-batch to a multiple of TP: those tokens must not
        # reach the load-balancing loss (nor do the 1-rank run's own padding tokens).
        pytest.param({"tensor_model_parallel_size": 2, "sequence_parallel": True}, id="tp2-sp"),
        pytest.param({"pipeline_model_parallel_size": 2}, id="pp2"),
    ],
)
def test_layouts_with_the_aux_loss_on_equal_single_rank(single_rank_aux, parallel):
    """Megatron's aux loss is per micro-batch over the TP x CP group: a layout that keeps the
    micro-batches (TP with SP, PP) keeps it, to fp32 round-off."""
    recipe, samples, ref_metrics, ref_weights, start = single_rank_aux
    data = recipe.model_dump()
    data["parallel"].update(parallel)
    metrics, _, weights = run_distributed(
        train_steps, 2, Recipe.model_validate(data), samples, 2, start
    )[0]
    assert_equal_steps(metrics, ref_metrics, weights, ref_weights, start)


@pytest.mark.parametrize(
    "parallel",
    [
        pytest.param({}, id="dp2"),
        pytest.param({"expert_model_parallel_size": 2}, id="ep2-dp2"),
    ],
)
def test_global_aux_loss_under_dp_and_ep_equals_single_rank(parallel):
    """With model.moe_aux_loss_type global_aux_loss the expert counts span the data-parallel
    group, so two ranks holding half a micro-batch each equal one rank holding all of it.
    (Megatron averages the counts over the micro-batches seen so far in a step, so the layouts
    agree where their k-th micro-batches cover the same samples: here one per mini-batch.)"""
    recipe = tiny_recipe(
        model={**AUX, "moe_aux_loss_type": "global_aux_loss"},
        optimizer=LINEAR_ADAM,
        loss={"eps_low": 0.02, "eps_high": 0.02},
        train={"packing": True, "micro_batch_tokens": 1000},
    )
    samples = rollout_batch()
    ref_metrics, start, ref_weights = run_distributed(train_steps, 1, recipe, samples, 2)[0]
    data = recipe.model_dump()
    data["parallel"].update(parallel)
    metrics, _, weights = run_distributed(
        train_steps, 2, Recipe.model_validate(data), samples, 2, start
    )[0]
    for step, (m, r) in enumerate(zip(metrics, ref_metrics, strict=True)):
        assert abs(m["loss"] - r["loss"]) <= 1e-5 * max(1.0, abs(r["loss"])), step
    # 1e-3 of the smallest tensor update: the aux and policy gradients nearly cancel on a
    # norm weight (update 3e-4), where round-off shows as 2e-4; without the DP correction of
    # the coefficient the updates differ by 100%.
    err = max_rel_weight_diff(weights, ref_weights, start)
    assert err <= 1e-3, f"updated weights differ from single rank by {err:.2e} (relative)"


def test_a_filler_microbatch_adds_nothing_to_the_aux_loss(single_rank_aux):
    """A rank's filler micro-batch is all padding: with the padding masked its load-balancing
    loss must be 0, not 0/0 (NaN in every router gradient)."""
    recipe, samples, _, _, start = single_rank_aux
    data = recipe.model_dump()
    data["parallel"].update(expert_model_parallel_size=2)
    data["train"].update(micro_batch_tokens=24)  # as in ep2-dp2-filler above
    metrics, _, weights = run_distributed(
        train_steps, 2, Recipe.model_validate(data), samples, 1, start
    )[0]
    assert metrics[0]["update_skipped"] == 0 and all(
        bool(torch.isfinite(w).all()) for w in weights.values()
    ), "the filler micro-batch made the update non-finite"


def _one_minibatch(**train) -> Recipe:
    return tiny_recipe(optimizer=LINEAR_ADAM, train={"mini_batches": 1, **train})


@pytest.mark.parametrize(
    "a,b",
    [
        pytest.param({"packing": True}, {"packing": False}, id="packed-vs-padded"),
        pytest.param(
            {"packing": True, "micro_batch_tokens": 400},
            {"packing": True, "micro_batch_tokens": 64},
            id="1-vs-many-microbatches",
        ),
        pytest.param(
            {"packing": False, "micro_batch_size": 16},
            {"packing": False, "micro_batch_size": 4},
            id="padded-1-vs-4",
        ),
    ],
)
def test_batching_does_not_change_loss_or_gradient(a, b):
    samples = rollout_batch(seed=3)
    (ma,), start, wa = run_distributed(train_steps, 1, _one_minibatch(**a), samples)[0]
    (mb,), _, wb = run_distributed(train_steps, 1, _one_minibatch(**b), samples)[0]
    assert abs(ma["loss"] - mb["loss"]) <= 1e-6 * max(1.0, abs(ma["loss"])), (
        ma["loss"],
        mb["loss"],
    )
    err = max_rel_weight_diff(wa, wb, start)
    assert err <= 1e-4, f"gradients differ by {err:.2e} (relative) between {a} and {b}"
    # The layouts pad differently; padding is in no router statistic.
    for key in ("routing_flip_rate", "expert_load_max_over_mean", "expert_load_min_over_mean"):
        assert abs(ma[key] - mb[key]) <= 1e-6, (key, ma[key], mb[key])


def _routed(rank, world, recipe: Recipe, samples):
    """One step; the metrics and the experts every forward routed through."""
    from megatron_gspo.model.routes import RouteRecorder
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.trainer.policy import Policy
    from megatron_gspo.trainer.step import GSPOTrainer

    policy = Policy(recipe, init_parallel(recipe.parallel))
    recorder = RouteRecorder(policy.model)
    recorder.start()
    metrics = GSPOTrainer(policy).step(samples)
    return metrics, recorder.stop()


def test_old_policy_replay_routes_the_update_through_the_old_policys_experts():
    samples = rollout_batch(seed=5)
    free = tiny_recipe(optimizer=LINEAR_ADAM)
    replayed = tiny_recipe(optimizer=LINEAR_ADAM, train={"routing_replay": "old_policy"})
    free_m, free_fwd = run_distributed(_routed, 1, free, samples)[0]
    replay_m, replay_fwd = run_distributed(_routed, 1, replayed, samples)[0]
    # The old-policy pass, then the update's forwards: the same micro-batches in one order.
    n = len(replay_fwd) // 2
    assert any(not torch.equal(a, b) for a, b in zip(free_fwd[:n], free_fwd[n:], strict=True)), (
        "the update changed no route; the test is vacuous"
    )
    for a, b in zip(replay_fwd[:n], replay_fwd[n:], strict=True):
        assert torch.equal(a, b), "replay let the router choose other experts"
    # The flip rate is the router's own choice, which replay does not hide.
    assert free_m["routing_flip_rate"] > 0 and replay_m["routing_flip_rate"] > 0


def test_rollout_old_logprobs_still_measure_the_train_inference_mismatch():
    """With one mini-batch, both modes see every sample under the pre-update weights."""
    samples = rollout_batch(seed=7)
    recompute = _one_minibatch(packing=True)
    rollout = tiny_recipe(
        optimizer=LINEAR_ADAM, train={"mini_batches": 1, "old_logprobs": "rollout"}
    )
    (mr,), start, _ = run_distributed(train_steps, 1, recompute, samples)[0]
    (mo,), _, _ = run_distributed(train_steps, 1, rollout, samples, 1, start)[0]
    for key in ("rollout_logprob_abs_diff", "rollout_kl_k3"):
        assert abs(mo[key] - mr[key]) <= 1e-5 * abs(mr[key]), (key, mo[key], mr[key])
    assert mr["rollout_logprob_abs_diff"] > 0.5, "the fixture's rollout log-probs are off-policy"


def _old_logprob_pass(rank: int, world: int, recipe: Recipe, samples, version=None):
    """The mismatch metrics of the old-log-prob pass, and each sample's response log-probs
    from a plain full-vocabulary ``log_softmax`` of the same policy."""
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.trainer.policy import Policy
    from megatron_gspo.trainer.step import GSPOTrainer

    policy = Policy(recipe, init_parallel(recipe.parallel))
    trainer = GSPOTrainer(policy)
    metrics = trainer.compute_old_logprobs(trainer.plan(samples), version)
    policy.train(False)
    reference = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            n = ids.shape[1] - 1
            mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)[None, None]
            logits = policy.model(ids[:, :-1], torch.arange(n)[None], mask)[0].float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
            reference.append(lp[len(s.prompt_ids) - 1 :])
    return metrics, reference


def test_rollout_mismatch_metrics_follow_their_formulas():
    """d = log pi_train - log pi_rollout per response token: ``rollout_kl_k3`` is
    mean(exp(d) - 1 - d) (the k3 estimator of KL(rollout || train), >= 0) and
    ``rollout_logprob_abs_diff`` is mean |d|; both over all response tokens of the batch."""
    samples = rollout_batch(seed=9)
    recipe = _one_minibatch(packing=True)
    metrics, reference = run_distributed(_old_logprob_pass, 1, recipe, samples)[0]
    d = torch.cat(
        [
            ref.double() - torch.tensor(s.rollout_logprobs).double()
            for s, ref in zip(samples, reference, strict=True)
        ]
    )
    expected = {
        "rollout_kl_k3": float((d.exp() - 1 - d).mean()),
        "rollout_logprob_abs_diff": float(d.abs().mean()),
    }
    assert expected["rollout_kl_k3"] > 0.1, "the fixture is too close to on-policy to tell"
    for key, value in expected.items():
        assert abs(metrics[key] - value) <= 1e-5 * value, (
            f"{key} = {metrics[key]:.6g}, expected {value:.6g} from its formula"
        )


def _k3(samples, reference) -> torch.Tensor:
    """Per response token, k3 of the samples' rollout log-probs against the reference's."""
    d = torch.cat(
        [
            ref.double() - torch.tensor(s.rollout_logprobs).double()
            for s, ref in zip(samples, reference, strict=True)
        ]
    )
    return d.exp() - 1 - d


def _two_versions(seed: int):
    """The fixture's samples, every other one sampled by version 5 (the policy's), the rest
    by version 4 (one update stale)."""
    import dataclasses

    samples = rollout_batch(seed=seed)
    return [dataclasses.replace(s, policy_version=5 - i % 2) for i, s in enumerate(samples)]


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_the_sampler_kl_counts_only_tokens_the_scoring_weights_sampled(packing):
    """``rollout_sampler_kl`` is ``rollout_kl_k3``'s mean taken over the tokens whose version
    is the policy's: a stale sample's log-probs hold the policy's own change, not the
    engine's error. Its token count says how many tokens it covers."""
    samples = _two_versions(seed=11)
    recipe = _one_minibatch(packing=packing)
    metrics, reference = run_distributed(_old_logprob_pass, 1, recipe, samples, 5)[0]
    k3 = _k3(samples, reference)
    on = torch.cat(
        [torch.full((len(s.response_ids),), s.policy_version == 5) for s in samples]
    ).double()
    expected = float((k3 * on).sum() / on.sum())
    assert metrics["rollout_sampler_kl_tokens"] == float(on.sum())
    assert abs(metrics["rollout_sampler_kl"] - expected) <= 1e-5 * expected, (
        f"rollout_sampler_kl = {metrics['rollout_sampler_kl']:.6g}, expected {expected:.6g} "
        "over the on-policy tokens alone"
    )
    assert abs(metrics["rollout_kl_k3"] - float(k3.mean())) <= 1e-5 * float(k3.mean())
    assert abs(expected - float(k3.mean())) > 1e-3 * expected, "the fixture cannot tell them"


def _old_logprob_metrics(rank: int, world: int, recipe: Recipe, samples, version, weights=None):
    """The old-log-prob pass's metrics, and the full weights it ran with."""
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.trainer.policy import Policy
    from megatron_gspo.trainer.step import GSPOTrainer
    from megatron_gspo.weights import gather_full_state_dict

    policy = Policy(recipe, init_parallel(recipe.parallel))
    if weights is not None:
        policy.load_full_state_dict(weights)
    trainer = GSPOTrainer(policy)
    metrics = trainer.compute_old_logprobs(trainer.plan(samples), version)
    return metrics, gather_full_state_dict(policy.model)


@pytest.mark.parametrize(
    "parallel",
    [
        pytest.param({"context_parallel_size": 2}, id="cp2"),
        pytest.param({"expert_model_parallel_size": 2}, id="ep2-dp2"),
    ],
)
def test_the_sampler_kl_of_a_parallel_layout_equals_one_ranks(parallel):
    """Each token's version travels with it through the context-parallel split and the
    data-parallel balancing."""
    samples = _two_versions(seed=11)
    one, weights = run_distributed(_old_logprob_metrics, 1, _one_minibatch(), samples, 5)[0]
    recipe = tiny_recipe(optimizer=LINEAR_ADAM, parallel=parallel, train={"mini_batches": 1})
    two, _ = run_distributed(_old_logprob_metrics, 2, recipe, samples, 5, weights)[0]
    assert two["rollout_sampler_kl_tokens"] == one["rollout_sampler_kl_tokens"]
    rel = abs(two["rollout_sampler_kl"] - one["rollout_sampler_kl"]) / one["rollout_sampler_kl"]
    assert rel <= 1e-5, f"{two['rollout_sampler_kl']} != one rank's {one['rollout_sampler_kl']}"


def test_no_sampler_kl_without_on_policy_tokens():
    samples = _two_versions(seed=11)
    metrics, _ = run_distributed(_old_logprob_pass, 1, _one_minibatch(), samples, 7)[0]
    assert "rollout_sampler_kl" not in metrics and metrics["rollout_kl_k3"] > 0


def _sampler_probe(rank: int, world: int, recipe: Recipe, samples):
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.trainer.policy import Policy
    from megatron_gspo.trainer.step import GSPOTrainer

    policy = Policy(recipe, init_parallel(recipe.parallel))
    return GSPOTrainer(policy).sampler_kl(samples)


def test_the_probe_scores_the_engines_log_probs_against_the_policys_own():
    """After a sync the trainer scores the probe's tokens with the weights the engine just
    received: with the engine's log-probs exact the figure is 0, off by d it is k3(d) on
    every scored token (environment tokens of an episode left out), whatever the recipe's
    mini-batch count."""
    import dataclasses

    samples = rollout_batch(seed=9)
    recipe = tiny_recipe(train={"mini_batches": 4})
    _, reference = run_distributed(_old_logprob_pass, 1, _one_minibatch(), samples)[0]
    exact = [
        dataclasses.replace(s, rollout_logprobs=ref.tolist())
        for s, ref in zip(samples, reference, strict=True)
    ]
    off = [
        dataclasses.replace(s, rollout_logprobs=(ref - 0.3).tolist())
        for s, ref in zip(samples, reference, strict=True)
    ]
    # One episode's second half is an environment's turn: never scored.
    n = len(off[0].response_ids)
    off[0] = dataclasses.replace(off[0], response_mask=[1] * (n // 2) + [0] * (n - n // 2))
    got_exact = run_distributed(_sampler_probe, 1, recipe, exact)[0]
    got_off = run_distributed(_sampler_probe, 1, recipe, off)[0]
    tokens = sum(len(s.response_ids) for s in samples) - (n - n // 2)
    assert got_exact["rollout_sampler_kl"] <= 1e-9, got_exact
    expected = float(torch.tensor(0.3).exp() - 1 - 0.3)
    assert got_off["rollout_sampler_kl_tokens"] == tokens
    assert abs(got_off["rollout_sampler_kl"] - expected) <= 1e-4 * expected, (
        f"{got_off['rollout_sampler_kl']:.6g} != k3(0.3) = {expected:.6g}"
    )


def test_masked_is_trains_exactly_the_sequences_it_keeps():
    """Sequence-level MIS on a batch where some samples' rollout log-probs are far off the
    policy's (w = e^-3, outside [0.5, 2]) and the others exact (w = 1): the update equals
    training on the kept samples alone, so the masked ones left the global count too."""
    import dataclasses

    base = rollout_batch(seed=11)
    recipe = _one_minibatch(packing=True)
    _, reference = run_distributed(_old_logprob_pass, 1, recipe, base)[0]
    far = set(range(0, len(base), 3))
    samples = [
        dataclasses.replace(s, rollout_logprobs=(ref + (3.0 if i in far else 0.0)).tolist())
        for i, (s, ref) in enumerate(zip(base, reference, strict=True))
    ]
    corrected = tiny_recipe(
        optimizer=LINEAR_ADAM,
        train={
            "mini_batches": 1,
            "off_policy_correction": {"mode": "mis", "level": "sequence"},
        },
    )
    kept = [s for i, s in enumerate(samples) if i not in far]
    (mc,), start, wc = run_distributed(train_steps, 1, corrected, samples)[0]
    (mk,), _, wk = run_distributed(train_steps, 1, recipe, kept, 1, start)[0]
    assert mc["is_masked_fraction"] == pytest.approx(len(far) / len(samples))
    assert mc["is_weight_min"] == pytest.approx(1.0, abs=1e-4), mc["is_weight_min"]
    assert abs(mc["loss"] - mk["loss"]) <= 1e-6 * max(1.0, abs(mk["loss"])), (
        mc["loss"],
        mk["loss"],
    )
    err = max_rel_weight_diff(wc, wk, start)
    assert err <= 1e-4, f"MIS update differs from training on the kept samples by {err:.2e}"


def test_corrections_of_on_policy_samples_change_nothing():
    """Rollout log-probs equal to the old policy's (w = 1): TIS and MIS at either level give the
    update of no correction, so the token form GSPO switches to is GSPO itself."""
    import dataclasses

    base = rollout_batch(seed=13)
    plain = _one_minibatch(packing=True)
    _, reference = run_distributed(_old_logprob_pass, 1, plain, base)[0]
    samples = [
        dataclasses.replace(s, rollout_logprobs=ref.tolist())
        for s, ref in zip(base, reference, strict=True)
    ]
    (m0,), start, w0 = run_distributed(train_steps, 1, plain, samples)[0]
    for correction in (
        {"mode": "tis", "level": "token"},
        {"mode": "mis", "level": "sequence"},
    ):
        recipe = tiny_recipe(
            optimizer=LINEAR_ADAM,
            train={"mini_batches": 1, "off_policy_correction": correction},
        )
        (m,), _, w = run_distributed(train_steps, 1, recipe, samples, 1, start)[0]
        assert m["is_masked_fraction"] == 0 and m["is_truncated_fraction"] == 0, m
        assert abs(m["loss"] - m0["loss"]) <= 1e-6 * max(1.0, abs(m0["loss"])), correction
        err = max_rel_weight_diff(w, w0, start)
        assert err <= 1e-4, f"{correction}: update differs from no correction by {err:.2e}"


def test_a_non_finite_gradient_skips_the_update():
    """One sample with a NaN advantage makes every gradient NaN: no weight, Adam state or
    schedule moves, and the step says so."""
    import dataclasses

    samples = rollout_batch(seed=15)
    samples[3] = dataclasses.replace(samples[3], advantage=float("nan"))
    (m,), start, after = run_distributed(train_steps, 1, _one_minibatch(packing=True), samples)[0]
    assert m["update_skipped"] == 1.0
    assert all(torch.equal(start[k], after[k]) for k in start), "a NaN update reached the weights"
