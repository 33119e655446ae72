"""Reward functions, chosen by name in the recipe.

A reward function is ``fn(response: str, answer: str, **kwargs) -> float`` (and ``prompt``
where it takes one). Registered names: ``exact_match``, ``digit_match`` (dense per-position
credit), ``math`` (boxed or final-number answer, checked with ``math-verify`` when installed),
``format`` (a regular expression). Any other name of the form ``package.module:function`` is
imported. They run in worker processes, guarded by :mod:`.computer`.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from megatron_gspo.runtime.user_code import resolve

__all__ = [
    "REWARDS",
    "RewardFn",
    "digit_match",
    "exact_match",
    "extract_answer",
    "format_match",
    "math_answer",
    "overlong_penalty",
    "resolve_reward",
]

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
