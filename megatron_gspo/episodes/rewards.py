"""Reward functions, chosen by name in the recipe, and the guard that runs them.

A reward function is ``fn(response: str, answer: str, **kwargs) -> float``. Registered names:
``exact_match``, ``digit_match`` (dense per-position credit), ``math`` (boxed or final-number
answer, checked with ``math-verify`` when installed), ``format`` (a regular expression). Any
other name of the form ``package.module:function`` is imported.

Rewards are user code, so they run in worker processes with a deadline per call
(``reward.timeout_s``, :mod:`megatron_gspo.runtime.workers`): a hung call costs its sample and one
deadline of one worker, whose replacement starts at once. A function that raises, returns
anything but a finite real number (NaN, inf, a string, a bool, a value float32 cannot hold), or
misses its deadline fails that sample: counted in ``reward_errors`` or ``reward_timeouts``, and
``reward.on_error`` says what the update does with it (the loop's scoring,
:mod:`megatron_gspo.episodes.scoring`). Names that cannot be resolved, and keyword arguments a
function does not take, fail at start-up, before any compute is spent.
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from megatron_gspo.config import RewardConfig
from megatron_gspo.runtime.user_code import check_kwargs, resolve
from megatron_gspo.runtime.workers import WorkerPool

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
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_TEXT = re.compile(r"\\(?:text|mathrm|textbf)\{[^{}]*\}")


def extract_answer(text: str) -> str | None:
    """The boxed answer if there is one, else the last number in the text."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _normalize(text: str) -> str:
    """LaTeX an answer is written in, reduced to what the number parser reads."""
    text = _TEXT.sub("", text)  # units: \text{ cm}
    text = _FRAC.sub(r"(\1)/(\2)", text)
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "$", "^\\circ", "\\%", "%", " "):
        text = text.replace(token, "")
    return text


def _as_number(text: str) -> float | None:
    text = _normalize(text).replace(",", "")
    sign = -1.0 if text.startswith("-") else 1.0
    text = text.removeprefix("-")
    match = re.fullmatch(r"\(?([\d.]+)\)?(?:/\(?([\d.]+)\)?)?", text)
    if match is None:
        # A number followed by a unit word: "12cm", "5 dollars".
        match = re.match(r"(\d+(?:\.\d+)?)[a-zA-Z]+$", text)
        return sign * float(match.group(1)) if match else None
    try:
        num = float(match.group(1))
        return sign * (num / float(match.group(2)) if match.group(2) else num)
    except (ValueError, ZeroDivisionError):
        return None


def _math_verify():
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    return parse, verify


def math_answer(response: str, answer: str) -> float:
    """1 when the response's final answer equals the reference: symbolically with
    ``math-verify`` (the ``math`` extra) where installed, else by the built-in parser (a boxed
    answer or the last number; fractions, ``\\frac``, thousands separators, units)."""
    if "####" in answer:  # GSM8K's references: the worked solution, then "#### <answer>"
        answer = answer.rsplit("####", 1)[1].strip()
    mv = _math_verify()
    if mv is not None:
        parse, verify = mv
        gold = parse(answer if ("$" in answer or "\\boxed" in answer) else f"${answer}$")
        pred = parse(response)
        if gold and pred:
            return float(verify(gold, pred))
    got = extract_answer(response)
    if got is None:
        return 0.0
    # The reference is an answer, not a text to search: its last number is not its value.
    a, b = _as_number(got), _as_number(_last_boxed(answer) or answer)
    if a is not None and b is not None:
        return float(abs(a - b) <= 1e-6 * max(1.0, abs(b)))
    return float(_normalize(got) == _normalize(answer))


def overlong_penalty(length: int, max_new_tokens: int, cache_tokens: int, max_penalty: float):
    """DAPO's soft overlong punishment of a response of ``length`` tokens: 0 up to
    ``max_new_tokens - cache_tokens``, then linear down to ``-max_penalty`` at the limit."""
    start = max_new_tokens - cache_tokens
    if length <= start:
        return 0.0
    return -max_penalty * min(length - start, cache_tokens) / cache_tokens


def format_match(response: str, answer: str, pattern: str = r"\\boxed\{.+\}") -> float:
    return float(re.search(pattern, response, flags=re.DOTALL) is not None)


REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "digit_match": digit_match,
    "math": math_answer,
    "format": format_match,
}


def resolve_reward(name: str) -> RewardFn:
    return resolve(name, REWARDS, key="reward.functions", what="reward")


def check_reward_function(
    name: str, kwargs: dict, where: str = "reward.functions"
) -> RewardFn | None:
    """The function ``name`` resolves to, once it is known to accept ``kwargs``; for a served
    reward (:mod:`.served`) None, once its kwargs are valid and its servers answer."""
    from megatron_gspo.episodes.served import SERVED, check_served

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


# float32 is what advantages are computed in; a larger reward would overflow there.
_FLOAT32_MAX = 3.4028234663852886e38


def reward_value(value: object) -> float:
    """A reward function's result as a float; ValueError for anything but a finite real number
    (a string or a bool is not a score, however it converts)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"returned {value!r} ({type(value).__name__}), not a number")
    value = float(value)
    if not math.isfinite(value) or abs(value) > _FLOAT32_MAX:
        raise ValueError(f"returned {value}, not a finite float32 number")
    return value


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
        from megatron_gspo.episodes.served import SERVED, ServedReward

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
        from megatron_gspo.episodes.served import Item

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
            if not failed and not abs(total) <= _FLOAT32_MAX:  # the weighted sum overflowed
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
