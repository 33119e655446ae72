"""The built-in tasks' environments: ``relay_digits`` (copy a digit string every turn, each
revealed by the turn before) and ``recall_key`` (an early turn decides what a later one can
earn), the tiny multi-turn tasks of :mod:`megatron_gspo.data.tasks`.

``recall_key`` was built to tell sequence-level credit from turn-level credit apart: the first
turn's choice is rewarded only two turns later, while the middle turn earns a reward of its
own whatever the first turn chose.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_gspo.episodes.environment import Step
from megatron_gspo.rewards.functions import digit_match

__all__ = ["RecallKey", "RelayDigits", "asked_key", "named_key"]


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


def asked_key(cue: str) -> int:
    """The key the environment asks about in the last turn: 1 for a cue of 5 or more."""
    return int(int(cue) >= 5)


def named_key(action: str) -> int | None:
    """The key a first turn names: the parity of its first digit (None: no digit)."""
    action = action.strip()
    return int(action[0]) % 2 if action[:1].isdigit() else None


@dataclass
class _RecallState:
    cue: str
    values: tuple[str, str]
    turn: int = 0
    shown: str = ""


@dataclass
class RecallKey:
    """Two keys hold a digit string each (the record's answer: ``"cue|value0|value1"``); the
    prompt shows the cue (``"7="``), which says which key the last turn asks about (0 below 5,
    1 from 5).

    1. The model names a key by the parity of its first digit. Reward 0.
    2. The environment shows the named key's value (``"42="``); the model copies it
       (``digit_match``): earned whatever key was named.
    3. The environment asks (``"="``) for the asked key's value (``digit_match``): a model that
       named that key in turn 1 has seen it; otherwise it can only guess.

    Under sequence-level credit the middle turn shares the episode's outcome, which turn 1
    decided; under turn-level credit (return-to-go) turn 1 is credited with turn 3's reward and
    turn 3 with its own.
    """

    separator: str = "|"

    def reset(self, prompt: str, answer: str) -> _RecallState:
        cue, *values = answer.split(self.separator)
        if len(values) != 2 or not cue.isdigit():
            raise ValueError(f"recall_key: answer must read 'cue|value0|value1', got {answer!r}")
        return _RecallState(cue, (values[0], values[1]))

    def step(self, state: _RecallState, action: str) -> Step:
        if state.turn == 0:
            key = named_key(action)
            # No digit names no key: nothing is shown, turn 2 has nothing to earn and turn 3
            # can only guess.
            shown = "" if key is None else state.values[key]
            after = _RecallState(state.cue, state.values, 1, shown)
            return Step(f"{shown}=", 0.0, False, after)
        if state.turn == 1:
            after = _RecallState(state.cue, state.values, 2, state.shown)
            # Nothing shown earns nothing (digit_match of two empty strings is 1).
            reward = digit_match(action, state.shown) if state.shown else 0.0
            return Step("=", reward, False, after)
        reward = digit_match(action, state.values[asked_key(state.cue)])
        return Step("", reward, True, _RecallState(state.cue, state.values, 3, state.shown))
