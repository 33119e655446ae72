"""Validation during training: held-out prompts, answered greedily and sampled, through the
same rollout engine and rewards as training.

``eval.every: N`` evaluates at step 0, every N steps and at the last step, on the weights the
engine holds after that step's sync. Metrics: ``eval_reward_mean`` (the greedy response's
reward, averaged over prompts), ``eval_mean@k`` (the mean reward of ``k`` sampled responses)
and ``eval_pass@k`` (the fraction of prompts with a sampled response whose reward reaches
``eval.pass_threshold``). The prompts are ``eval.path`` (JSONL, in file order) or, for a
synthetic task, a sample of the task drawn with its own seed (on a task as small as the tiny
one the two samples share prompts; a file is the held-out set proper).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from megatron_gspo.config import Recipe
from megatron_gspo.data.prompts import Prompt, PromptStream
from megatron_gspo.episodes.episode import Episode
from megatron_gspo.episodes.runner import EpisodeRunner
from megatron_gspo.episodes.scoring import final_rewards
from megatron_gspo.rewards.computer import RewardComputer
from megatron_gspo.rollout.protocol import SamplingParams
from megatron_gspo.runtime.rank0 import on_rank0
from megatron_gspo.runtime.seeds import eval_data_seed, eval_seed

__all__ = ["eval_prompts", "evaluate", "is_eval_step", "pass_at_k"]


def is_eval_step(recipe: Recipe, step: int, total: int) -> bool:
    every = recipe.eval.every
    return bool(every) and (step % every == 0 or step == total)


def eval_prompts(recipe: Recipe, max_prompt_tokens: int) -> list[Prompt]:
    data = recipe.data
    if recipe.eval.path is not None:
        data = data.model_copy(update={"task": None, "path": recipe.eval.path, "shuffle": False})
        stream = PromptStream(data, seed=0, max_prompt_tokens=max_prompt_tokens)
    else:
        stream = PromptStream(
            data,
            seed=eval_data_seed(recipe.rollout.seed),
            max_prompt_tokens=max_prompt_tokens,
        )
    return stream.next_batch(recipe.eval.num_prompts)


def pass_at_k(rewards: list[list[float]], threshold: float) -> float:
    """The fraction of prompts with at least one response whose reward reaches ``threshold``."""
    return sum(any(r >= threshold for r in row) for row in rewards) / len(rewards)


def evaluate(
    runner: EpisodeRunner | None,
    prompts: list[Prompt],
    decode: Callable[[list[int]], str] | None,
    rewards: RewardComputer | None,
    recipe: Recipe,
    *,
    step: int,
    params: SamplingParams,
) -> dict[str, float]:
    """The eval metrics at ``step``; collective (every rank gets rank 0's figures).

    ``runner`` runs episodes on every rank together (it is passed on every rank) or, while an
    asynchronous pipeline is paused, on rank 0 alone (``None`` elsewhere). ``params`` are the
    training rollouts' sampling parameters, of which evaluation changes the group size,
    temperature and seed. An episode's reward is its environment's turn rewards and the reward
    functions on its last turn, as in training.
    """
    cfg = recipe.eval

    def sampling(group: int, temperature: float, salt: int) -> SamplingParams:
        return replace(
            params,
            group_size=group,
            temperature=temperature,
            top_p=1.0 if temperature == 0 else params.top_p,
            return_routes=False,
            seed=eval_seed(recipe.rollout.seed, step, salt),
        )

    if runner is not None:
        greedy = runner.run(prompts, sampling(1, 0.0, 0))
        sampled = runner.run(prompts, sampling(cfg.k, cfg.temperature, 1))

    def metrics() -> dict[str, float]:
        answers = [p.answer for p in prompts]
        g_rewards, g_stats = _totals([g[0] for g in greedy], answers, rewards, decode)
        flat = [e for g in sampled for e in g]
        s_flat, s_stats = _totals(flat, [a for a in answers for _ in range(cfg.k)], rewards, decode)
        s_rewards = [s_flat[i * cfg.k : (i + 1) * cfg.k] for i in range(len(prompts))]
        return {
            "eval_reward_mean": sum(g_rewards) / len(g_rewards),
            f"eval_mean@{cfg.k}": sum(s_flat) / len(s_flat),
            f"eval_pass@{cfg.k}": pass_at_k(s_rewards, cfg.pass_threshold),
            "eval_reward_errors": float(g_stats.errors + s_stats.errors),
        }

    return on_rank0(metrics)


def _totals(episodes: list[Episode], answers, rewards, decode):
    """Each episode's reward (a failed part scores 0 here: evaluation drops nothing)."""
    final, stats = final_rewards(episodes, answers, rewards, decode)
    return [sum(e.turn_rewards) + f for e, f in zip(episodes, final, strict=True)], stats
