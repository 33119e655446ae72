"""Running episodes: the engine samples model turns, the environment answers them.

Lock-step, as the embedded engine needs: turn ``k`` of every live episode is sampled in one
batched request, then the environment steps of that turn run in parallel in the environment's
worker processes, then turn ``k + 1`` is sampled for the episodes that go on. The first turn is
the single-turn request itself (``group_size`` samples per prompt, the step's seed); later
turns send each live episode's whole context (prompt and every turn so far, as ids) with one
sample each. An episode ends when the environment says done, fails, or its model turn was cut
at ``rollout.max_new_tokens``; at ``rollout.multi_turn.max_turns`` model turns; or when the next
observation and turn would not fit ``model.max_seq_length``. An observation is appended only
when a model turn follows it. (``rollout.multi_turn.end_on_cut_turn: false`` lets an episode go
on after a cut turn, for tasks that tolerate one: the tiny ones.)

The embedded engine re-reads each episode's context at every turn (one prefill of prompt and
history, then decoding from its KV cache): Megatron's static inference context keeps one
sequence offset for the whole batch, so episodes whose histories grew by different lengths
cannot extend one cache without gaps in their positions.

Without an environment an episode is one model turn: exactly the single-turn rollout.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from megatron_gspo.data.prompts import Prompt
from megatron_gspo.episodes.environment import EnvironmentPool
from megatron_gspo.episodes.episode import Episode, single_turn
from megatron_gspo.rollout.protocol import (
    Completion,
    RolloutRequest,
    RolloutResult,
    SamplingParams,
)
from megatron_gspo.runtime.seeds import turn_seed
from megatron_gspo.runtime.workers import Outcome

__all__ = [
    "EpisodeRunner",
    "EpisodeSetup",
    "Held",
    "Limits",
    "Verdict",
    "after_reset",
    "apply_verdict",
    "verdict",
]

T = TypeVar("T")


def _alone(fn: Callable[[], T]) -> T:
    return fn()


@dataclass(frozen=True)
class Verdict:
    """The environment's answer to one model turn, as every rank needs it."""

    status: str  # "ok", "error" or "timeout" (workers.Outcome)
    message: str = ""
    reward: float = 0.0
    done: bool = False
    observation_ids: tuple[int, ...] = ()
    info: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class Held:
    """An environment state (whatever the user's environment keeps, None included)."""

    state: Any


@dataclass(frozen=True)
class EpisodeSetup:
    """What every runner goes by besides its engine: the rules that end an episode, and, where
    the environment runs (global rank 0; None elsewhere), its worker pool and the codec between
    turns and ids (``render`` an observation as ids, ``decode`` a model turn as text)."""

    multi_turn: bool = False
    max_turns: int = 1
    max_seq_length: int = 2**31
    # Whether a model turn cut at max_new_tokens ends its episode (rollout.multi_turn).
    end_on_cut_turn: bool = True
    envs: EnvironmentPool | None = None
    render: Callable[[str], list[int]] | None = None
    decode: Callable[[list[int]], str] | None = None

    def limits(self, max_new_tokens: int) -> Limits:
        return Limits(self.max_turns, self.max_seq_length, max_new_tokens, self.end_on_cut_turn)


