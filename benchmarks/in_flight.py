"""Draining before each weight sync against updating weights in flight, in one run.

One CPU vLLM server on a tiny Qwen3-MoE, pinned to one core, this process (the trainer's
side) to the other, as separate machines would be; ``rollout.max_staleness: K`` (1 unless
``--max-staleness``); the project's rollout queues (episodes/pipeline.py,
episodes/group_pool.py) and vLLM client, three modes on the same draws: drain, in flight with
whole batches, and in flight with partial batches (``--groups-in-flight`` groups, twice the
batch by default; 0 leaves them out). Every step trains for a fixed ``--train-s`` (a sleep:
the trainer's cost is not what is measured) and then syncs: ``/pause`` (``wait`` when
draining, ``keep`` in flight), the version label ``partial``, ``--sync-s`` of transfer (a
sleep; benchmarks/weight_sync.py measures the real one), the new version, ``/resume``. Each
sample is its own request (a group of one) whose length is drawn from a lognormal (median
``--median`` tokens, ``--sigma``, capped at ``--max-tokens``; the stop forced at the drawn
length), so a batch's tail is a few long samples.

Printed per mode: samples/s and trained tokens/s over the steps after the first, the trained
samples' mean length against the draws' (partial batches train the first to finish: the
short ones), the trainer's idle time (waiting for generation: the queue's ``waited()``), the
share of samples whose tokens span two versions, and the groups dropped beyond the bound.
Also a model's estimate of the ratio for these draws (an estimate, not a bound: it charges every
token one decode time, measured at the batch's concurrency, while a batch's tail decodes alone
and faster, so a measured ratio can exceed it). A drained step costs at least the train step or
its batch's longest sample, whichever is longer, and then the sync. In flight with whole batches
the sync no longer waits, but batch ``s`` starts at the sync to version ``s - 1 - K`` and must
be finished when step ``s`` takes it, so it has ``K`` steps for its longest sample; the engine
must also decode every token (at the batch's concurrency, about its mean sample per step). With
``d`` the seconds per decoded token of a sequence, measured first on this server:
``sum(max(T, d * Lmax) + S) / sum(max(T + S, d * Lmax / K, d * Lmean))``. Partial batches drop
the straggler term.

The last line: ``in_flight: drain <X> samples/s, in-flight <Y> samples/s, ratio <Y/X>``, the
in-flight figure partial batches' (whole batches' with ``--groups-in-flight 0``).

    python benchmarks/in_flight.py [--steps 10] [--batch 16] [--median 40] [--sigma 1.0]
                                  [--max-staleness 1] [--groups-in-flight 32]

Needs vllm (``.ci/vllm-setup.sh``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def draw_lengths(args, steps: int | None = None) -> list[list[int]]:
    """Per step, each sample's length (fixed seed: both modes get the same draws); ``steps``
    batches (default: as many as the group pool draws ahead of ``args.steps``)."""
    rng = random.Random(args.seed)
    return [
        [
            max(1, min(args.max_tokens, round(rng.lognormvariate(0, args.sigma) * args.median)))
            for _ in range(args.batch)
        ]
        for _ in range(3 * args.steps + 4 if steps is None else steps)
    ]


class Bench:
    """A client, its servers' routes and the engine's sync gate, for one mode."""

    def __init__(self, url: str, key: str, mode: str | None, lengths, args) -> None:
        from megatron_gspo.rollout.vllm.http_client import VLLMClient
        from megatron_gspo.rollout.vllm.rl_api import Servers

        self.ready = threading.Event()
        self.ready.set()
        self.client = VLLMClient(
            [url], api_key=key, request_timeout_s=600, in_flight="keep",
            wait_for_weights=self.ready.wait, weights_version=lambda: self.version,
        )  # fmt: skip
        self.servers = Servers(VLLMClient([url], api_key=key), timeout_s=600)
        self.mode, self.lengths, self.args, self.version = mode, lengths, args, 0

    def rollout(self, step: int, prompts):
        """The step's samples, each its own request of its drawn length."""
        return self._run(step, range(len(self.lengths[step]))), {}

    def group(self, step: int, index: int, prompt):
        """One sample (a group of one) of the step's draw, as the group pool asks for it."""
        [group] = self._run(step, [index])
        return group, {}

    def _run(self, step: int, indices):
        from megatron_gspo.episodes.episode import Episode
        from megatron_gspo.rollout.protocol import SamplingParams

        self.ready.wait()
        version = self.version

        async def run():
            async with self.client.session() as http:
                jobs = []
                for i in indices:
                    n = self.lengths[step][i]
                    p = SamplingParams(
                        group_size=1, max_new_tokens=n, min_new_tokens=n, seed=step * 1000 + i
                    )
                    url = self.client.urls[0]
                    jobs.append(self.client.complete(http, url, [5, 6, 7], p, p.seed))
                return await asyncio.gather(*jobs)

        groups = asyncio.run(run())
        for [c] in groups:
            c.stamp(version)
        return [[Episode.from_completion(c)] for [c] in groups]

    def sync(self, version: int) -> None:
        self.ready.clear()
        try:
            mode = "keep" if self.mode else "wait"
            self.servers.pause(mode, clear_cache=mode != "keep")  # as rollout/vllm/weight_sync.py
            self.servers.set_version("partial")
            time.sleep(self.args.sync_s)
            self.servers.set_version(str(version))
            self.servers.resume()
            self.version = version
        finally:
            self.ready.set()


