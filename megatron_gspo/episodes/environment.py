"""Environments: what answers a model turn in a multi-turn episode.

The protocol is two methods on an object built once per worker process
(``cls(**rollout.multi_turn.env_kwargs)``), which keeps nothing between calls:

- ``reset(prompt, answer) -> state``: the episode's starting state, from its data record (the
  first observation is the record's prompt, which the episodes of a group share);
- ``step(state, action) -> Step``: the model's turn as text in, the environment's answer out:
  an observation (the next environment turn's text), this turn's reward, whether the episode is
  done, the new state, and counts for the run's metrics (``info``, summed over an episode:
  the tool environment reports ``tool_calls``, ``tool_errors`` and ``tool_time_s``).

Everything an episode carries lives in ``state``, which must be picklable: any worker can take
an episode's next call, a worker killed at a deadline loses no other episode, and episodes in
flight can be checkpointed. Environments are user code and run in worker processes with a
deadline per call (``reward.timeout_s``, :mod:`megatron_gspo.runtime.workers`); a call that raises,
hangs or returns something malformed ends its episode (counted in ``env_errors`` /
``env_timeouts``), never the run.

Chosen by name (``rollout.multi_turn.env``): a built-in (:data:`ENVIRONMENTS`: ``relay_digits``,
the tiny multi-turn task; ``recall_key``, the one whose first turn is rewarded two turns later;
``tools``, tool calling) or ``package.module:attr`` for a class (or
factory) of the user's.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from megatron_gspo.rewards.value import reward_value
from megatron_gspo.runtime.user_code import check_kwargs, resolve
from megatron_gspo.runtime.workers import WorkerPool

__all__ = [
    "ENVIRONMENTS",
    "EnvironmentPool",
    "Environment",
    "Step",
    "check_environment",
    "resolve_environment",
]


@dataclass(frozen=True)
class Step:
    observation: str = ""
    reward: float = 0.0
    done: bool = False
    state: Any = None
    info: dict[str, float] = field(default_factory=dict)


class Environment(Protocol):
    def reset(self, prompt: str, answer: str) -> Any: ...

    def step(self, state: Any, action: str) -> Step: ...


# Built-ins, imported when a recipe names them.
ENVIRONMENTS: dict[str, str] = {
    "relay_digits": "megatron_gspo.episodes.task_envs:RelayDigits",
    "recall_key": "megatron_gspo.episodes.task_envs:RecallKey",
    "tools": "megatron_gspo.episodes.tool_env:ToolCalling",
}


def resolve_environment(name: str) -> Callable[..., Environment]:
    return resolve(name, ENVIRONMENTS, key="rollout.multi_turn.env", what="environment")


def check_environment(name: str, kwargs: dict) -> None:
    """Refuse, at start-up, an environment that cannot be built from the recipe."""
    check_kwargs(resolve_environment(name), name, kwargs, key="rollout.multi_turn.env_kwargs")


def _checked_step(result: object) -> Step:
    """A step's result as a :class:`Step`, or an error naming what is wrong with it."""
    if not isinstance(result, Step):
        raise TypeError(f"step returned {type(result).__name__}, not an environment Step")
    if not isinstance(result.observation, str):
        raise TypeError(f"step's observation is {type(result.observation).__name__}, not str")
    if not isinstance(result.done, bool):
        raise TypeError(f"step's done is {result.done!r}, not a bool")
    info = {str(k): reward_value(v) for k, v in dict(result.info).items()}
    return Step(result.observation, reward_value(result.reward), result.done, result.state, info)


def _env_handler(name: str, kwargs: dict) -> Callable:
    """In a worker: the environment, and calls ``("reset", prompt, answer)`` or ``("step",
    state, action)`` on it."""
    env = resolve_environment(name)(**kwargs)

    def handle(method: str, *args):
        if method == "reset":
            return env.reset(*args)
        if method == "step":
            return _checked_step(env.step(*args))
        raise ValueError(f"unknown environment call {method!r}")

    return handle


class EnvironmentPool:
    """The recipe's environment in worker processes (global rank 0 only); each call's future
    answers an :class:`~megatron_gspo.runtime.workers.Outcome`."""

    def __init__(
        self, name: str, kwargs: dict, *, timeout_s: float, workers: int | None = None
    ) -> None:
        check_environment(name, kwargs)
        self.name = name
        self.pool = WorkerPool(
            _env_handler,
            (name, dict(kwargs)),
            workers=workers or max(1, min(8, os.cpu_count() or 1)),
            timeout_s=timeout_s,
            name="environment",
        )

    def reset(self, prompt: str, answer: str) -> Future:
        return self.pool.submit("reset", prompt, answer)

    def step(self, state: Any, action: str) -> Future:
        return self.pool.submit("step", state, action)

    def start(self) -> None:
        self.pool.start()

    def close(self) -> None:
        self.pool.close()
