"""Reward functions, chosen by name in the recipe, and the guard that runs them.

A reward function is ``fn(response: str, answer: str, **kwargs) -> float``. Registered names:
``exact_match``, ``digit_match`` (dense per-position credit), ``math`` (boxed or final-number
answer, checked with ``math-verify`` when installed), ``format`` (a regular expression). Any
other name of the form ``package.module:function`` is imported.

Rewards are user code: one that raises or runs past the timeout scores 0 for that sample and is
counted in the step's metrics; it never stops the run. Names that cannot be resolved fail at
start-up, before any compute is spent.
"""

from __future__ import annotations

import importlib
import logging
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
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


class RewardComputer:
    """Weighted sum of the recipe's reward functions, each guarded by a timeout."""

    def __init__(self, config: RewardConfig, max_workers: int = 8) -> None:
        self.functions = [
            (resolve_reward(f.name), f.weight, f.kwargs, f.name) for f in config.functions
        ]
        self.timeout = config.timeout_s
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="reward")

    def __call__(self, responses: list[str], answers: list[str]) -> tuple[list[float], RewardStats]:
        stats = RewardStats()
        futures = [
            [self._pool.submit(fn, r, a, **kw) for fn, _, kw, _ in self.functions]
            for r, a in zip(responses, answers, strict=True)
        ]
        rewards = []
        for row in futures:
            total = 0.0
            for future, (_, weight, _, name) in zip(row, self.functions, strict=True):
                try:
                    total += weight * float(future.result(timeout=self.timeout))
                except FutureTimeout:
                    # The thread cannot be stopped; it finishes in the background, ignored.
                    stats.timeouts += 1
                except Exception as e:  # noqa: BLE001 - user code; a failure scores 0
                    stats.errors += 1
                    log.warning("reward %s raised %s: %s", name, type(e).__name__, e)
            rewards.append(total)
        return rewards, stats

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
