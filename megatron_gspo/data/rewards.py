"""Reward functions, chosen by name in the recipe, and the guard that runs them.

A reward function is ``fn(response: str, answer: str, **kwargs) -> float``. Registered names:
``exact_match``, ``digit_match`` (dense per-position credit), ``math`` (boxed or final-number
answer, checked with ``math-verify`` when installed), ``format`` (a regular expression). Any
other name of the form ``package.module:function`` is imported.

Rewards are user code, so they run in worker processes, and a batch has one deadline
(``reward.timeout_s`` for all of its samples together). The rule: a function that raises,
returns something that is not a finite number (NaN, inf, a string), or has not answered by the
deadline contributes 0 to that sample's reward; the first two count in ``reward_errors``, the
last in ``reward_timeouts``; the run goes on. Workers still busy at the deadline are killed
(a hung reward cannot hold the run, its threads or its exit) and fresh ones serve the next
batch. Names that cannot be resolved fail at start-up, before any compute is spent.
"""

from __future__ import annotations

import importlib
import logging
import math
import multiprocessing
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from megatron_gspo.config import RewardConfig

log = logging.getLogger(__name__)

RewardFn = Callable[..., float]


def exact_match(response: str, answer: str) -> float:
    return float(response.strip() == answer.strip())


def digit_match(response: str, answer: str) -> float:
    """Fraction of positions that match, over the longer of the two strings."""
    response, answer = response.strip(), answer.strip()
    width = max(len(response), len(answer))
    if width == 0:
        return 1.0
    return sum(a == b for a, b in zip(response, answer, strict=False)) / width


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def extract_answer(text: str) -> str | None:
    """The boxed answer if there is one, else the last number in the text."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _as_number(text: str) -> float | None:
    text = text.replace(",", "").replace("$", "").strip()
    try:
        if "/" in text:
            num, den = text.split("/", 1)
            return float(num) / float(den)
        return float(text)
    except (ValueError, ZeroDivisionError):
        return None


def math_answer(response: str, answer: str) -> float:
    """1 when the response's final answer equals the reference, symbolically if possible."""
    got = extract_answer(response)
    if got is None:
        return 0.0
    try:
        from math_verify import parse, verify
    except ImportError:
        parse = verify = None
    if verify is not None:
        gold = parse(f"${answer}$")
        pred = parse(f"${got}$")
        if gold and pred:
            return float(verify(gold, pred))
    a, b = _as_number(got), _as_number(extract_answer(answer) or answer)
    if a is not None and b is not None:
        return float(abs(a - b) <= 1e-6 * max(1.0, abs(b)))
    return float(got.replace(" ", "") == answer.replace(" ", ""))


def format_match(response: str, answer: str, pattern: str = r"\\boxed\{.+\}") -> float:
    return float(re.search(pattern, response, flags=re.DOTALL) is not None)


REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "digit_match": digit_match,
    "math": math_answer,
    "format": format_match,
}


def resolve_reward(name: str) -> RewardFn:
    if name in REWARDS:
        return REWARDS[name]
    if ":" not in name:
        raise ValueError(
            f"reward.functions: unknown reward {name!r}; use one of {sorted(REWARDS)} "
            "or 'package.module:function'"
        )
    module, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward.functions: cannot import {name!r}: {e}") from None
    if not callable(fn):
        raise ValueError(f"reward.functions: {name!r} is not callable")
    return fn


@dataclass
class RewardStats:
    errors: int = 0
    timeouts: int = 0


# The reward functions of this worker process (set by _init_worker).
_WORKER_FUNCTIONS: list[tuple[RewardFn, dict]] = []


def _init_worker(specs: list[tuple[str, dict]], parent_pid: int) -> None:
    from megatron_gspo.procs import die_with_parent

    die_with_parent(parent_pid)
    _WORKER_FUNCTIONS[:] = [(resolve_reward(name), kwargs) for name, kwargs in specs]


def _score(index: int, response: str, answer: str) -> tuple[str, float | str]:
    """One function on one sample, in a worker: ("ok", value) or ("error", message)."""
    fn, kwargs = _WORKER_FUNCTIONS[index]
    try:
        value = fn(response, answer, **kwargs)
    except Exception as e:  # noqa: BLE001 - user code; a failure scores 0
        return "error", f"raised {type(e).__name__}: {e}"
    try:
        value = float(value)
    except (TypeError, ValueError):
        return "error", f"returned {value!r}, not a number"
    if not math.isfinite(value):
        return "error", f"returned {value}, not a finite number"
    return "ok", value


class RewardComputer:
    """Weighted sum of the recipe's reward functions, computed in worker processes."""

    def __init__(self, config: RewardConfig, max_workers: int | None = None) -> None:
        for f in config.functions:
            resolve_reward(f.name)  # fail here, at start-up, on a name that cannot be used
        self.specs = [(f.name, dict(f.kwargs)) for f in config.functions]
        self.weights = [f.weight for f in config.functions]
        self.timeout = config.timeout_s
        self.workers = max_workers or max(1, min(8, os.cpu_count() or 1))
        self._pool = None

    def _ensure_pool(self):
        if self._pool is None:
            ctx = multiprocessing.get_context("spawn")
            self._pool = ctx.Pool(
                self.workers, initializer=_init_worker, initargs=(self.specs, os.getpid())
            )
        return self._pool

    def __call__(self, responses: list[str], answers: list[str]) -> tuple[list[float], RewardStats]:
        stats = RewardStats()
        pool = self._ensure_pool()
        pending = [
            [pool.apply_async(_score, (i, r, a)) for i in range(len(self.specs))]
            for r, a in zip(responses, answers, strict=True)
        ]
        deadline = time.monotonic() + self.timeout
        rewards, hung = [], False
        for row in pending:
            total = 0.0
            for i, result in enumerate(row):
                try:
                    status, value = result.get(timeout=max(0.0, deadline - time.monotonic()))
                except multiprocessing.TimeoutError:
                    stats.timeouts += 1
                    hung = True
                    continue
                if status == "ok":
                    total += self.weights[i] * value
                else:
                    stats.errors += 1
                    log.warning("reward %s %s", self.specs[i][0], value)
            rewards.append(total)
        if hung:
            log.warning(
                "%d reward call(s) missed the %.0f s deadline; restarting the reward workers",
                stats.timeouts,
                self.timeout,
            )
            self.close()
        return rewards, stats

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None
