"""What a rollout engine is asked for and what it returns, whichever engine it is."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    group_size: int
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0


@dataclass(frozen=True)
class RolloutRequest:
    prompts: list[list[int]]  # token ids, one list per prompt
    params: SamplingParams


@dataclass
class Completion:
    token_ids: list[int]
    # Log-prob of each generated token under the sampling model at temperature 1, before
    # top-p: the policy's own probability, which the trainer's log-probs are compared with.
    logprobs: list[float]
    finish_reason: FinishReason
    # The weights version that generated it (the trainer's step count when it was synced);
    # None when the engine cannot tell (a server still on the checkpoint it started with).
    policy_version: int | None = None


@dataclass
class RolloutResult:
    # completions[p] holds the group_size responses to prompts[p].
    completions: list[list[Completion]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for group in self.completions for c in group)


class RolloutEngine(Protocol):
    def generate(self, request: RolloutRequest) -> RolloutResult:
        """Sample ``group_size`` responses to every prompt. Collective over all ranks."""
        ...

    def sync_weights(self, version: int) -> None:
        """Make the engine sample from the trainer's current weights, which are ``version``
        (the number of updates applied). Collective."""
        ...

    def close(self) -> None: ...
