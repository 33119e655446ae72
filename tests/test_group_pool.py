"""Partial batches (``rollout.in_flight_updates.groups_in_flight``) without a server: a step
takes the first groups to finish, the rest run on across the sync, a group beyond the
staleness bound is dropped and counted, and a checkpoint resumes the same groups with the
same tokens and versions.

Against a real vLLM server: benchmarks/in_flight.py and tests/test_multi_turn_vllm.py."""

from __future__ import annotations

import json
import threading
import time

import pytest

from megatron_gspo.config import Recipe
from megatron_gspo.data.prompts import Prompt
from megatron_gspo.episodes.episode import Episode
from megatron_gspo.episodes.group_pool import GroupPool
from megatron_gspo.episodes.pipeline import Batch, RolloutPipeline
from megatron_gspo.rollout.protocol import Completion
from megatron_gspo.runtime.errors import InputError
from tests.support.rl_fixtures import tiny_recipe
from tests.support.waiting import eventually


class _HeldGroups:
    """Groups that run until the test lets them end; each episode's first token is stamped
    with the version the engine held when its group started, its last with the version it
    holds when the group ends (the test sets ``version``, as a sync does)."""

    def __init__(self, release_all: bool = False) -> None:
        self.version, self.started = 0, []
        self.events: dict[tuple[int, int], threading.Event] = {}
        self.release_all = release_all
        self.lock = threading.Lock()

    def event(self, step: int, index: int) -> threading.Event:
        with self.lock:
            e = self.events.setdefault((step, index), threading.Event())
            if self.release_all:
                e.set()
            return e

    def release(self, *keys: tuple[int, int]) -> None:
        for key in keys:
            self.event(*key).set()

    def __call__(self, step: int, index: int, prompt: Prompt):
        start = self.version
        with self.lock:
            self.started.append((step, index))
        assert self.event(step, index).wait(30)
        c = Completion([step, index], [-0.5, -0.5], "stop", token_versions=[start, self.version])
        c.stamp("ignored: the tokens say it")
        return [Episode.from_completion(c)], {"episodes_in_flight_max": 1.0}

    def open_all(self) -> None:
        with self.lock:
            self.release_all = True
            for e in self.events.values():
                e.set()


def _draw(step: int) -> list[Prompt]:
    return [Prompt(f"{step}.{i}", "", [step, i]) for i in range(2)]


def _pool(rollout, next_step: int = 1) -> GroupPool:
    return GroupPool(
        rollout, _draw, per_step=2, groups_in_flight=4, max_staleness=1, next_step=next_step
    )


def _keys(batch: Batch) -> list[tuple[int, int]]:
    return [tuple(p.token_ids) for p in batch.prompts]


def test_a_step_takes_the_first_groups_to_finish_and_the_rest_run_on_across_the_sync():
    groups = _HeldGroups()
    pool = _pool(groups)
    try:
        pool.resume(version=0)
        assert eventually(lambda: len(groups.started) == 4), groups.started
        assert sorted(groups.started) == [(1, 0), (1, 1), (2, 0), (2, 1)]
        groups.release((2, 0), (1, 1))
        batch = pool.take(1, current_version=0)
        assert sorted(_keys(batch)) == [(1, 1), (2, 0)], "not the first groups to finish"
        # Step 2 takes the two still running: a group started now could only age out.
        time.sleep(0.1)
        assert len(groups.started) == 4, "a group started that no step could take in time"
        pool.pause()  # returns at once
        groups.version = 1  # the sync, under (1, 0) and (2, 1)
        pool.resume(version=1)  # step 3's prompts start: trained at step 2 or 3
        assert eventually(lambda: len(groups.started) == 6), groups.started
        groups.release((3, 0), (3, 1))  # on version 1 alone
        assert eventually(lambda: len(pool._finished) == 2)
        groups.release((1, 0))  # after them, but older
        assert eventually(lambda: len(pool._finished) == 3)
        batch = pool.take(2, current_version=1)
        assert _keys(batch) == [(1, 0), (3, 0)], "the stalest groups are not taken first"
        [e] = batch.episodes[0]
        assert e.token_versions == [0, 1] and e.spans_versions
        assert batch.stats["rollout_groups_carried"] == 1.0  # (3, 1), for step 3
        assert pool.dropped == 0
    finally:
        groups.open_all()
        pool.close()