class EpisodeRunner:
    """Runs a batch of episodes through ``generate`` (an engine's ``generate`` or
    ``generate_rank0``) and the environment.

    Where the environment does not run (``setup.envs`` None), ``share(fn)`` brings rank 0's
    ``fn()`` (a collective). Where rank 0 alone runs the episodes (asynchronous rollouts),
    ``share`` just calls ``fn``.
    """

    def __init__(
        self,
        generate: Callable[[RolloutRequest], RolloutResult],
        setup: EpisodeSetup,
        *,
        share: Callable[[Callable[[], Any]], Any] = _alone,
    ) -> None:
        self.generate, self.setup, self.share = generate, setup, share
        self.stats: dict[str, float] = {}

    def run(self, prompts: list[Prompt], params: SamplingParams) -> list[list[Episode]]:
        """``group_size`` episodes for every prompt, grouped by prompt."""
        if not prompts:
            return []
        ids = [p.token_ids for p in prompts]
        if not self.setup.multi_turn:
            return single_turn(self.generate(RolloutRequest(ids, params)))
        g = params.group_size
        owners = [p for p in prompts for _ in range(g)]
        states: list[Any] = []
        envs = self.setup.envs
        if envs is not None:  # the resets overlap the first turn's generation
            states = [envs.reset(p.text, p.answer) for p in owners]
        first = self.generate(RolloutRequest(ids, params)).completions
        episodes = [Episode() for _ in owners]
        turns = [c for group in first for c in group]
        live = list(range(len(episodes)))
        for turn in range(self.setup.max_turns):
            for i, c in zip(live, turns, strict=True):
                episodes[i].add_model_turn(c)
            verdicts = self.share(lambda live=live: self._step(episodes, live, states))
            live = self._advance(episodes, owners, live, turns, verdicts, turn, params)
            if not live:
                break
            request = RolloutRequest(
                [owners[i].token_ids + episodes[i].token_ids for i in live],
                replace(params, group_size=1, seed=turn_seed(params.seed, turn + 1)),
            )
            turns = [group[0] for group in self.generate(request).completions]
        return [episodes[k : k + g] for k in range(0, len(episodes), g)]

    def _step(self, episodes: list[Episode], live: list[int], states: list[Any]) -> list:
        """On rank 0: every live episode's environment step on its last model turn.

        ``states[i]`` is episode ``i``'s pending reset (a future), its environment state, or
        the verdict of its failed reset."""
        envs, decode, render = self.setup.envs, self.setup.decode, self.setup.render
        assert envs is not None and decode is not None and render is not None
        futures: dict[int, Future] = {}
        for i in live:
            if isinstance(states[i], Future):
                states[i] = after_reset(states[i].result())
            if isinstance(states[i], Held):
                action = decode(episodes[i].turn_tokens(episodes[i].num_turns - 1))
                futures[i] = envs.step(states[i].state, action)
        verdicts = []
        for i in live:
            if i not in futures:
                verdicts.append(states[i])
                continue
            verdicts.append(verdict(futures[i].result(), render))
            if verdicts[-1].status == "ok":
                states[i] = Held(futures[i].result().value.state)
        return verdicts

    def _advance(
        self,
        episodes: list[Episode],
        owners: list[Prompt],
        live: list[int],
        turns: list[Completion],
        verdicts: list[Verdict],
        turn: int,
        params: SamplingParams,
    ) -> list[int]:
        """Apply the verdicts; the episodes that go on to another model turn."""
        limits = self.setup.limits(params.max_new_tokens)
        return [
            i
            for i, c, v in zip(live, turns, verdicts, strict=True)
            if apply_verdict(episodes[i], len(owners[i].token_ids), c, v, turn, limits)
        ]


@dataclass(frozen=True)
class Limits:
    max_turns: int
    max_seq_length: int
    max_new_tokens: int
    # Whether a model turn cut at max_new_tokens ends its episode (rollout.multi_turn).
    end_on_cut_turn: bool = True


def after_reset(outcome: Outcome) -> Held | Verdict:
    """An environment's reset as the episode's state, or the verdict that ends it."""
    if outcome.ok:
        return Held(outcome.value)
    return Verdict(outcome.status, f"reset: {outcome.message}")


def verdict(outcome: Outcome, render: Callable[[str], list[int]]) -> Verdict:
    """An environment step's outcome as what every rank needs of it (the observation as
    ids, rendered where the environment runs)."""
    if not outcome.ok:
        return Verdict(outcome.status, f"step: {outcome.message}")
    step = outcome.value
    ids = () if step.done else tuple(render(step.observation))
    return Verdict("ok", "", step.reward, step.done, ids, tuple(step.info.items()))


def apply_verdict(
    e: Episode, prompt_len: int, c: Completion, v: Verdict, turn: int, limits: Limits
) -> bool:
    """Record the environment's answer to the episode's last model turn (``c``, turn number
    ``turn``); whether the episode goes on to another model turn. The rules of every
    runner."""
    if v.status != "ok":
        e.end, e.failure = f"env_{v.status}", v.message  # type: ignore[assignment]
        return False
    e.turn_rewards.append(v.reward)
    for key, value in v.info:
        e.info[key] = e.info.get(key, 0.0) + value
    length = prompt_len + len(e.token_ids) + len(v.observation_ids)
    if c.finish_reason == "length" and limits.end_on_cut_turn:
        e.end = "length"
    elif v.done:
        e.end = "done"
    elif turn + 1 == limits.max_turns:
        e.end = "max_turns"
    elif length + limits.max_new_tokens > limits.max_seq_length:
        e.end = "budget"
    else:
        e.add_observation(list(v.observation_ids))
        return True
    return False
