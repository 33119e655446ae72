"""The tiny multi-turn task's environment (``data.task: relay_digits``)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_gspo.episodes.environment import Step
from megatron_gspo.episodes.rewards import digit_match

__all__ = ["RelayDigits"]


@dataclass
class _RelayState:
    targets: list[str]
    turn: int = 0


@dataclass
class RelayDigits:
    """The tiny multi-turn task (``data.task: relay_digits``): copy a digit string in every
    turn, where each string after the first is revealed only by the environment's turn.

    The record's answer holds one string per turn (``"12|4|907"``); the prompt shows the first
    (``"12="``). After each model turn the environment rewards it with ``digit_match`` against
    that turn's string and reveals the next one (``"4="``), until the strings run out. A
    policy that ignores observations can earn the first turn's reward only.
    """

    separator: str = "|"

    def reset(self, prompt: str, answer: str) -> _RelayState:
        return _RelayState(answer.split(self.separator))

    def step(self, state: _RelayState, action: str) -> Step:
        reward = digit_match(action, state.targets[state.turn])
        turn = state.turn + 1
        done = turn == len(state.targets)
        observation = "" if done else f"{state.targets[turn]}="
        return Step(observation, reward, done, _RelayState(state.targets, turn))