def test_a_group_beyond_the_staleness_bound_is_dropped_counted_and_never_trained():
    groups = _HeldGroups()
    pool = _pool(groups)
    try:
        pool.resume(version=0)
        assert eventually(lambda: len(groups.started) == 4)
        groups.release((1, 0), (1, 1))
        pool.take(1, current_version=0)
        for step in (2, 3):  # (2, 0) started on version 0 is still running at step 3
            groups.version = step - 1
            pool.resume(version=step - 1)
            assert eventually(lambda n=2 * step + 2: len(groups.started) >= n)
            if step == 2:
                groups.release((2, 1), (3, 0))
                assert sorted(_keys(pool.take(2, current_version=1))) == [(2, 1), (3, 0)]
        groups.release((2, 0))  # finishes on version 2 with its first token from 0
        assert eventually(lambda: any(g.step == 2 for g in pool._finished))
        groups.release((4, 0), (4, 1))  # started on version 1: within the bound
        batch = pool.take(3, current_version=2)
        assert sorted(_keys(batch)) == [(4, 0), (4, 1)]
        assert pool.dropped == 1, "the group two versions behind was not counted as dropped"
    finally:
        groups.open_all()
        pool.close()


def test_a_checkpoint_holds_the_groups_in_flight_finished_and_resumes_them_exactly():
    groups = _HeldGroups()
    pool = _pool(groups)
    try:
        pool.resume(version=0)
        assert eventually(lambda: len(groups.started) == 4)
        groups.release((1, 0), (2, 1))
        pool.take(1, current_version=0)
        groups.version = 1  # the sync, under (1, 1) and (2, 0)
        threading.Timer(0.2, groups.release, [(1, 1), (2, 0)]).start()
        saved = json.loads(json.dumps(pool.state()))  # waits for the two; starts nothing more
        time.sleep(0.1)
        assert len(groups.started) == 4, "a group started during the save"
    finally:
        groups.open_all()
        pool.close()
    finished = sorted((g["step"], g["index"]) for g in saved["groups"])
    assert finished == [(1, 1), (2, 0)]
    assert saved["pending"] and saved["next_step"] > 3

    later = _HeldGroups(release_all=True)
    later.version = 1  # the engine holds what the run last synced
    again = _pool(later, next_step=2)
    try:
        again.restore(saved)
        again.resume(version=1)
        batch = again.take(2, current_version=1)
        [e] = batch.episodes[0]
        assert _keys(batch) == [(1, 1), (2, 0)]
        assert e.token_versions == [0, 1], "the versions did not survive the checkpoint"
        # What was drawn but not started starts now, before anything newly drawn.
        pending = [(g["step"], g["index"]) for g in saved["pending"]]
        assert eventually(lambda: len(later.started) >= 2)
        assert later.started[:2] == pending[:2]
    finally:
        again.close()


def test_a_whole_batch_checkpoint_resumes_as_its_groups_and_not_the_other_way():
    done = Completion([1], [-1.0], "stop")
    done.stamp(3)
    batch = Batch(4, _draw(4), [[Episode.from_completion(done)]] * 2)
    groups = _HeldGroups(release_all=True)
    groups.version = 3
    pool = _pool(groups, next_step=4)
    try:
        pool.restore([batch.to_json()])
        pool.resume(version=3)
        assert _keys(pool.take(4, current_version=3)) == [(4, 0), (4, 1)]
        assert pool.next_draw >= 5
        saved = pool.state()
    finally:
        pool.close()
    queue = RolloutPipeline(None, _draw, max_staleness=1, next_step=5)
    with pytest.raises(InputError, match="groups_in_flight"):
        queue.restore(saved)


def _stale_groups_state(pending_step: int) -> dict:
    """A checkpoint of a pool of 4 whose two carried groups were sampled by version 0, with the
    next step's prompts drawn and not started."""
    old = Completion([9], [-1.0], "stop", token_versions=[0])
    old.stamp(0)
    groups = [
        {"step": 2, "index": i, "prompt": {"text": f"2.{i}", "answer": "", "token_ids": [2, i]},
         "episodes": [Episode.from_completion(old).to_json()], "stats": {}}
        for i in range(2)
    ]  # fmt: skip
    pending = [
        {"step": pending_step, "index": i, "prompt": {"text": "", "answer": "",
         "token_ids": [pending_step, i]}, "episodes": [], "stats": {}}
        for i in range(2)
    ]  # fmt: skip
    return {"groups": groups, "pending": pending, "next_step": pending_step + 1}


