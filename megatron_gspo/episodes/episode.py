"""An episode: a prompt continued by model turns and environment turns, as one token sequence.

```
prompt ids | model turn 1 (mask 1) | observation 1 (mask 0) | model turn 2 (mask 1) | ...
```

Every token after the prompt is either one the rollout engine sampled (mask 1: trained on, with
the engine's log-prob) or one the environment's turn was rendered into (mask 0: read by the
model, never trained on). The trainer scores exactly these ids: a model turn is never decoded
and encoded again to build the next turn's context. A single-turn rollout is the episode of one
model turn and no environment turn (:meth:`Episode.from_completion`): one code path.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

import numpy as np

from megatron_gspo.rollout.protocol import (
    Completion,
    RolloutResult,
    decode_routes,
    encode_routes,
)

__all__ = ["EndReason", "Episode", "single_turn"]

# Why an episode ended: the model stopped and no environment goes on ("stop"), the environment
# said done, the turn limit or the token budget was reached, the last model turn was cut at
# rollout.max_new_tokens ("length"), or the environment failed (raised or missed its deadline).
EndReason = Literal["stop", "done", "max_turns", "budget", "length", "env_error", "env_timeout"]


@dataclass
class Episode:
    # Every token after the prompt, model and environment turns in order.
    token_ids: list[int] = field(default_factory=list)
    # Per token: 1 where the model sampled it, 0 where an environment turn put it.
    mask: list[int] = field(default_factory=list)
    # Per token: the sampler's log-prob for model tokens (rollout.protocol.Completion), 0 for
    # environment tokens.
    logprobs: list[float] = field(default_factory=list)
    # Per token: the model turn it belongs to (0-based; an observation belongs to the turn
    # before it, which it answers).
    turn_ids: list[int] = field(default_factory=list)
    # Per model turn: the environment's reward for it (none without an environment).
    turn_rewards: list[float] = field(default_factory=list)
    # Per model turn: the weights version that sampled it, its oldest token's where weights
    # changed under it (None where the engine cannot tell).
    versions: list[int | None] = field(default_factory=list)
    # Per token: the weights version that sampled it (-1: an environment token, or unknown).
    token_versions: list[int] = field(default_factory=list)
    end: EndReason = "stop"
    # The environment's failure, where it failed (end is env_error or env_timeout).
    failure: str | None = None
    # The environment's counts over the episode (its steps' info, summed), e.g. tool calls.
    info: dict[str, float] = field(default_factory=dict)
    # MoE, where asked for: the experts of every token the model read, each as routed when it
    # was read, [prompt + tokens - 1, MoE layers, k] (megatron_gspo.model.routes).
    routes: np.ndarray | None = None
    # Whether the last model turn was cut at rollout.max_new_tokens (overlong shaping).
    last_turn_cut: bool = False

    def __post_init__(self) -> None:
        if self.token_ids and not self.token_versions:
            # Built (or saved) without versions per token: each token its turn's.
            turn = dict(enumerate(self.versions))
            self.token_versions = [
                -1 if not m or turn.get(k) is None else turn[k]
                for m, k in zip(self.mask, self.turn_ids, strict=True)
            ]

    @classmethod
    def from_completion(cls, c: Completion) -> Episode:
        """The one-turn episode of a single completion."""
        episode = cls()
        episode.add_model_turn(c)
        episode.end = "length" if c.finish_reason == "length" else "stop"
        return episode

    # -- building ------------------------------------------------------------------------------

    @property
    def num_turns(self) -> int:
        """Model turns."""
        return len(self.versions)

    def add_model_turn(self, c: Completion) -> None:
        """Append a model turn sampled with this episode (prompt and tokens so far) as its
        context; its routes, where returned, cover that whole context."""
        turn = self.num_turns
        start = len(self.token_ids)
        self.token_ids += c.token_ids
        self.mask += [1] * len(c.token_ids)
        self.logprobs += list(c.logprobs)
        self.turn_ids += [turn] * len(c.token_ids)
        self.versions.append(c.policy_version)
        self.token_versions += c.versions()
        self.last_turn_cut = c.finish_reason == "length"
        if c.routes is not None:
            # Keep each token's route from the forward that first read it: this turn's rows
            # start where the earlier turns' end (their last token was read only now).
            have = 0 if self.routes is None else len(self.routes)
            prompt = len(c.routes) - (start + len(c.token_ids) - 1)
            new = c.routes[have:]
            self.routes = new if self.routes is None else np.concatenate([self.routes, new])
            assert len(self.routes) == prompt + len(self.token_ids) - 1, "routes misaligned"

    def add_observation(self, ids: list[int]) -> None:
        """Append an environment turn (rendered ids) after the last model turn."""
        turn = max(self.num_turns - 1, 0)
        self.token_ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.turn_ids += [turn] * len(ids)
        self.token_versions += [-1] * len(ids)

    # -- reading -------------------------------------------------------------------------------

    @property
    def truncated(self) -> bool:
        """Whether the last model turn was cut at the token limit (overlong shaping)."""
        return self.last_turn_cut

    @property
    def model_tokens(self) -> int:
        return sum(self.mask)

    @property
    def spans_versions(self) -> bool:
        """Whether its model tokens come from more than one weights version."""
        return len({v for v, m in zip(self.token_versions, self.mask, strict=True) if m}) > 1

    def turn_tokens(self, turn: int) -> list[int]:
        """The ids the model sampled in ``turn``."""
        return [
            t
            for t, m, k in zip(self.token_ids, self.mask, self.turn_ids, strict=True)
            if m and k == turn
        ]

    # -- checkpoints (the asynchronous rollout queue) ------------------------------------------

    def to_json(self) -> dict:
        out = asdict(self)
        out["routes"] = None if self.routes is None else encode_routes(self.routes)
        return out

    @classmethod
    def from_json(cls, data: dict) -> Episode:
        routes = data.get("routes")
        return cls(**{**data, "routes": None if routes is None else decode_routes(routes)})


def single_turn(result: RolloutResult) -> list[list[Episode]]:
    """An engine's completions as one-turn episodes, grouped by prompt."""
    return [[Episode.from_completion(c) for c in g] for g in result.completions]
