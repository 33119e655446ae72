"""Trainer side: the rollout fleet, the vLLM servers this trainer samples from, each with a
state from its health probes and its requests, and the choice of server for every request.

States (docs/operations.md, "The rollout fleet"):

``serving``
    answers its probe and holds the trainer's current weights: it gets requests;
``suspect``
    a request to it failed at the transport, or a probe went unanswered: no new requests; back
    to ``serving`` as soon as a probe answers with the current version (a ``busy`` answer,
    :class:`Health`, changes no state);
``dead``
    unanswered for ``rollout.vllm.health_timeout_s``: the requests it held are resubmitted to
    serving servers (the clients watch for it);
``restarting``
    a dead server whose port answers again but is not healthy yet (its supervisor restarted
    it and vLLM is loading);
``stale``
    answers, but holds another weights version than the trainer's (it restarted, came back
    from a hang after a sync it missed, or a sync left it half-updated): no requests until a
    sync has brought it to the current version and ``/weight_info`` says so.

A request goes to the serving server on which it would take the least time per token, by each
server's pace and the load it was measured at (:mod:`.pace`; ties: the one chosen longest ago):
a slow server is given a request only once the fast ones are loaded past the point where they
would be slower, where counts alone split a batch evenly and the step waits for the slow
server. One not measured lately counts as the fastest would at the same load. No server holds
more than ``max_seqs`` (vLLM's ``--max-num-seqs``); the rest wait here. A session (an episode's
turns) stays on its server while that serves, for its prefix cache. The fleet sends nothing
itself: probes come from the caller (:class:`Probe`, a function of a URL and a deadline), from
a monitor thread while one runs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from megatron_gspo.rollout.vllm.errors import FleetDownError, NoServerError, VLLMUnavailableError
from megatron_gspo.rollout.vllm.pace import Pace, predicted

__all__ = [
    "DEAD",
    "RESTARTING",
    "SERVING",
    "STALE",
    "SUSPECT",
    "Fleet",
    "FleetDownError",
    "Health",
    "NoServerError",
]

log = logging.getLogger(__name__)

T = TypeVar("T")
SERVING, SUSPECT, DEAD, RESTARTING, STALE = "serving", "suspect", "dead", "restarting", "stale"
# A request on a server in these states will never be answered as asked: resubmit it.
LOST = frozenset({DEAD, RESTARTING, STALE})
# How often a request waiting on its server looks whether the fleet declared it lost.
WATCH_S = 0.2
# How often a request waiting for room on a full fleet looks again.
FULL_WAIT_S = 0.005


@dataclass(frozen=True)
class Health:
    """One probe's answer: ``status`` the HTTP status of ``/health`` (None: no answer, the
    connection refused or the deadline passed), ``version`` what ``/weight_info`` says (read
    only when healthy), or ``busy`` where that waited past the deadline for the engine."""

    status: int | None
    version: object = None
    busy: bool = False

    @property
    def ok(self) -> bool:
        return self.status == 200


Probe = Callable[[str, float], Health]


@dataclass
class _Server:
    url: str
    state: str = SERVING
    outstanding: int = 0
    # When it stopped answering (suspect, dead): dead once health_timeout_s have passed.
    failing_since: float | None = None
    # A counter of choices: among equally loaded servers the one chosen longest ago wins.
    chosen_at: int = 0
    version: object = None
    why: str = ""
    # Seconds per generated token of its recent requests; reset when it fails.
    pace: Pace = field(default_factory=Pace)


@dataclass
class _Counts:
    failovers: int = 0
    rejoins: int = 0
    # The fewest servers serving at any moment since the counts began: a server that dies
    # and is back by the step's end shows only here.
    fewest_serving: int = 0


class Fleet:
    """The servers of one trainer (global rank 0 alone holds it). Thread-safe: requests come
    from asyncio tasks and generation threads, probes from the monitor thread."""

    def __init__(
        self,
        urls: Iterable[str],
        probe: Probe,
        *,
        health_timeout_s: float,
        min_servers: int = 1,
        clock: Callable[[], float] = time.monotonic,
        policy: str = "least_loaded",
        max_seqs: int = 256,
    ) -> None:
        self.servers = {u: _Server(u) for u in urls}
        if not self.servers:
            raise ValueError("a fleet needs at least one server")
        self.probe, self.clock = probe, clock
        self.health_timeout_s, self.min_servers = health_timeout_s, min_servers
        # "least_loaded", or "round_robin" (benchmarks/fleet.py measures one against the other).
        if policy not in ("least_loaded", "round_robin"):
            raise ValueError(f"fleet policy must be least_loaded or round_robin, not {policy!r}")
        self.policy = policy
        self.max_seqs = max_seqs
        # The weights version the trainer last synced (every serving server holds it).
        self.version: object = None
        # Set by the engine while a sync is under way: its servers report "partial", and those
        # in flight (rollout.in_flight_updates) keep their requests.
        self.syncing = False
        self.sessions: dict[object, str] = {}
        self._counts = _Counts(fewest_serving=len(self.servers))  # every one starts serving
        self._choices = 0
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._monitor: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def urls(self) -> list[str]:
        return list(self.servers)

    # -- what each server is -----------------------------------------------------------------

    def state(self, url: str) -> str:
        return self.servers[url].state

    def states(self) -> dict[str, str]:
        with self._lock:
            return {u: s.state for u, s in self.servers.items()}

    def serving(self) -> list[str]:
        with self._lock:
            return [u for u, s in self.servers.items() if s.state == SERVING]

    def lost(self, url: str) -> bool:
        """Whether a request on ``url`` should be resubmitted elsewhere."""
        return self.servers[url].state in LOST

    def _set(self, server: _Server, state: str, why: str = "") -> None:
        if server.state == state:
            return
        line = f"{server.url}: {server.state} -> {state}" + (f" ({why})" if why else "")
        log.log(logging.INFO if state == SERVING else logging.WARNING, "vLLM fleet: %s", line)
        server.state, server.why = state, why
        serving = sum(s.state == SERVING for s in self.servers.values())
        self._counts.fewest_serving = min(self._counts.fewest_serving, serving)
        if state == SERVING:
            server.failing_since = None
        if state in (SUSPECT, DEAD):  # what it took meanwhile says nothing of its pace
            server.pace.reset(self.clock())
        self._changed.notify_all()

    # -- what the probes and the requests say ------------------------------------------------

    def observe(self, url: str, health: Health) -> None:
        """One probe's answer about ``url``."""
        now = self.clock()
        with self._lock:
            s = self.servers[url]
            if health.ok and health.busy:  # alive: a request's own deadline bounds the step
                s.failing_since = None
            elif health.ok:
                s.version = health.version
                if self.syncing and s.state in (SERVING, STALE):
                    return  # mid-sync labels say nothing: the sync's outcome decides
                # Before the first sync every server serves what it started with (None).
                if health.version == self.version:
                    self._set(s, SERVING)
                else:
                    self._set(s, STALE, f"holds version {health.version!r}, not {self.version!r}")
            else:
                self._failing(s, now, f"HTTP {health.status}" if health.status else "no answer")
                if s.state == DEAD and health.status is not None:
                    # Its port answers: the supervisor started it again; vLLM is not ready yet.
                    self._set(s, RESTARTING, f"/health answers HTTP {health.status}")

    def report_failure(self, url: str, why: str) -> None:
        """A request to ``url`` failed at the transport (refused, reset, a 5xx answer): no new
        requests until a probe says it serves again."""
        with self._lock:
            self._failing(self.servers[url], self.clock(), why)

    def _failing(self, s: _Server, now: float, why: str) -> None:
        if s.failing_since is None:
            s.failing_since = now
        if s.state in (SERVING, STALE):
            self._set(s, SUSPECT, why)
        if s.state == SUSPECT and now - s.failing_since >= self.health_timeout_s:
            self._set(s, DEAD, f"{why} for {now - s.failing_since:.0f} s")

    def probe_all(self) -> None:
        """Probe every server once (concurrently, each within its deadline)."""
        deadline = max(0.2, self.health_timeout_s / 3)
        with ThreadPoolExecutor(len(self.servers), thread_name_prefix="fleet-probe") as pool:
            answers = {u: pool.submit(self._probe_one, u, deadline) for u in self.servers}
            for url, answer in answers.items():
                self.observe(url, answer.result())

    def _probe_one(self, url: str, deadline: float) -> Health:
        try:
            return self.probe(url, deadline)
        except Exception as e:  # noqa: BLE001 - a probe that fails is an unanswered probe
            log.debug("probe of %s failed: %s", url, e)
            return Health(None)

    def start_monitor(self, interval_s: float | None = None) -> None:
        """Probe every ``interval_s`` (default: a quarter of the health timeout) in a daemon
        thread, so that a server that dies or hangs is out of rotation within the timeout."""
        if self._monitor is not None:
            return
        interval = interval_s if interval_s is not None else max(0.1, self.health_timeout_s / 4)

        def run() -> None:
            while not self._stop.wait(interval):
                self.probe_all()

        self._monitor = threading.Thread(target=run, name="fleet-monitor", daemon=True)
        self._monitor.start()

    def close(self) -> None:
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(timeout=10)
            self._monitor = None

    # -- routing -----------------------------------------------------------------------------

    def acquire(self, session: object = None, seqs: int = 1) -> str | None:
        """The server for the next request of ``seqs`` sequences, counted outstanding until
        :meth:`release`: the session's own while it serves, else the least loaded serving
        server with room for them (None: every one is full; wait for a release). Raises
        :class:`NoServerError` when none serves."""
        with self._lock:
            url = self.sessions.get(session) if session is not None else None
            if url is None or self.servers[url].state != SERVING:
                candidates = [s for s in self.servers.values() if s.state == SERVING]
                if not candidates:
                    raise NoServerError(self._summary())
                if self.policy == "round_robin":
                    best = min(candidates, key=lambda s: s.chosen_at)
                else:
                    cap = self.max_seqs - seqs  # an empty server takes any request
                    room = [s for s in candidates if s.outstanding == 0 or s.outstanding <= cap]
                    if not room:
                        return None
                    cost = predicted([(s.pace, s.outstanding + seqs) for s in room], self.clock())
                    best = room[min(range(len(room)), key=lambda i: (cost[i], room[i].chosen_at))]
                url = best.url
                if session is not None:
                    self.sessions[session] = url
            s = self.servers[url]
            s.outstanding += seqs
            s.pace.holding(s.outstanding, self.clock())
            self._choices += 1
            s.chosen_at = self._choices
            return url

    def release(self, url: str, seqs: int = 1) -> None:
        with self._lock:
            s = self.servers[url]
            s.outstanding -= seqs
            s.pace.holding(s.outstanding, self.clock())

    def forget(self, session: object) -> None:
        with self._lock:
            self.sessions.pop(session, None)

    def held(self, url: str) -> tuple[float, float]:
        """Now, and the integral of the sequences ``url`` held until now (:meth:`paced`)."""
        with self._lock:
            s, now = self.servers[url], self.clock()
            return now, s.pace.holding(s.outstanding, now)

    def paced(self, url: str, since: tuple[float, float], tokens: int) -> None:
        """A request that generated ``tokens`` (its longest sample) ran from ``since``
        (:meth:`held` when it was sent): its seconds, and the load its server held meanwhile."""
        (start, area), (now, area_now) = since, self.held(url)
        load = (area_now - area) / (now - start) if now > start else 1.0
        with self._lock:
            self.servers[url].pace.add(now - start, tokens, now, load)

    def moved(self) -> None:
        """A request was resubmitted to another server (``fleet_failovers``)."""
        with self._lock:
            self._counts.failovers += 1

    async def routed(
        self,
        request: Callable[[str], Awaitable[T]],
        session: object = None,
        seqs: int = 1,
        tokens: Callable[[T], int] | None = None,
    ) -> tuple[str, T]:
        """``request(url)`` on a serving server chosen here, and that server; sent again to
        another whenever the one it is on fails (raises :class:`VLLMUnavailableError`) or is
        declared lost while it waits. Other errors (a 4xx answer, a malformed reply) are the
        request's own and raised at once. ``tokens``: what a result generated, for its
        server's pace (none for scoring: a prefill alone)."""
        while True:
            url = await self._server(session, seqs)
            since = self.held(url)
            task = asyncio.ensure_future(request(url))
            try:
                while True:
                    done, _ = await asyncio.wait({task}, timeout=WATCH_S)
                    if done:
                        result = task.result()
                        if tokens is not None:
                            self.paced(url, since, tokens(result))
                        return url, result
                    if self.lost(url):
                        raise VLLMUnavailableError(
                            f"vLLM server {url} was declared {self.state(url)}"
                        )
            except VLLMUnavailableError as e:
                self.report_failure(url, str(e))
                self.moved()
            finally:
                if not task.done():
                    task.cancel()
                self.release(url, seqs)

    async def _server(self, session: object, seqs: int) -> str:
        """A serving server with room for the next request; while every one is full, wait
        for a release; while none serves, probe until one does or the health timeout passes
        (then :class:`FleetDownError`, naming every server)."""
        deadline = self.clock() + self.health_timeout_s
        while True:
            try:
                url = self.acquire(session, seqs)
            except NoServerError:
                await asyncio.to_thread(self.probe_all)
                if not self.serving() and self.clock() >= deadline:
                    self.check_minimum()
                    raise
                await asyncio.sleep(WATCH_S)
                continue
            if url is not None:
                return url
            await asyncio.sleep(FULL_WAIT_S)

    def wait_for_server(self, timeout_s: float) -> bool:
        """Block until some server serves (True) or ``timeout_s`` passes (False)."""
        deadline = self.clock() + timeout_s
        with self._lock:
            while not any(s.state == SERVING for s in self.servers.values()):
                left = deadline - self.clock()
                if left <= 0:
                    return False
                self._changed.wait(min(left, 0.5))
            return True

    # -- syncs -------------------------------------------------------------------------------

    def sync_targets(self) -> list[str]:
        """The servers a sync goes to: every one that answers (serving, stale, or suspect but
        not yet dead), in the fleet's order."""
        with self._lock:
            return [u for u, s in self.servers.items() if s.state in (SERVING, STALE, SUSPECT)]

    def synced(self, version: object, versions: dict[str, object]) -> None:
        """After a sync to ``version``: the servers whose ``/weight_info`` says so serve
        (those that were stale have rejoined); the rest are stale."""
        with self._lock:
            self.version = version
            # Those that serve first, so that fleet_servers_serving_min sees no passing dip.
            for url, held in sorted(versions.items(), key=lambda uv: uv[1] != version):
                s = self.servers[url]
                s.version = held
                if held == version:
                    if s.state != SERVING:
                        self._counts.rejoins += 1
                    self._set(s, SERVING)
                else:
                    self._set(s, STALE, f"holds version {held!r} after the sync to {version!r}")
            for url, s in self.servers.items():
                if url not in versions and s.state == SERVING:
                    self._set(s, STALE, f"missed the sync to version {version!r}")

    def mark_lost(self, url: str, why: str) -> None:
        """A server that failed a sync's call: dead if it does not answer, else stale."""
        with self._lock:
            s = self.servers[url]
            self._failing(s, self.clock(), why)
            if s.state == SUSPECT:
                self._set(s, STALE, why)

    def check_minimum(self) -> None:
        """Raise :class:`FleetDownError` when fewer than ``min_servers`` serve."""
        n = len(self.serving())
        if n < self.min_servers:
            raise FleetDownError(
                f"{n} of {len(self.servers)} vLLM servers serve, fewer than "
                f"rollout.vllm.min_servers = {self.min_servers} ({self._summary()}): the run "
                "checkpoints and exits 75 to be requeued once they are back"
            )

    # -- figures -----------------------------------------------------------------------------

    def take_metrics(self) -> dict[str, float]:
        """The step's fleet figures, and the counters started again."""
        with self._lock:
            serving = sum(s.state == SERVING for s in self.servers.values())
            counts, self._counts = self._counts, _Counts(fewest_serving=serving)
        return {
            "fleet_servers_serving": float(serving),
            "fleet_servers_serving_min": float(counts.fewest_serving),
            "fleet_failovers": float(counts.failovers),
            "fleet_rejoins": float(counts.rejoins),
        }

    def _summary(self) -> str:
        return ", ".join(
            f"{u} {s.state}" + (f" ({s.why})" if s.why and s.state != SERVING else "")
            for u, s in self.servers.items()
        )
