"""Overlong responses: DAPO's soft penalty shapes the reward, overlong filtering takes cut
responses out of the loss."""

from __future__ import annotations

import pytest

from megatron_gspo.rewards.functions import overlong_penalty
from tests.support.ranks import run_distributed
from tests.support.runs import loop_recipe


def test_overlong_penalty_is_dapos_linear_ramp():
    # max_new_tokens 10, cache 4: free up to 6 tokens, then -1/4 per token down to -1 at 10.
    got = [overlong_penalty(n, 10, 4, 1.0) for n in (1, 6, 7, 8, 10)]
    assert got == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(10, 10, 4, 0.5) == -0.5


def _score(rank, world, data: dict):
    from megatron_gspo.config import Recipe
    from megatron_gspo.data.prompts import PromptStream
    from megatron_gspo.episodes.episode import single_turn
    from megatron_gspo.episodes.scoring import Scorer
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.rewards.computer import RewardComputer
    from megatron_gspo.rollout.protocol import Completion, RolloutResult

    recipe = Recipe.model_validate(data)
    init_parallel(recipe.parallel)
    stream = PromptStream(recipe.data, seed=0)
    prompts = stream.next_batch(2)
    tok = stream.tokenizer

    def completion(text: str, cut: bool) -> Completion:
        ids = tok.encode(text)
        return Completion(ids, [-1.0] * len(ids), "length" if cut else "stop")

    # Per prompt: the right answer (finished), and a wrong one cut at the 4-token limit.
    result = RolloutResult(
        [[completion(p.answer, False), completion("0000", True)] for p in prompts]
    )
    rewards = RewardComputer(recipe.reward)
    try:
        score = Scorer(recipe, rewards, stream.tokenizer.decode)
        samples, metrics = score(prompts, single_turn(result))
    finally:
        rewards.close()
    return [(s.response_ids, s.advantage, s.reward) for s in samples], metrics


@pytest.mark.parametrize("filtering", [False, True], ids=["kept", "filtered"])
def test_score_shapes_advantages_and_filters_cut_responses(tmp_path, filtering):
    data = loop_recipe(
        tmp_path,
        rollout={"group_size": 2, "max_new_tokens": 4},
        reward={"overlong_penalty": {"cache_tokens": 2, "max_penalty": 1.0}},
        train={"overlong_filter": filtering},
    )
    data["data"]["task_options"] = {"min_len": 2, "max_len": 2}  # answers of 2 tokens
    samples, metrics = run_distributed(_score, 1, data)[0]
    assert metrics["overlong_fraction"] == 0.5
    # 4 tokens at max_new_tokens 4 with a 2-token cache: the full penalty, -1.
    assert metrics["overlong_penalty_mean"] == -0.5
    # Rewards are the task's own (unshaped, never negative); advantages see reward + penalty.
    assert all(reward >= 0 for _, _, reward in samples)
    assert all(reward == 1.0 for ids, _, reward in samples if len(ids) == 2)
    if filtering:
        assert metrics["overlong_filtered"] == 2 and len(samples) == 2
        assert all(len(ids) == 2 for ids, _, _ in samples)
        assert all(adv > 0 for _, adv, _ in samples)
    else:
        assert len(samples) == 4 and "overlong_filtered" not in metrics
        cut_adv = [adv for ids, adv, _ in samples if len(ids) == 4]
        assert cut_adv and all(adv < 0 for adv in cut_adv)


def test_the_penalty_reaches_the_advantages(tmp_path):
    def cut_advantages(max_penalty: float) -> list[float]:
        data = loop_recipe(
            tmp_path,
            rollout={"group_size": 2, "max_new_tokens": 4},
            reward={"overlong_penalty": {"cache_tokens": 2, "max_penalty": max_penalty}},
        )
        data["data"]["task_options"] = {"min_len": 2, "max_len": 2}
        samples, _ = run_distributed(_score, 1, data)[0]
        return [adv for ids, adv, _ in samples if len(ids) == 4]

    # Group-normalized: a penalty on the cut response widens the gap to the finished one.
    assert all(a < b for a, b in zip(cut_advantages(5.0), cut_advantages(0.0), strict=True))