@pytest.mark.timeout(60)
def test_stale_groups_resumed_into_a_smaller_pool_are_dropped_and_the_pending_prompts_started():
    groups = _HeldGroups(release_all=True)
    groups.version = 2
    pool = GroupPool(groups, _draw, per_step=2, groups_in_flight=2, max_staleness=1, next_step=3)
    try:
        pool.restore(json.loads(json.dumps(_stale_groups_state(pending_step=3))))
        pool.resume(version=2)  # the carried groups fill the pool: nothing starts yet
        batch = pool.take(3, current_version=2)
        assert _keys(batch) == [(3, 0), (3, 1)], "the pending prompts did not start"
        assert pool.dropped == 2
    finally:
        pool.close()


@pytest.mark.timeout(60)
def test_an_engine_whose_versions_stop_advancing_fails_the_take_naming_it():
    groups = _HeldGroups(release_all=True)  # stays at version 0 whatever the syncs say
    pool = _pool(groups)
    try:
        pool.resume(version=0)
        pool.take(1, current_version=0)
        pool.resume(version=1)  # groups started from here on come back labelled 0
        with pytest.raises(RuntimeError, match="versions do not advance with the syncs"):
            for step in range(2, 8):
                pool.take(step, current_version=step - 1)
                pool.resume(version=step)
    finally:
        pool.close()


@pytest.mark.timeout(60)
def test_a_take_that_no_group_can_serve_gives_up_at_its_deadline():
    groups = _HeldGroups()  # never released: the engine hangs
    pool = GroupPool(
        groups, _draw, per_step=2, groups_in_flight=4, max_staleness=1, next_step=1,
        wait_timeout_s=0.5,
    )  # fmt: skip
    try:
        pool.resume(version=0)
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="no group step 1 can train on finished within"):
            pool.take(1, current_version=0)
        assert time.monotonic() - start < 5
        with pytest.raises(RuntimeError, match="none is running"):
            held = _pool(None)
            held.take(1, current_version=0)  # resume() never called
    finally:
        groups.open_all()
        pool.close()


def _pool_failing_on_rank0(rank: int, world: int, when: str) -> str:
    """A group fails on rank 0; the checkpoint (state) or the step (take) must end every rank
    with its error, not leave rank 1 waiting in a collective."""
    import torch.distributed as dist

    def fail(step, index, prompt):
        raise SystemExit("a user function called sys.exit() in a group thread")

    pool = _pool(fail)
    try:
        pool.resume(version=0)
        if rank == 0:
            assert eventually(lambda: pool._error is not None)
        dist.barrier()
        if when == "state":
            pool.state()
        else:
            pool.take(1, current_version=0)
    except BaseException as e:  # noqa: BLE001 - what each rank raised is the result
        return f"{type(e).__name__}: {e}"
    finally:
        pool._pool and pool._pool.shutdown(wait=False)
    return "no error"


@pytest.mark.parametrize("when", ["state", "take"])
def test_a_failed_group_on_rank_0_reaches_every_rank(when):
    from tests.support.ranks import run_distributed

    got = run_distributed(_pool_failing_on_rank0, 2, when, timeout=60)
    assert all("sys.exit() in a group thread" in g for g in got), got


def test_the_recipe_wants_at_least_a_steps_groups_in_flight():
    base = tiny_recipe().model_dump()
    rollout = {**base["rollout"], "max_staleness": 1, "engine": "vllm", "prompts_per_step": 4}
    rollout["in_flight_updates"] = {"mode": "keep", "groups_in_flight": 3}
    with pytest.raises(ValueError, match="groups_in_flight must be >= rollout.prompts_per_step"):
        Recipe.model_validate({**base, "rollout": rollout})
    rollout["in_flight_updates"]["groups_in_flight"] = 8
    Recipe.model_validate({**base, "rollout": rollout})
