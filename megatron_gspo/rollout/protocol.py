"""What a rollout engine is asked for and what it returns, whichever engine it is."""

from __future__ import annotations

import base64
from dataclasses import asdict, dataclass, field
from typing import Literal, Protocol

import numpy as np

FinishReason = Literal["stop", "length"]


class EngineDownError(RuntimeError):
    """The engine cannot sample now, but may once restarted (too few vLLM servers serve): the
    loop checkpoints what it has and exits 75, for Slurm to requeue the run."""


@dataclass(frozen=True)
class SamplingParams:
    group_size: int
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    # No stop id ends a response before this many tokens (vLLM's min_tokens); log-probs stay
    # the policy's own.
    min_new_tokens: int = 0
    seed: int = 0
    # Return each token's experts with the completions (MoE; Completion.routes).
    return_routes: bool = False


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
    # MoE, where asked for (rollout.return_routes): the experts each token the model read was
    # routed to, [prompt + response - 1 tokens, MoE layers, k] (megatron_gspo.model.routes).
    routes: np.ndarray | None = None
    # Per token, where weights changed while it was generated (rollout.in_flight_updates):
    # the version that sampled it (-1: the checkpoint the server started with); None: every
    # token is policy_version's. policy_version is then the oldest.
    token_versions: list[int] | None = None

    def to_json(self) -> dict:
        out = asdict(self)
        out["routes"] = None if self.routes is None else encode_routes(self.routes)
        return out

    @classmethod
    def from_json(cls, data: dict) -> Completion:
        routes = data.get("routes")
        return cls(**{**data, "routes": None if routes is None else decode_routes(routes)})

    def versions(self) -> list[int]:
        """The version of each token (-1: unknown)."""
        if self.token_versions is not None:
            return list(self.token_versions)
        return [-1 if self.policy_version is None else self.policy_version] * len(self.token_ids)

    def stamp(self, version: int | str | None) -> None:
        """Record the version of the server that generated it, as it reported it before the
        request; tokens the server labelled one by one (token_versions) say it themselves."""
        if self.token_versions is None:
            self.policy_version = version if isinstance(version, int) else None
            return
        known = [v for v in self.token_versions if v >= 0]
        self.policy_version = min(known) if known else None


def encode_routes(routes: np.ndarray) -> dict:
    """Routes as JSON (checkpointed rollout queues)."""
    r = np.ascontiguousarray(routes)
    return {
        "shape": list(r.shape),
        "dtype": str(r.dtype),
        "data": base64.b64encode(r.tobytes()).decode(),
    }


def decode_routes(data: dict) -> np.ndarray:
    raw = base64.b64decode(data["data"])
    return np.frombuffer(raw, dtype=data["dtype"]).reshape(data["shape"]).copy()


def longest_completion(group: list[Completion]) -> int:
    """The tokens of a group's longest completion: what its request had decoded when it
    ended (its samples are decoded side by side)."""
    return max((len(c.token_ids) for c in group), default=0)


@dataclass
class RolloutResult:
    # completions[p] holds the group_size responses to prompts[p].
    completions: list[list[Completion]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for group in self.completions for c in group)


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do beyond the protocol's collective calls; the loop picks how to
    sample by these, never by an engine's type."""

    # generate_rank0 and score_rank0: global rank 0 alone drives the engine, with no
    # collective, so the rollout pipeline can run it in a thread beside the trainer's own
    # collectives (rollout.max_staleness >= 1).
    rank0_generation: bool = False
    # Every episode can request its turns on its own, from rank 0: the engine has ``client``
    # (an asynchronous completions client: session(), complete(), and fleet, which routes
    # each turn to a server) and check_versions(); multi-turn episodes then advance
    # concurrently (episodes.concurrent).
    concurrent_episodes: bool = False


class RolloutEngine(Protocol):
    capabilities: Capabilities

    def generate(self, request: RolloutRequest) -> RolloutResult:
        """Sample ``group_size`` responses to every prompt. Collective over all ranks."""
        ...

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Teacher-forced log-probs of every token after the first of each sequence, under the
        weights the engine holds (what it would give those tokens when sampling them).
        Collective."""
        ...

    def sync_weights(self, version: int) -> None:
        """Make the engine sample from the trainer's current weights, which are ``version``
        (the number of updates applied). Collective."""
        ...

    def step_metrics(self) -> dict[str, float]:
        """Figures of the engine's own for the step just synced (the same on every rank); {}
        where it has none."""
        ...

    def close(self) -> None: ...
