"""Environments that misbehave as user code does, for the episode tests."""

from __future__ import annotations

import time

from megatron_gspo.episodes.environment import Step
from megatron_gspo.episodes.relay import RelayDigits


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
