"""Environments that misbehave as user code does, and test doubles, for the episode tests."""

from __future__ import annotations

import json
import time

from megatron_gspo.episodes.environment import Step
from megatron_gspo.episodes.task_envs import RelayDigits
from megatron_gspo.episodes.tool_env import ToolCalling


class FlakyRelay(RelayDigits):
    """relay_digits that raises when the model's turn holds ``raise_on`` and hangs when it
    holds ``hang_on`` (None: never)."""

    def __init__(self, raise_on: str | None = None, hang_on: str | None = None) -> None:
        super().__init__()
        self.raise_on, self.hang_on = raise_on, hang_on

    def step(self, state, action: str) -> Step:
        if self.raise_on is not None and self.raise_on in action:
            raise RuntimeError(f"the environment broke on {action!r}")
        if self.hang_on is not None and self.hang_on in action:
            time.sleep(3600)
        return super().step(state, action)


class Unpicklable(RelayDigits):
    """Returns a state that cannot leave its worker."""

    def reset(self, prompt: str, answer: str):
        return lambda: None


class BadStep(RelayDigits):
    def step(self, state, action: str):
        return {"observation": "1=", "reward": 1.0}


class CalculatorEveryTurn(ToolCalling):
    """The tool environment for a model that cannot write tool calls yet (a random one): each
    model turn becomes a real calculator call on the turn's length, ``"<n> * 7"``; the
    episode is done after ``calls`` calls."""

    def __init__(self, calls: int = 2) -> None:
        super().__init__(tools=["calculator"])
        self.calls = calls

    def reset(self, prompt: str, answer: str) -> int:
        return 0

    def step(self, state: int, action: str) -> Step:
        if state == self.calls:
            return Step(done=True)
        expression = json.dumps({"expression": f"{len(action)} * 7"})
        call = f'{{"name": "calculator", "arguments": {expression}}}'
        step = super().step(None, f"<tool_call>{call}</tool_call>")
        return Step(step.observation, 0.0, False, state + 1, step.info)
