"""Validation during training (eval.*): held-out prompts through the same engine and rewards,
greedy and sampled, logged at step 0 and every N steps, without touching training."""

from __future__ import annotations

import json

import pytest

from megatron_gspo.config import Recipe
from megatron_gspo.run.evaluation import pass_at_k
from tests.support.ranks import run_distributed
from tests.support.runs import comparable, loop_recipe, run_metrics, train_run

QUIET = {"plot_every": 0, "tensorboard": False, "checkpoint_every": 100}
EVAL = {"every": 2, "num_prompts": 6, "k": 3}
EVAL_KEYS = ("eval_reward_mean", "eval_mean@3", "eval_pass@3")


def test_pass_at_k_counts_prompts_with_a_passing_response():
    assert pass_at_k([[0.0, 1.0], [0.5, 0.2], [1.0, 1.0]], threshold=1.0) == pytest.approx(2 / 3)
    assert pass_at_k([[0.5, 0.2]], threshold=0.5) == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("staleness", [0, 1], ids=["on-policy", "staleness-1"])
def test_eval_is_logged_at_step_0_and_every_n_and_changes_no_training_step(tmp_path, staleness):
    plain = loop_recipe(tmp_path / "plain", run=QUIET, rollout={"max_staleness": staleness})
    with_eval = loop_recipe(
        tmp_path / "eval", run=QUIET, rollout={"max_staleness": staleness}, eval=EVAL
    )
    run_distributed(train_run, 1, plain, 4, False)
    run_distributed(train_run, 1, with_eval, 4, False)
    a, b = run_metrics(tmp_path / "plain"), run_metrics(tmp_path / "eval")
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4]
    for r in b:
        has = r["step"] % 2 == 0
        assert all((k in r) == has for k in EVAL_KEYS), r
        if has:
            assert all(0.0 <= r[k] <= 1.0 for k in EVAL_KEYS), r
    # Evaluation samples with its own seeds on weights already synced: training is unchanged.
    trained = [{k: v for k, v in comparable(r).items() if not k.startswith("eval_")} for r in b]
    assert trained[1:] == [comparable(r) for r in a]


def test_keep_best_keeps_the_best_eval_checkpoint(tmp_path):
    data = loop_recipe(
        tmp_path / "run",
        run={**QUIET, "checkpoint_every": 1, "keep_checkpoints": 1},
        eval={**EVAL, "every": 1, "keep_best": True},
    )
    run_distributed(train_run, 1, data, 5, False)
    records = {r["step"]: r for r in run_metrics(tmp_path / "run") if r["step"] > 0}
    best_value = max(r["eval_reward_mean"] for r in records.values())
    ckpts = tmp_path / "run" / "checkpoints"
    best = int((ckpts / "best").read_text())
    assert records[best]["eval_reward_mean"] == best_value
    kept = sorted(p.name for p in ckpts.glob("iter_*"))
    # keep_checkpoints 1: the latest, and the best where it is another step.
    assert kept == sorted({f"iter_{best:07d}", "iter_0000005"}), kept
    # The pruned ones were deleted in the background, and gone by the run's end.
    assert not list(ckpts.glob(".iter_*")), list(ckpts.glob(".iter_*"))
    state = json.loads((ckpts / "iter_0000005" / "trainer_state.json").read_text())
    assert state["eval_best"]["step"] == best


def test_eval_needs_a_source_of_held_out_prompts(tmp_path):
    data = loop_recipe(tmp_path / "run", eval={"every": 2})
    data["data"] = {"path": "x.jsonl", "tokenizer": "t.model"}
    with pytest.raises(ValueError, match="eval.every needs eval.path"):
        Recipe.model_validate(data)
