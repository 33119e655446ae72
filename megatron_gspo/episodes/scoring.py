"""From episodes to samples the update trains on: rewards, failures, credit, metrics.

An episode's reward is the sum of its environment's turn rewards and the recipe's reward
functions on its last model turn (``reward.functions``; for a single-turn rollout, the whole
response), plus DAPO's overlong penalty where the recipe asks for it. Rewards run on global
rank 0 and are shared with every rank.

A sample whose score could not be computed (a reward function raised, hung or returned no
finite number; the environment failed) has no real score: ``reward.on_error: drop_group``
takes its whole group out of the update, ``zero`` scores the missing parts 0. More than
``reward.max_error_fraction`` of a step's samples failing stops the run, naming the first
failure.

Credit (``loss.advantage_level``): ``sequence`` gives every token of an episode its group-
normalised episode reward; ``turn`` gives the tokens of each model turn that turn's group-
normalised return-to-go (:func:`megatron_gspo.loss.advantages.turn_advantages`), which reaches
the loss as per-token advantages. Environment tokens are masked out of the loss either way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_gspo.config import Recipe
from megatron_gspo.data.prompts import Prompt
from megatron_gspo.episodes.episode import Episode
from megatron_gspo.loss.advantages import group_advantages, returns_to_go, turn_advantages
from megatron_gspo.model.routes import check_routes
from megatron_gspo.rewards.computer import RewardComputer, RewardStats
from megatron_gspo.rewards.functions import overlong_penalty
from megatron_gspo.rewards.served import SERVED
from megatron_gspo.runtime.errors import InputError, UserError
from megatron_gspo.runtime.rank0 import on_rank0
from megatron_gspo.trainer.packing import Sample

__all__ = ["ScoringError", "Scorer", "checked_routes", "final_rewards"]


class ScoringError(UserError, ValueError):
    """Too many samples of a step could not be scored; the message names the first failure."""


class Scorer:
    """Turns a batch of episodes into samples. Collective: rank 0 scores, all ranks agree.

    ``rewards`` (the recipe's reward functions) and ``decode`` are needed on global rank 0.
    """

    def __init__(
        self,
        recipe: Recipe,
        rewards: RewardComputer | None,
        decode: Callable[[list[int]], str] | None,
    ) -> None:
        self.recipe, self.rewards, self.decode = recipe, rewards, decode
        multi = recipe.rollout.multi_turn
        self.env_name = multi.env if multi is not None else None

    def __call__(
        self, prompts: list[Prompt], groups: list[list[Episode]]
    ) -> tuple[list[Sample], dict[str, float]]:
        recipe = self.recipe
        episodes = [e for g in groups for e in g]
        final, stats = self._score(prompts, episodes)
        env_failed = [e.failure is not None for e in episodes]
        failed = [a or b for a, b in zip(stats.failed, env_failed, strict=True)]
        self._stop_if_mostly_failed(episodes, failed, stats)
        penalties = self._penalties(episodes)
        task = [sum(e.turn_rewards) + f for e, f in zip(episodes, final, strict=True)]
        shaped = [t + p for t, p in zip(task, penalties, strict=True)]
        group = recipe.rollout.group_size
        scale = recipe.loss.advantage_scale
        adv = group_advantages(torch.tensor(shaped, dtype=torch.float64), group, scale=scale)
        turn_adv = None
        if recipe.loss.advantage_level == "turn":
            returns = [
                returns_to_go(e.turn_rewards, f + p)
                for e, f, p in zip(episodes, final, penalties, strict=True)
            ]
            turn_adv = turn_advantages(returns, group, scale=scale)
        samples = []
        for k, e in enumerate(episodes):
            prompt = prompts[k // group]
            samples.append(
                Sample(
                    prompt_ids=prompt.token_ids,
                    response_ids=e.token_ids,
                    response_mask=e.mask,
                    advantage=float(adv[k]),
                    token_advantages=None if turn_adv is None else _per_token(e, turn_adv[k]),
                    rollout_logprobs=e.logprobs,
                    reward=task[k],
                    prompt_index=k // group,
                    policy_version=_oldest(e.versions),
                    token_versions=e.token_versions,
                    routes=checked_routes(e, prompt, recipe),
                )
            )
        keep = [True] * len(samples)
        dropped = 0
        if recipe.reward.on_error == "drop_group":
            bad = {k // group for k, f in enumerate(failed) if f}
            dropped = len(bad)
            keep = [k // group not in bad for k in range(len(samples))]
        metrics = _metrics(episodes, task, shaped, failed, group)
        metrics.update(
            reward_errors=float(stats.errors),
            reward_timeouts=float(stats.timeouts),
            groups_dropped_on_error=float(dropped),
        )
        if any(f.name in SERVED for f in recipe.reward.functions):
            # Requests to the judge / reward-model servers in flight at once this step.
            metrics["reward_in_flight_max"] = float(stats.served_in_flight_max)
        if recipe.reward.overlong_penalty is not None:
            metrics["overlong_penalty_mean"] = sum(penalties) / len(penalties)
        if recipe.train.overlong_filter:
            cut = [k and e.truncated for k, e in zip(keep, episodes, strict=True)]
            metrics["overlong_filtered"] = float(sum(cut))
            keep = [k and not c for k, c in zip(keep, cut, strict=True)]
        if recipe.rollout.multi_turn is not None:
            metrics.update(_episode_metrics(episodes))
        return [s for s, k in zip(samples, keep, strict=True) if k], metrics

    # -- rewards -------------------------------------------------------------------------------

    def _score(
        self, prompts: list[Prompt], episodes: list[Episode]
    ) -> tuple[list[float], RewardStats]:
        """The reward functions on every episode's last model turn (rank 0, shared): one
        value per episode (0 where they failed) and the stats that say which failed."""
        group = self.recipe.rollout.group_size
        answers = [prompts[k // group].answer for k in range(len(episodes))]
        texts = [prompts[k // group].text for k in range(len(episodes))]
        return on_rank0(final_rewards, episodes, answers, self.rewards, self.decode, texts)

    def _stop_if_mostly_failed(
        self, episodes: list[Episode], failed: list[bool], stats: RewardStats
    ) -> None:
        limit = self.recipe.reward.max_error_fraction
        fraction = sum(failed) / len(failed)
        if fraction <= limit:
            return
        first = stats.first_failure
        if first is None:
            e = next(e for e in episodes if e.failure is not None)
            first = f"environment {self.env_name}: {e.failure}"
        raise ScoringError(
            f"{sum(failed)} of {len(failed)} samples of this step could not be scored "
            f"({fraction:.0%} > reward.max_error_fraction {limit:g}); the first: {first}"
        )

    def _penalties(self, episodes: list[Episode]) -> list[float]:
        penalty = self.recipe.reward.overlong_penalty
        if penalty is None:
            return [0.0] * len(episodes)
        limit = self.recipe.rollout.max_new_tokens
        return [
            overlong_penalty(
                len(e.turn_tokens(e.num_turns - 1)),
                limit,
                penalty.cache_tokens,
                penalty.max_penalty,
            )
            for e in episodes
        ]


def checked_routes(e: Episode, prompt: Prompt, recipe: Recipe):
    """The episode's routes, which must cover every token the model reads (an engine that
    returns fewer rows than the sequence has tokens would misalign every later one)."""
    if not recipe.wants_rollout_routes:
        return None
    if e.routes is None:
        raise InputError(
            f"rollout.engine {recipe.rollout.engine!r} returned no expert routes, which "
            "train.routing_replay: rollout / rollout.return_routes need"
        )
    m = recipe.model
    check_routes(
        e.routes,
        num_tokens=len(prompt.token_ids) + len(e.token_ids) - 1,
        num_moe_layers=len(m.moe_layers),
        topk=m.moe_router_topk,
        num_experts=m.num_experts,
        where=f"the routes of a response to prompt {prompt.token_ids[:8]}...",
    )
    return e.routes


def final_rewards(
    episodes: list[Episode],
    answers: list[str],
    rewards: RewardComputer | None,
    decode: Callable[[list[int]], str],
    prompts: list[str] | None = None,
) -> tuple[list[float], RewardStats]:
    """The reward functions on each episode's last model turn (none: all 0); ``prompts``:
    each episode's prompt text, for the functions that take it."""
    if rewards is None or not rewards.specs:
        return [0.0] * len(episodes), RewardStats(failed=[False] * len(episodes))
    responses = [decode(e.turn_tokens(e.num_turns - 1)) for e in episodes]
    return rewards(responses, answers, prompts)


