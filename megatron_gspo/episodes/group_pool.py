"""Partial batches: more groups in flight than a step trains on, each step taking the first
to finish (``rollout.in_flight_updates.groups_in_flight: N``).

With whole batches (:class:`~megatron_gspo.episodes.pipeline.RolloutPipeline`) a step cannot
start before its batch's longest episode has ended, and at ``max_staleness: 1`` that straggler
has one step to finish whether or not the sync waits for it. Here the unit is a prompt's group:
``N`` groups are generated at once, a finished group's slot is refilled at once (from prompts
the main thread drew ahead), and :meth:`take` hands out the ``prompts_per_step`` finished
groups with the oldest tokens. A group that is still running when a step is taken goes on
across the sync and is taken by a later step, as long as its oldest token is at most
``max_staleness`` versions behind the policy; beyond that it is dropped, counted, never
trained on. So the engine never idles on a tail and a step waits only for enough groups.

The price is a length bias: short episodes finish first, so a step's groups are shorter than
the prompts' own distribution, and a group too long to finish within the bound is never
trained on. ``benchmarks/in_flight.py`` prints both; docs/async.md says what they were.

Which groups a step trains on depends on timing, so a run is not reproducible group for group.
A checkpoint holds the finished groups not yet trained (the ones in flight are finished first,
with the new weights) and the prompts drawn but not yet started: a resumed run trains on
exactly those, with the same tokens and versions.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import torch.distributed as dist

from megatron_gspo.data.prompts import Prompt
from megatron_gspo.episodes.episode import Episode
from megatron_gspo.episodes.pipeline import Batch, oldest_version
from megatron_gspo.rollout.protocol import EngineDownError
from megatron_gspo.runtime.errors import InputError
from megatron_gspo.runtime.rank0 import on_rank0

__all__ = ["GroupPool", "GroupRollout"]

log = logging.getLogger(__name__)

# Samples one group: (step the prompt was drawn for, its index in that step's prompts, the
# prompt) -> group_size episodes, and figures of how they were sampled.
GroupRollout = Callable[[int, int, Prompt], tuple[list[Episode], dict[str, float]]]


@dataclass
class _Group:
    step: int  # the step the prompt was drawn for, which seeds its sampling
    index: int
    prompt: Prompt
    episodes: list[Episode] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)
    # The pool's version when the group started (None: started before a resume from a
    # checkpoint): its tokens can be no older.
    started_on: int | None = None

    def oldest(self) -> int | None:
        return oldest_version([self.episodes])

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "index": self.index,
            "prompt": asdict(self.prompt),
            "episodes": [e.to_json() for e in self.episodes],
            "stats": self.stats,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> _Group:
        episodes = [Episode.from_json(e) for e in data.get("episodes", [])]
        prompt = Prompt(**data["prompt"])
        return cls(int(data["step"]), int(data["index"]), prompt, episodes, data.get("stats", {}))


class GroupPool:
    """Up to ``groups_in_flight`` groups generated at once by threads on rank 0; each step takes
    ``per_step`` finished ones. The same methods as the whole-batch pipeline."""

    dropped_metric = "rollout_groups_dropped"

    def __init__(
        self,
        rollout: GroupRollout | None,
        draw: Callable[[int], list[Prompt]],
        *,
        per_step: int,
        groups_in_flight: int,
        max_staleness: int,
        next_step: int,
        wait_timeout_s: float = 3600.0,
    ) -> None:
        if max_staleness < 1 or groups_in_flight < per_step:
            raise ValueError("GroupPool needs max_staleness >= 1, groups_in_flight >= per_step")
        self.rank0 = not dist.is_initialized() or dist.get_rank() == 0
        self.rollout, self.draw = rollout, draw
        self.per_step, self.capacity, self.bound = per_step, groups_in_flight, max_staleness
        self.next_draw = next_step  # the step whose prompts are drawn next
        self._next_take = next_step
        self.version = next_step - 1  # the engine's, as of the last resume()
        self.dropped = 0
        self.waited_s = 0.0
        # How long take() waits for a group it can train before it gives up, naming why.
        self.wait_timeout_s = wait_timeout_s
        self._pending: deque[_Group] = deque()  # drawn, not started
        self._finished: list[_Group] = []
        self._running = 0
        self._error: BaseException | None = None
        self._holding = True  # no group starts until resume()
        self._cond = threading.Condition()
        self._pool = (
            ThreadPoolExecutor(groups_in_flight, thread_name_prefix="group") if self.rank0 else None
        )

    # -- generation (any thread, under the lock) ---------------------------------------------

    def _start_locked(self) -> None:
        while not self._holding and self._pending and self._outstanding() < self._room():
            group = self._pending.popleft()
            group.started_on = self.version
            self._running += 1
            assert self._pool is not None
            self._pool.submit(self._generate, group)

    def _outstanding(self) -> int:
        return self._running + len(self._finished)

    def _room(self) -> int:
        """How many groups may be generated and not yet trained. A group started now (on
        ``version``) is trained by step ``version + 1 + bound`` at the latest, after the ones
        ahead of it: starting more than those steps can take would only make groups that age
        out unused. ``groups_in_flight`` caps it."""
        steps = self.version + 2 + self.bound - self._next_take
        return min(self.capacity, self.per_step * max(steps, 0))

    def _generate(self, group: _Group) -> None:
        try:
            assert self.rollout is not None
            group.episodes, group.stats = self.rollout(group.step, group.index, group.prompt)
        except BaseException as e:  # noqa: BLE001 - raised by take() on the main thread
            with self._cond:
                if isinstance(e, EngineDownError):
                    # Not sampled: a checkpoint keeps its prompt, to be sampled on resume.
                    self._pending.appendleft(_Group(group.step, group.index, group.prompt))
                self._error = self._error or e
                self._running -= 1
                self._cond.notify_all()
            return
        with self._cond:
            self._finished.append(group)
            self._running -= 1
            self._start_locked()  # a slot is refilled at once, while there is room
            self._cond.notify_all()

    # -- the schedule (main thread) ----------------------------------------------------------

    def _draw_ahead(self) -> None:
        """Enough prompts drawn that every slot can be refilled once without the main thread
        (only it touches the data stream, whose position the checkpoint saves)."""
        while self.rank0 and len(self._pending) < self.capacity:
            prompts = self.draw(self.next_draw)
            groups = [_Group(self.next_draw, i, p) for i, p in enumerate(prompts)]
            self.next_draw += 1
            with self._cond:
                self._pending.extend(groups)

    def resume(self, version: int | None = None) -> None:
        """Start groups with the weights the engine holds now."""
        if not self.rank0:
            return
        self._draw_ahead()
        with self._cond:
            if version is not None:
                self.version = version
            self._holding = False
            self._start_locked()

    def pause(self) -> None:
        """The sync goes on under the groups in flight: nothing to wait for."""

    def waited(self) -> float:
        """Seconds the main thread waited for generation since the last call."""
        waited, self.waited_s = self.waited_s, 0.0
        return waited

    def take(self, step: int, current_version: int) -> Batch:
        """``per_step`` finished groups, the stalest first, none staler than the bound, on
        every rank (collective). Fails, naming why, where none can come: nothing in flight,
        an engine whose versions do not advance, or no trainable group within
        ``wait_timeout_s``."""

        def next_batch() -> Batch:
            start = time.perf_counter()
            deadline = time.monotonic() + self.wait_timeout_s
            with self._cond:
                while True:
                    if self._error is not None:
                        raise self._error
                    self._drop_stale(current_version)
                    if len(self._finished) >= self.per_step:
                        break
                    # Dropped groups leave room: fill it (with nothing running the pool would
                    # otherwise wait for a group no one started).
                    self._draw_ahead()
                    self._start_locked()
                    if not self._running:
                        raise RuntimeError(
                            f"group pool: step {step} needs {self.per_step} finished groups, "
                            f"has {len(self._finished)}, and none is running "
                            f"({len(self._pending)} prompts pending"
                            + (", held: resume() was not called)" if self._holding else ")")
                        )
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(
                            f"group pool: no group step {step} can train on finished within "
                            f"{self.wait_timeout_s:g} s ({self._running} running, "
                            f"{len(self._finished)} finished, {self.dropped} dropped as staler "
                            f"than {self.bound} versions so far)"
                        )
                    self._cond.wait(left)
                self._finished.sort(key=lambda g: (_age_key(g), g.step, g.index))
                taken = self._finished[: self.per_step]
                del self._finished[: self.per_step]
                carried = len(self._finished)
                self._next_take = step + 1
            self.waited_s += time.perf_counter() - start
            self._draw_ahead()
            with self._cond:
                self._start_locked()
            stats = _merge([g.stats for g in taken])
            stats["rollout_groups_carried"] = float(carried)
            return Batch(step, [g.prompt for g in taken], [g.episodes for g in taken], stats)

        return on_rank0(next_batch)

    def _drop_stale(self, current_version: int) -> None:
        kept = []
        for g in self._finished:
            oldest = g.oldest()
            if oldest is not None and g.started_on is not None and oldest < g.started_on:
                # Started after the sync to started_on, yet labelled older: every group the
                # engine makes would age out the same way.
                raise RuntimeError(
                    f"group pool: a group started after the sync to version {g.started_on} "
                    f"came back labelled with version {oldest}: the engine's weights versions "
                    "do not advance with the syncs, so nothing it samples can be trained "
                    "within rollout.max_staleness"
                )
            if oldest is not None and current_version - oldest > self.bound:
                self.dropped += 1
                log.info("dropped a group %d versions old", current_version - oldest)
            else:
                kept.append(g)
        self._finished[:] = kept

    # -- checkpoints -------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The finished groups (those in flight are finished first) and the prompts drawn but
        not started, on rank 0 (collective: a failed group's error reaches every rank); no
        group starts again until :meth:`resume`."""

        def collect() -> dict[str, Any]:
            if not self.rank0:
                return {}
            with self._cond:
                self._holding = True
                while self._running and self._error is None:
                    self._cond.wait()
                if isinstance(self._error, EngineDownError):
                    while self._running:  # the others fail alike: their prompts come back
                        self._cond.wait()
                elif self._error is not None:
                    raise self._error
                pending = sorted(self._pending, key=lambda g: (g.step, g.index))
                return {
                    "groups": [g.to_json() for g in self._finished],
                    "pending": [g.to_json() for g in pending],
                    "next_step": self.next_draw,
                }

        return on_rank0(collect, share=False) or {}

    def restore(self, saved: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Queue saved groups again. Whole batches (a checkpoint of the batch pipeline) are
        read as their groups."""
        if not self.rank0 or not saved:
            return
        if isinstance(saved, list):
            for data in saved:
                batch = Batch.from_json(data)
                for i, (p, g) in enumerate(zip(batch.prompts, batch.episodes, strict=True)):
                    self._finished.append(_Group(batch.step, i, p, g, dict(batch.stats)))
            self.next_draw = int(saved[-1]["step"]) + 1
            return
        try:
            self._finished = [_Group.from_json(g) for g in saved["groups"]]
            self._pending = deque(_Group.from_json(g) for g in saved["pending"])
            self.next_draw = int(saved["next_step"])
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"checkpoint's rollout_queue: not a group pool's state ({e})") from e

    def close(self) -> None:
        if self._pool is None:
            return
        with self._cond:
            self._holding = True
            while self._running and self._error is None:
                self._cond.wait()
        self._pool.shutdown(wait=True, cancel_futures=True)


def _age_key(group: _Group) -> int:
    oldest = group.oldest()
    return oldest if oldest is not None else 1 << 62


def _merge(stats: list[dict[str, float]]) -> dict[str, float]:
    """One step's figures from its groups': maxima stay maxima, the rest are means."""
    keys = {k for s in stats for k in s}
    out = {}
    for k in keys:
        values = [s[k] for s in stats if k in s]
        out[k] = max(values) if k.endswith("_max") else sum(values) / len(values)
    return out
