"""Work that global rank 0 does and every rank needs goes through one path
(:func:`megatron_gspo.runtime.rank0.on_rank0`), which hands rank 0's error to every rank: a
failure on rank 0 ends every rank with rank 0's message, within seconds, instead of leaving the
others waiting in a broadcast."""

from __future__ import annotations

import time

import pytest

from megatron_gspo.runtime.rank0 import on_rank0
from tests.support.ranks import run_distributed
from tests.support.tiny import TINY_MOE


class _Unpicklable(Exception):
    def __init__(self, a, b):  # pickling keeps args only: unpickling calls _Unpicklable(msg)
        super().__init__(f"{a} and {b}")


def _raise(kind: str):
    if kind == "plain":
        raise ValueError("rank 0 says no")
    raise _Unpicklable("rank 0", "its odd error")


def _on_rank0(rank: int, world: int, kind: str) -> str:
    try:
        on_rank0(_raise, kind)
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize("kind", ["plain", "unpicklable"])
def test_every_rank_raises_rank_0s_error(kind):
    got = run_distributed(_on_rank0, 2, kind, timeout=60)
    message = "rank 0 says no" if kind == "plain" else "_Unpicklable: rank 0 and its odd error"
    assert all(message in g for g in got), got
    if kind == "plain":
        assert got[0] == got[1], got


def _engine_fails_on_rank0(rank: int, world: int, which: str) -> tuple[str, float]:
    from megatron_gspo.config import ParallelConfig, VLLMConfig
    from megatron_gspo.model import build_model
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.rollout import RolloutRequest, SamplingParams

    init_parallel(ParallelConfig())
    model = build_model(TINY_MOE, ParallelConfig())
    if which == "generation worker":
        from megatron_gspo.rollout.local_worker import LocalWorkerEngine

        engine = LocalWorkerEngine(model, TINY_MOE)
    else:
        from megatron_gspo.rollout.vllm import VLLMEngine

        # Nothing listens there: rank 0's client fails at once, with no retries, and the
        # fleet gives the server a second to come back.
        config = VLLMConfig(urls=["http://127.0.0.1:9"], max_retries=0, health_timeout_s=1)
        engine = VLLMEngine(config, TINY_MOE, model, api_key="k")
    # An id past the vocabulary: the worker's embedding raises.
    request = RolloutRequest([[1, 2, 10_000]], SamplingParams(group_size=2, max_new_tokens=2))
    start = time.monotonic()
    try:
        engine.generate(request)
    except Exception as e:  # noqa: BLE001 - the message each rank raised is the result
        return f"{type(e).__name__}: {e}", time.monotonic() - start
    finally:
        engine.close()
    return "no error", time.monotonic() - start


@pytest.mark.parametrize("which", ["generation worker", "vllm"])
def test_an_engine_failing_on_rank_0_ends_every_rank_with_its_message(which):
    got = run_distributed(_engine_fails_on_rank0, 2, which, timeout=120)
    (m0, t0), (m1, t1) = got
    print(got)
    assert m0 == m1 and m0 != "no error", got
    assert ("generation worker" if which == "generation worker" else "127.0.0.1:9") in m0
    assert max(t0, t1) < 30, f"a rank waited {max(t0, t1):.0f} s for rank 0's result"