def _per_token(e: Episode, turn_adv: list[float]) -> list[float]:
    """Each model token gets its turn's advantage; environment tokens 0 (masked anyway).
    Turns the environment never answered (a failure) get 0."""
    return [
        turn_adv[k] if m and k < len(turn_adv) else 0.0
        for m, k in zip(e.mask, e.turn_ids, strict=True)
    ]


def _oldest(versions: list[int | None]) -> int | None:
    known = [v for v in versions if v is not None]
    return min(known) if known else None


def _metrics(
    episodes: list[Episode], task: list[float], shaped: list[float], failed: list[bool], group
) -> dict[str, float]:
    """Rewards over the samples that were scored (a failed one has no real reward)."""
    scored = torch.tensor([t for t, f in zip(task, failed, strict=True) if not f])
    lengths = torch.tensor([float(e.model_tokens) for e in episodes])
    per_group = torch.tensor(shaped).view(-1, group)
    std = per_group.std(dim=1, unbiased=False) if group > 1 else torch.zeros(1)
    nan = float("nan")
    return {
        "reward_mean": float(scored.mean()) if len(scored) else nan,
        "reward_std": float(scored.std(unbiased=False)) if len(scored) else nan,
        "reward_max": float(scored.max()) if len(scored) else nan,
        "failed_fraction": sum(failed) / len(failed),
        "groups_without_signal": float((std == 0).float().mean()),
        "response_length_mean": float(lengths.mean()),
        "response_length_max": float(lengths.max()),
        "finished_fraction": sum(not e.truncated for e in episodes) / len(episodes),
        "overlong_fraction": sum(e.truncated for e in episodes) / len(episodes),
    }


