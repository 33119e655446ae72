"""The guard that runs the recipe's reward functions and sums them.

Rewards are user code, so Python functions (:mod:`.functions`, or the user's) run in worker
processes with a deadline per call (``reward.timeout_s``, :mod:`megatron_gspo.runtime.workers`):
a hung call costs its sample and one deadline of one worker, whose replacement starts at once.
Served judges and reward models (:mod:`.served`) are asked over HTTP, a step's requests in
flight together. A function that raises, returns anything but a finite real number (NaN, inf,
a string, a bool, a value float32 cannot hold), or misses its deadline fails that sample:
counted in ``reward_errors`` or ``reward_timeouts``, and ``reward.on_error`` says what the
update does with it (the loop's scoring, :mod:`megatron_gspo.episodes.scoring`). Names that
cannot be resolved, and keyword arguments a function does not take, fail at start-up, before
any compute is spent.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from megatron_gspo.config import RewardConfig
from megatron_gspo.rewards.functions import REWARDS, RewardFn, resolve_reward
from megatron_gspo.rewards.served import SERVED, Item, ServedReward, check_served
from megatron_gspo.rewards.value import FLOAT32_MAX, reward_value
from megatron_gspo.runtime.user_code import check_kwargs, resolve
from megatron_gspo.runtime.workers import WorkerPool

__all__ = ["RewardComputer", "RewardStats", "check_reward_function"]

log = logging.getLogger(__name__)


def check_reward_function(
    name: str, kwargs: dict, where: str = "reward.functions"
) -> RewardFn | None:
    """The function ``name`` resolves to, once it is known to accept ``kwargs``; for a served
    reward (:mod:`.served`) None, once its kwargs are valid and its servers answer."""
    if name in SERVED:
        check_served(name, kwargs, where)
        return None
    fn = resolve(name, REWARDS, key=where, what="reward")
    check_kwargs(fn, name, kwargs, key=where, args=("response", "answer", *_prompt(fn)))
    return fn


def _prompt(fn: RewardFn) -> tuple[str, ...]:
    """``("prompt",)`` where ``fn`` takes the prompt's text (a judge needs the question)."""
    try:
        return ("prompt",) if "prompt" in inspect.signature(fn).parameters else ()
    except (TypeError, ValueError):  # no signature to read (a builtin)
        return ()


@dataclass
class RewardStats:
    errors: int = 0
    timeouts: int = 0
    # Per sample: whether any of its reward functions failed (raised, returned no finite
    # number, or missed its deadline); its score is then not a real one.
    failed: list[bool] = field(default_factory=list)
    # The first failure, for an error message: which function, on which sample, and why.
    first_failure: str | None = None
    # Served rewards: the most requests that were in flight at once.
    served_in_flight_max: int = 0


def _reward_handler(specs: list[tuple[str, dict]]) -> Callable:
    """In a worker: ``(function index, response, answer, prompt) -> float``."""
    functions = [
        (fn, kwargs, bool(_prompt(fn)))
        for fn, kwargs in ((resolve_reward(name), kwargs) for name, kwargs in specs)
    ]

    def score(index: int, response: str, answer: str, prompt: str) -> float:
        fn, kwargs, wants_prompt = functions[index]
        extra = {"prompt": prompt} if wants_prompt else {}
        return reward_value(fn(response, answer, **kwargs, **extra))

    return score


class RewardComputer:
    """Weighted sum of the recipe's reward functions: Python functions in worker processes
    with a deadline per call (:mod:`megatron_gspo.runtime.workers`), served models over HTTP,
    all of a step's requests in flight together (:mod:`.served`)."""

    def __init__(self, config: RewardConfig, max_workers: int | None = None) -> None:
        for i, f in enumerate(config.functions):
            # Fail here, at start-up, on a name or kwargs that cannot be used.
            check_reward_function(f.name, dict(f.kwargs), where=f"reward.functions[{i}]")
        self.specs = [(f.name, dict(f.kwargs)) for f in config.functions]
        self.weights = [f.weight for f in config.functions]
        self.timeout = config.timeout_s
        self.served = {
            i: ServedReward(
                name, kwargs, timeout_s=config.timeout_s, where=f"reward.functions[{i}]"
            )
            for i, (name, kwargs) in enumerate(self.specs)
            if name in SERVED
        }
        local = [(i, spec) for i, spec in enumerate(self.specs) if i not in self.served]
        self.local_index = [i for i, _ in local]
        self.workers = max_workers or max(1, min(8, os.cpu_count() or 1))
        self.pool = WorkerPool(
            _reward_handler,
            ([spec for _, spec in local],),
            workers=self.workers if local else 1,
            timeout_s=self.timeout,
            name="reward",
        )

    def __call__(
        self, responses: list[str], answers: list[str], prompts: list[str] | None = None
    ) -> tuple[list[float], RewardStats]:
        """The rewards of the responses (0 where a function failed) and what failed."""
        prompts = prompts if prompts is not None else [""] * len(responses)
        triples = list(zip(responses, answers, prompts, strict=True))
        n, m = len(self.specs), len(self.local_index)
        # Served requests go out first, from this thread, while the workers score the rest.
        pending = [self.pool.submit(k, r, a, p) for r, a, p in triples for k in range(m)]
        items = [Item(p, r, a) for r, a, p in triples]
        served = {i: s.score(items) for i, s in self.served.items()}
        local = [f.result() for f in pending]
        stats, rewards = RewardStats(), []
        for s in range(len(triples)):
            total, failed = 0.0, False
            for i in range(n):
                if i in served:
                    outcome = served[i][s]
                else:
                    outcome = local[s * m + self.local_index.index(i)]
                if outcome.ok:
                    total += self.weights[i] * outcome.value
                    continue
                failed = True
                if outcome.status == "timeout":
                    stats.timeouts += 1
                else:
                    stats.errors += 1
                if stats.first_failure is None:
                    stats.first_failure = f"reward {self.specs[i][0]} on sample {s}: " + (
                        outcome.message
                    )
                    log.warning("%s", stats.first_failure)
            if not failed and not abs(total) <= FLOAT32_MAX:  # the weighted sum overflowed
                failed, stats.errors = True, stats.errors + 1
                stats.first_failure = stats.first_failure or (
                    f"rewards on sample {s}: the weighted sum {total} is not a finite number"
                )
            stats.failed.append(failed)
            rewards.append(total if not failed else 0.0)
        stats.served_in_flight_max = max((s.in_flight_max for s in self.served.values()), default=0)
        return rewards, stats

    def start(self) -> None:
        """Start the workers now (at start-up) rather than at the first batch."""
        self.pool.start()

    def close(self) -> None:
        self.pool.close()
