"""Every sampling seed the project derives, in one place, so that a run's random streams can be
read off one page and none collides with another by accident.

A step's rollout batch samples with :func:`step_seed`; model turn ``t`` of a multi-turn batch
with :func:`turn_seed` (lock-step, one request per turn) or, for episode ``k`` advancing on its
own, :func:`episode_turn_seed`; a vLLM request for prompt ``i`` of a batch takes
:func:`request_seed` and vLLM gives its ``j``-th sample ``request_seed + j``. Evaluation draws
from streams of its own (:func:`eval_seed`), so training steps are the same with and without it.
The data's streams are string-seeded ``random.Random`` generators (:func:`shuffle_seed`,
:func:`example_seed`): pure functions of the recipe's seed and the position.
"""

from __future__ import annotations

__all__ = [
    "EVAL_SEED_OFFSET",
    "episode_turn_seed",
    "eval_data_seed",
    "eval_seed",
    "example_seed",
    "request_seed",
    "shuffle_seed",
    "step_seed",
    "turn_seed",
]

# Evaluation's streams start here, far from any step's.
EVAL_SEED_OFFSET = 7_919_000_001


def step_seed(base: int, step: int, salt: int = 0) -> int:
    """The seed of step ``step``'s rollout batch (``rollout.seed`` is ``base``); ``salt`` > 0
    for further batches within the step (dynamic sampling's rounds)."""
    seed = base * 1_000_003 + step
    return seed * 1_009 + salt if salt else seed


def turn_seed(seed: int, turn: int) -> int:
    """The seed of model turn ``turn`` (0-based) of a batch whose seed is ``seed``; turn 0 is
    the batch's own."""
    return seed if turn == 0 else (seed * 1_000_033 + turn * 7_919) % 2**62


def episode_turn_seed(seed: int, turn: int, episode: int) -> int:
    """Turn ``turn`` of episode ``episode`` (its index in the batch, group by group) when each
    episode advances on its own: one request, one sample."""
    return turn_seed(seed, turn) + episode


def request_seed(seed: int, prompt_index: int, group_size: int) -> int:
    """A request for prompt ``prompt_index`` of a batch: vLLM gives its ``j``-th sample the seed
    ``request_seed + j``, so every sample of the batch has its own stream."""
    return seed + prompt_index * group_size


def resubmit_seed(seed: int, sample: int, part: int) -> int:
    """The ``part``-th resubmission (1-based) of sample ``sample`` of a request whose seed is
    ``seed``, after an in-flight weight update aborted it (rollout.in_flight_updates)."""
    return (seed * 1_000_037 + sample * 104_729 + part) % 2**62


def eval_data_seed(base: int) -> int:
    """The stream of evaluation prompts drawn from a synthetic task."""
    return base + EVAL_SEED_OFFSET


def eval_seed(base: int, step: int, salt: int) -> int:
    """Evaluation at ``step``; ``salt`` tells its greedy pass from its sampled one."""
    return (base + EVAL_SEED_OFFSET) * 31 + step * 2 + salt


def shuffle_seed(seed: int, epoch: int) -> str:
    """The order of a data file's records in ``epoch``."""
    return f"{seed}:{epoch}"


def example_seed(task: str, seed: int, index: int) -> str:
    """The ``index``-th example of a synthetic task's stream."""
    return f"{task}:{seed}:{index}"
