"""Trainer side: a server's pace, the seconds it takes per generated token, and the load it
carried meanwhile, from the requests it finished (:mod:`.fleet` predicts from them what a
request more would take on it).

Seconds and tokens are averaged apart (exponentially, about the last ten requests), and their
ratio is the pace, so that each request counts by its tokens: a one-token turn that waited on
a busy server moves it little. Beside it, the load: the sequences the server held on average
while each request ran (its outstanding count integrated over time). A server keeps its pace
up to the load it was measured at (vLLM batches: on a CPU or a GPU alike, a decode step takes
about as long for 1 sequence as for 20) and is assumed to slow in proportion beyond it.

A pace that has not been measured for ``ttl_s`` is forgotten, as is one the fleet resets when
its server fails (requests that started before the reset then say nothing of it): the server
then counts as the fastest and is measured anew, so that a server once slow (a hang, a noisy
neighbour, its first requests after a restart) is not kept out for the rest of the run.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["Pace", "predicted"]


class Pace:
    def __init__(self, weight: float = 0.1, ttl_s: float = 60.0) -> None:
        self.weight, self.ttl_s = weight, ttl_s
        self._seconds = self._tokens = self._load = 0.0
        self._at: float | None = None  # when last measured (None: never, or reset)
        self._reset_at = float("-inf")  # a request that started before says nothing
        # The outstanding sequences integrated over time, up to _area_at.
        self._area, self._area_at, self._holding = 0.0, None, 0

    def holding(self, outstanding: int, now: float) -> float:
        """The server holds ``outstanding`` sequences from ``now`` on; returns the integral of
        what it held up to ``now`` (what a request's :meth:`add` averages its load from)."""
        if self._area_at is not None:
            self._area += self._holding * (now - self._area_at)
        self._area_at, self._holding = now, outstanding
        return self._area

    def add(self, seconds: float, tokens: int, now: float, load: float = 1.0) -> None:
        """A request that generated ``tokens`` (its longest sample) in ``seconds`` while the
        server held ``load`` sequences on average (itself included)."""
        if tokens <= 0 or seconds < 0 or now - seconds < self._reset_at:
            return  # nothing generated, or it ran across the failure the pace was reset for
        load = max(1.0, load)
        if self.value(now) is None:  # never measured, reset or forgotten: measured anew
            self._seconds, self._tokens, self._load = seconds, float(tokens), load
        else:
            self._seconds += self.weight * (seconds - self._seconds)
            self._tokens += self.weight * (tokens - self._tokens)
            self._load += self.weight * (load - self._load)
        self._at = now

    def reset(self, now: float) -> None:
        self._at, self._reset_at = None, now

    def value(self, now: float) -> float | None:
        """Seconds per generated token, or None (not measured, reset, or too long ago)."""
        if self._at is None or now - self._at >= self.ttl_s:
            return None
        return self._seconds / self._tokens

    def at_load(self, now: float, outstanding: int) -> float | None:
        """The seconds per token a request would take with the server holding
        ``outstanding`` sequences: its pace up to the load it was measured at, in proportion
        beyond (None: not measured)."""
        pace = self.value(now)
        return None if pace is None else pace * max(1.0, outstanding / self._load)


def predicted(servers: Sequence[tuple[Pace, int]], now: float) -> list[float]:
    """The seconds per token a request would take on each of ``servers`` (its pace, and the
    sequences it would hold with the request). One not measured counts as the fastest measured
    one would at that load, so a restarted server (or one forgotten) is tried as often as the
    fastest; with none measured (a run's first batch) the sequences held decide, and a batch
    splits evenly."""
    measured = [(p, pace) for pace, _ in servers if (p := pace.value(now)) is not None]
    fastest = min(measured, key=lambda m: m[0])[1] if measured else None
    costs = []
    for pace, n in servers:
        at = pace.at_load(now, n)
        if at is None:
            at = fastest.at_load(now, n) if fastest is not None else float(n)
        costs.append(at)
    return costs
