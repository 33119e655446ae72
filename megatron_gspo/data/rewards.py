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
import queue
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from megatron_gspo.config import RewardConfig
from megatron_gspo.procs import kill_at_exit

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


def _score(fn: RewardFn, kwargs: dict, response: str, answer: str) -> tuple[str, float | str]:
    """One function on one sample: ("ok", value) or ("error", message)."""
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


def _worker(specs: list[tuple[str, dict]], parent_pid: int, tasks, results) -> None:
    """Score (task id, function index, response, answer) tasks until the parent kills us."""
    from megatron_gspo.procs import die_with_parent

    die_with_parent(parent_pid)
    functions = [(resolve_reward(name), kwargs) for name, kwargs in specs]
    results.put((None, ("ready", os.getpid())))
    while True:
        task_id, index, response, answer = tasks.get()
        fn, kwargs = functions[index]
        results.put((task_id, _score(fn, kwargs, response, answer)))


_START_TIMEOUT_S = 120.0


class RewardComputer:
    """Weighted sum of the recipe's reward functions, computed in worker processes."""

    def __init__(self, config: RewardConfig, max_workers: int | None = None) -> None:
        for f in config.functions:
            resolve_reward(f.name)  # fail here, at start-up, on a name that cannot be used
        self.specs = [(f.name, dict(f.kwargs)) for f in config.functions]
        self.weights = [f.weight for f in config.functions]
        self.timeout = config.timeout_s
        self.workers = max_workers or max(1, min(8, os.cpu_count() or 1))
        self._procs: list = []
        self._tasks = self._results = None

    def _ensure_workers(self) -> None:
        # Processes of our own rather than multiprocessing.Pool: the workers ignore SIGTERM (Slurm
        # sends it to every process of the job, and it is meant for the trainer, which still
        # needs its rewards to finish the step and save), so ending them takes SIGKILL, which
        # Pool.terminate does not send; and a Pool respawns workers while they are being killed.
        if self._procs:
            return
        ctx = multiprocessing.get_context("spawn")
        self._tasks, self._results = ctx.Queue(), ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(self.specs, os.getpid(), self._tasks, self._results),
                daemon=True,
            )
            for _ in range(self.workers)
        ]
        for p in self._procs:
            p.start()
            kill_at_exit(p)
        # Until a worker has set up its signals a SIGTERM would end it: wait for all of them.
        ready, deadline = 0, time.monotonic() + _START_TIMEOUT_S
        while ready < len(self._procs) and time.monotonic() < deadline:
            try:
                self._results.get(timeout=0.5)
                ready += 1
            except queue.Empty:
                if not any(p.is_alive() for p in self._procs):
                    break
        if ready == 0:
            codes = [p.exitcode for p in self._procs]
            self.close()
            raise RuntimeError(f"reward workers did not start (exit codes {codes})")

    def __call__(self, responses: list[str], answers: list[str]) -> tuple[list[float], RewardStats]:
        pairs = list(zip(responses, answers, strict=True))
        n = len(self.specs)
        self._ensure_workers()
        for s, (r, a) in enumerate(pairs):
            for i in range(n):
                self._tasks.put((s * n + i, i, r, a))
        deadline = time.monotonic() + self.timeout
        done: dict[int, tuple[str, float | str]] = {}
        while len(done) < len(pairs) * n and time.monotonic() < deadline:
            try:
                task_id, outcome = self._results.get(timeout=min(0.5, deadline - time.monotonic()))
            except queue.Empty:
                # A reward that kills its process (os._exit, a crash in native code) takes its
                # task with it; once no worker is left, nothing more can come.
                if not any(p.is_alive() for p in self._procs):
                    break
                continue
            done[task_id] = outcome
        # What did not answer: past the deadline a timeout, before it a worker that died.
        missing = ("timeout", None) if time.monotonic() >= deadline else ("error", "worker died")
        stats, rewards = RewardStats(), []
        for s in range(len(pairs)):
            total = 0.0
            for i in range(n):
                status, value = done.get(s * n + i, missing)
                if status == "ok":
                    total += self.weights[i] * value
                elif status == "error":
                    stats.errors += 1
                    log.warning("reward %s %s", self.specs[i][0], value)
                else:
                    stats.timeouts += 1
            rewards.append(total)
        if len(done) < len(pairs) * n:
            log.warning(
                "%d reward call(s) unanswered (%d past the %.0f s deadline); restarting the "
                "reward workers",
                len(pairs) * n - len(done),
                stats.timeouts,
                self.timeout,
            )
            self.close()  # the unfinished tasks go with the workers and their queues
        return rewards, stats

    def close(self) -> None:
        for p in self._procs:
            p.kill()
        for p in self._procs:
            p.join()
        for q in (self._tasks, self._results):
            if q is not None:
                q.cancel_join_thread()
                q.close()
        self._procs, self._tasks, self._results = [], None, None
