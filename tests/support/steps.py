"""One update step of the tiny policy in any layout, and how two of them are compared."""

from __future__ import annotations

from megatron_gspo.config import Recipe

LINEAR_ADAM = {"lr": 5e3, "adam_eps": 1e4, "clip_grad": 0.0}


def train_steps(rank: int, world: int, recipe: Recipe, samples, steps: int = 1, weights=None):
    """Returns (per-step metrics, full weights before, full weights after)."""
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.trainer.policy import Policy
    from megatron_gspo.trainer.step import GSPOTrainer
    from megatron_gspo.weights import gather_full_state_dict

    policy = Policy(recipe, init_parallel(recipe.parallel))
    if weights is not None:
        policy.load_full_state_dict(weights)
    start = gather_full_state_dict(policy.model)
    trainer = GSPOTrainer(policy)
    metrics = [trainer.step(samples) for _ in range(steps)]
    return metrics, start, gather_full_state_dict(policy.model)


def max_rel_weight_diff(a: dict, b: dict, start: dict) -> float:
    """Largest difference of the updates, relative to the largest update of that tensor."""
    worst = 0.0
    for k in start:
        da, db = a[k] - start[k], b[k] - start[k]
        worst = max(worst, float((da - db).abs().max() / da.abs().max().clamp_min(1e-12)))
    return worst


def assert_equal_steps(metrics, ref_metrics, weights, ref_weights, start) -> None:
    for step, (m, r) in enumerate(zip(metrics, ref_metrics, strict=True)):
        for key in ("loss", "clip_fraction", "approx_kl", "seq_log_ratio_mean"):
            assert abs(m[key] - r[key]) <= 1e-5 * max(1.0, abs(r[key])), (
                f"step {step} {key}: {m[key]} != single-rank {r[key]}"
            )
    err = max_rel_weight_diff(weights, ref_weights, start)
    assert err <= 1e-4, f"updated weights differ from single rank by {err:.2e} (relative)"


CP2 = {"context_parallel_size": 2}
