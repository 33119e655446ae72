"""benchmarks/_ranks.py: a benchmark whose rank fails ends within seconds with that rank's
error, whether the rank raised or died without a word, while its peers wait in a collective."""

from __future__ import annotations

import os
import time

import pytest

from benchmarks._ranks import join_world, run_ranks

pytestmark = pytest.mark.timeout(180)


def _one_rank_fails(rank: int, world: int, port: int, how: str, results) -> None:
    import torch.distributed as dist

    join_world(rank, world, port)
    if rank == 1:
        if how == "raise":
            raise ValueError("rank 1 cannot go on")
        os._exit(3)  # killed, or a crash in C: no traceback
    dist.barrier()  # rank 0 would wait here for ever
    results.put("unreachable")


def _both_finish(rank: int, world: int, port: int, results) -> None:
    import torch.distributed as dist

    join_world(rank, world, port)
    dist.barrier()
    if rank == 0:
        results.put(("done", world))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("how, says", [("raise", "ValueError: rank 1 cannot go on"),
                                       ("exit", "rank 1 exited with code 3")])  # fmt: skip
def test_a_failed_rank_ends_the_benchmark_with_its_error_at_once(how, says):
    start = time.monotonic()
    with pytest.raises(SystemExit) as e:
        run_ranks(_one_rank_fails, 2, how)
    assert says in str(e.value), str(e.value)
    assert time.monotonic() - start < 60, "the benchmark waited on a dead rank"


def test_ranks_that_finish_return_the_first_result():
    assert run_ranks(_both_finish, 2) == ("done", 2)
