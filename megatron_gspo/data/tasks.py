"""Synthetic verifiable tasks that a tiny model can learn from scratch on a CPU.

Each task draws (prompt, answer) pairs from a seeded generator and comes with its character
tokenizer. Prompts read ``<digits>=`` and the answer is a string of digits; the dense reward
``digit_match`` gives partial credit per correct position.

``relay_digits`` is the multi-turn one (environment ``relay_digits``,
:mod:`megatron_gspo.episodes.environment`): its answer holds ``turns`` digit strings,
``"12|4|907"``; the prompt shows the first, and each later one is revealed by the environment's
turn after the model copied the one before. ``recall_key`` (environment ``recall_key``,
:mod:`megatron_gspo.episodes.task_envs`) always has 3 turns: its answer ``"7|42|905"`` holds a cue
and two keys' values, its prompt the cue (``"7="``).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from megatron_gspo.data.tokenizer import CharTokenizer
from megatron_gspo.runtime.errors import InputError
from megatron_gspo.runtime.seeds import example_seed

ALPHABET = "0123456789="


def _digits(rng: random.Random, min_len: int, max_len: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(rng.randint(min_len, max_len)))


TASKS: dict[str, Callable[[str], str]] = {
    "copy_digits": lambda s: s,
    "reverse_digits": lambda s: s[::-1],
    "sort_digits": lambda s: "".join(sorted(s)),
}


MULTI_TURN_TASKS = ("relay_digits", "recall_key")
# Multi-turn tasks whose number of turns is the task's, not an option.
FIXED_TURNS = {"recall_key": 3}


class SyntheticTask:
    def __init__(
        self, name: str, *, min_len: int = 2, max_len: int = 4, turns: int | None = None
    ) -> None:
        if name not in TASKS and name not in MULTI_TURN_TASKS:
            known = sorted([*TASKS, *MULTI_TURN_TASKS])
            raise InputError(f"data.task: unknown task {name!r}; known: {known}")
        if not 1 <= min_len <= max_len:
            raise InputError(
                f"data.task_options: need 1 <= min_len <= max_len, got {min_len}, {max_len}"
            )
        if name in FIXED_TURNS:
            if turns not in (None, FIXED_TURNS[name]):
                raise InputError(
                    f"data.task_options: {name} always has {FIXED_TURNS[name]} turns, got {turns}"
                )
            turns = FIXED_TURNS[name]
        if (turns is not None) != (name in MULTI_TURN_TASKS) or (turns is not None and turns < 1):
            raise InputError(
                f"data.task_options: turns (>= 1) is for {list(MULTI_TURN_TASKS)} only"
            )
        self.name, self.min_len, self.max_len, self.turns = name, min_len, max_len, turns
        self.tokenizer = CharTokenizer(ALPHABET)

    def example(self, index: int, seed: int) -> dict[str, str]:
        """The ``index``-th example of the stream for ``seed``: a pure function of both."""
        rng = random.Random(example_seed(self.name, seed, index))
        if self.name == "recall_key":
            cue = str(rng.randint(0, 9))
            values = [_digits(rng, self.min_len, self.max_len) for _ in range(2)]
            return {"prompt": f"{cue}=", "answer": "|".join([cue, *values])}
        if self.turns is not None:
            parts = [_digits(rng, self.min_len, self.max_len) for _ in range(self.turns)]
            return {"prompt": f"{parts[0]}=", "answer": "|".join(parts)}
        digits = _digits(rng, self.min_len, self.max_len)
        return {"prompt": f"{digits}=", "answer": TASKS[self.name](digits)}