def run_mode(url: str, key: str, mode: str, lengths, args) -> dict[str, float]:
    """``mode``: drain, whole (in flight, whole batches) or groups (in flight, partial)."""
    from megatron_gspo.data.prompts import Prompt
    from megatron_gspo.episodes.group_pool import GroupPool
    from megatron_gspo.episodes.pipeline import RolloutPipeline

    bench = Bench(url, key, None if mode == "drain" else "keep", lengths, args)
    bench.sync(0)
    if mode == "groups":
        prompt = Prompt("", "", [5, 6, 7])
        queue = GroupPool(
            bench.group,
            lambda step: [prompt] * args.batch,
            per_step=args.batch,
            groups_in_flight=args.groups_in_flight,
            max_staleness=args.max_staleness,
            next_step=1,
        )
    else:
        queue = RolloutPipeline(
            bench.rollout,
            lambda step: [],
            max_staleness=args.max_staleness,
            next_step=1,
            in_flight=mode == "whole",
        )
    queue.resume(version=0)
    idle = spanning = samples = tokens = 0.0
    start = None
    try:
        for step in range(1, args.steps + 1):
            batch = queue.take(step, current_version=step - 1)
            if step == 1:  # the first batch has nothing to overlap with
                start, _ = time.perf_counter(), queue.waited()
            else:
                samples += len(batch.episodes)
                tokens += sum(len(e.token_ids) for [e] in batch.episodes)
                spanning += sum(e.spans_versions for [e] in batch.episodes)
            time.sleep(args.train_s)  # the training step
            queue.pause()
            if step > 1:
                idle += queue.waited()
            bench.sync(step)
            queue.resume(version=step)
        elapsed = time.perf_counter() - start
    finally:
        queue.close()
    return {
        "samples_per_s": samples / elapsed,
        "tokens_per_s": tokens / elapsed,
        "mean_length": tokens / max(samples, 1),
        "idle_s": idle,
        "elapsed_s": elapsed,
        "spanning": spanning / max(samples, 1),
        "dropped": queue.dropped,
    }