# The environment's counts (Step.info) as step metrics: per episode on average, or in all.
_INFO_METRICS = {
    "tool_calls": ("tool_calls_mean", "mean"),
    "tool_errors": ("tool_errors", "sum"),
    "tool_time_s": ("tool_time_s", "sum"),
}


def _episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    tokens = sum(len(e.token_ids) for e in episodes)
    out = {
        "turns_mean": sum(e.num_turns for e in episodes) / len(episodes),
        "model_token_fraction": sum(e.model_tokens for e in episodes) / max(tokens, 1),
        "env_errors": float(sum(e.end == "env_error" for e in episodes)),
        "env_timeouts": float(sum(e.end == "env_timeout" for e in episodes)),
    }
    keys = sorted({k for e in episodes for k in e.info})
    for key in keys:
        name, how = _INFO_METRICS.get(key, (f"env_info/{key}_mean", "mean"))
        total = sum(e.info.get(key, 0.0) for e in episodes)
        out[name] = total / len(episodes) if how == "mean" else total
    most = max(len(e.turn_rewards) for e in episodes)
    for k in range(most):
        rewards = [e.turn_rewards[k] for e in episodes if len(e.turn_rewards) > k]
        out[f"turn_reward_mean/turn_{k + 1}"] = sum(rewards) / len(rewards)
    return out
