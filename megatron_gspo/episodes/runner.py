"""Running episodes: the engine samples model turns, the environment answers them.

Lock-step, as the embedded engine needs: turn ``k`` of every live episode is sampled in one
batched request, then the environment steps of that turn run in parallel in the environment's
worker processes, then turn ``k + 1`` is sampled for the episodes that go on. The first turn is
the single-turn request itself (``group_size`` samples per prompt, the step's seed); later
turns send each live episode's whole context (prompt and every turn so far, as ids) with one
sample each. An episode ends when the environment says done, fails, or its model turn was cut
at ``rollout.max_new_tokens``; at ``rollout.multi_turn.max_turns`` model turns; or when the next
observation and turn would not fit ``model.max_seq_length``. An observation is appended only
when a model turn follows it.

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

__all__ = ["EpisodeRunner", "Verdict", "turn_seed"]

T = TypeVar("T")


def _alone(fn: Callable[[], T]) -> T:
    return fn()


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of model turn ``turn`` (0-based) of a step whose seed is ``seed``."""
    return seed if turn == 0 else (seed * 1_000_033 + turn * 7_919) % 2**62


@dataclass(frozen=True)
class Verdict:
    """The environment's answer to one model turn, as every rank needs it."""

    status: str  # "ok", "error" or "timeout" (workers.Outcome)
    message: str = ""
    reward: float = 0.0
    done: bool = False
    observation_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class _Held:
    """An environment state (whatever the user's environment keeps, None included)."""

    state: Any


class EpisodeRunner:
    """Runs a batch of episodes through ``generate`` (an engine's ``generate`` or
    ``generate_rank0``) and the environment.

    ``envs`` and ``render`` exist where the environment runs (global rank 0); elsewhere they are
    None and ``share(fn)`` brings rank 0's ``fn()`` (a collective). Where rank 0 alone runs the
    episodes (asynchronous rollouts), ``share`` just calls ``fn``.
    """

    def __init__(
        self,
        generate: Callable[[RolloutRequest], RolloutResult],
        *,
        multi_turn: bool,
        max_turns: int = 1,
        max_seq_length: int,
        envs: EnvironmentPool | None = None,
        render: Callable[[str], list[int]] | None = None,
        decode: Callable[[list[int]], str] | None = None,
        share: Callable[[Callable[[], Any]], Any] = _alone,
    ) -> None:
        self.generate = generate
        self.multi_turn = multi_turn
        self.max_turns = max_turns
        self.max_seq_length = max_seq_length
        self.envs, self.render, self.decode, self.share = envs, render, decode, share

    def run(self, prompts: list[Prompt], params: SamplingParams) -> list[list[Episode]]:
        """``group_size`` episodes for every prompt, grouped by prompt."""
        if not prompts:
            return []
        ids = [p.token_ids for p in prompts]
        if not self.multi_turn:
            return single_turn(self.generate(RolloutRequest(ids, params)))
        g = params.group_size
        owners = [p for p in prompts for _ in range(g)]
        states: list[Any] = []
        if self.envs is not None:  # the resets overlap the first turn's generation
            states = [self.envs.reset(p.text, p.answer) for p in owners]
        first = self.generate(RolloutRequest(ids, params)).completions
        episodes = [Episode() for _ in owners]
        turns = [c for group in first for c in group]
        live = list(range(len(episodes)))
        for turn in range(self.max_turns):
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
        assert self.envs is not None and self.decode is not None and self.render is not None
        futures: dict[int, Future] = {}
        for i in live:
            if isinstance(states[i], Future):
                outcome = states[i].result()
                states[i] = (
                    _Held(outcome.value)
                    if outcome.ok
                    else Verdict(outcome.status, f"reset: {outcome.message}")
                )
            if isinstance(states[i], _Held):
                action = self.decode(episodes[i].turn_tokens(episodes[i].num_turns - 1))
                futures[i] = self.envs.step(states[i].state, action)
        verdicts = []
        for i in live:
            if i not in futures:
                verdicts.append(states[i])
                continue
            outcome = futures[i].result()
            if not outcome.ok:
                verdicts.append(Verdict(outcome.status, f"step: {outcome.message}"))
                continue
            step = outcome.value
            states[i] = _Held(step.state)
            ids = () if step.done else tuple(self.render(step.observation))
            verdicts.append(Verdict("ok", reward=step.reward, done=step.done, observation_ids=ids))
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
        going_on = []
        for i, c, v in zip(live, turns, verdicts, strict=True):
            e = episodes[i]
            if v.status != "ok":
                e.end, e.failure = f"env_{v.status}", v.message  # type: ignore[assignment]
                continue
            e.turn_rewards.append(v.reward)
            length = len(owners[i].token_ids) + len(e.token_ids) + len(v.observation_ids)
            if c.finish_reason == "length":
                e.end = "length"
            elif v.done:
                e.end = "done"
            elif turn + 1 == self.max_turns:
                e.end = "max_turns"
            elif length + params.max_new_tokens > self.max_seq_length:
                e.end = "budget"
            else:
                e.add_observation(list(v.observation_ids))
                going_on.append(i)
        return going_on