def decode_seconds_per_token(url: str, key: str, args) -> float:
    """One sequence's seconds per decoded token at the batch's concurrency."""
    from megatron_gspo.rollout.protocol import RolloutRequest, SamplingParams
    from megatron_gspo.rollout.vllm.http_client import VLLMClient

    client = VLLMClient([url], api_key=key, request_timeout_s=600)
    n = args.max_tokens
    p = SamplingParams(group_size=args.batch, max_new_tokens=n, min_new_tokens=n, seed=1)
    client.generate(RolloutRequest([[5, 6, 7]], p))  # warm
    t = time.perf_counter()
    client.generate(RolloutRequest([[5, 6, 7]], p))
    return (time.perf_counter() - t) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--median", type=int, default=40)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=1000)
    ap.add_argument("--train-s", type=float, default=0.3)
    ap.add_argument("--sync-s", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-staleness", type=int, default=1)
    ap.add_argument(
        "--groups-in-flight",
        type=int,
        default=None,
        help="the group pool's size (default: twice --batch); 0: whole batches only",
    )
    args = ap.parse_args()
    if args.groups_in_flight is None:
        args.groups_in_flight = 2 * args.batch

    from megatron_gspo.rollout.vllm.single_node import (
        cpu_serving_args,
        served,
        write_served_model,
    )
    from tests.support.vllm_tiny import VLLM_TINY_MOE

    cfg = VLLM_TINY_MOE.model_copy(update={"max_seq_length": args.max_tokens + 16})
    lengths = draw_lengths(args)
    flat = [n for step in lengths[1 : args.steps + 1] for n in step]
    print(
        f"lengths: median {statistics.median(flat):.0f}, mean {statistics.mean(flat):.0f}, "
        f"max {max(flat)} tokens; {args.batch} samples a step, {args.steps} steps, "
        f"max_staleness {args.max_staleness}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_served_model(Path(tmp) / "model", cfg)
        extra = [*cpu_serving_args(cfg.max_seq_length, max_num_seqs=4 * args.batch)]
        # The trainer and the engine are separate machines in a real run: here one core each,
        # so that the engine's decoding does not slow the trainer's side (its HTTP, the sync).
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise SystemExit("needs two CPU cores (one for the server, one for the trainer)")
        os.sched_setaffinity(0, {cpus[0]})
        bind = {"VLLM_CPU_OMP_THREADS_BIND": str(cpus[1])}
        with served(model_dir, [*extra, "--seed", "0"], env=bind, cpu=cpus[1]) as (url, key):
            d = decode_seconds_per_token(url, key, args)
            modes = ["drain", "whole"] + (["groups"] if args.groups_in_flight else [])
            results = {mode: run_mode(url, key, mode, lengths, args) for mode in modes}
    t, s, k = args.train_s, args.sync_s, args.max_staleness
    steps = lengths[2 : args.steps + 1]  # the batches trained after the first
    drained = sum(max(t, d * max(b)) + s for b in steps)
    whole = drained / sum(max(t + s, d * max(b) / k, d * statistics.mean(b)) for b in steps)
    # Partial batches: no straggler term; the engine must still decode a step's tokens.
    groups = drained / sum(max(t + s, d * statistics.mean(b)) for b in steps)
    names = {
        "drain": "drain",
        "whole": "in flight, whole batches",
        "groups": f"in flight, {args.groups_in_flight} groups in flight",
    }
    drawn = statistics.mean(flat)
    for mode, r in results.items():
        print(
            f"{names[mode]}: {r['samples_per_s']:.2f} samples/s, {r['tokens_per_s']:.0f} "
            f"tokens/s, trained mean length {r['mean_length']:.0f} (draws {drawn:.0f}), "
            f"trainer idle {r['idle_s']:.1f} s of {r['elapsed_s']:.1f} s, samples spanning two "
            f"versions {r['spanning']:.0%}, dropped {r['dropped']}"
        )
    print(
        f"decode {d * 1e3:.1f} ms per token; modelled ratio for these draws: whole batches "
        f"{whole:.2f}, partial batches {groups:.2f}"
    )
    best = results["groups" if args.groups_in_flight else "whole"]
    x, y = results["drain"]["samples_per_s"], best["samples_per_s"]
    # Partial batches train the episodes that finish first: shorter than the draws.
    tokens = best["tokens_per_s"] / results["drain"]["tokens_per_s"]
    print(f"trained tokens/s, in flight against drain: {tokens:.2f}")
    print(f"in_flight: drain {x:.2f} samples/s, in-flight {y:.2f} samples/s, ratio {y / x:.2f}")


if __name__ == "__main__":
    main()
