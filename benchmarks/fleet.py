"""A fleet with a slow server: round-robin against least-loaded routing, on the same draws.

Three CPU vLLM servers on a tiny Qwen3-MoE, one of them about 3x slower than the others: each
runs in a CPU cgroup whose quota caps what its processes (API server, engine, worker) run,
``--fast-cores`` for the fast ones and ``--slow-share`` of that for the slow one, as a batch
system's or a container's quota would (needs a writable cgroup ``cpu`` controller: root). Each
server's worker decodes on one thread bound to a core (``VLLM_CPU_OMP_THREADS_BIND``: the two
fast ones on a core each, the slow one beside the first; vLLM's default, "auto", binds every
server to the same core). Each server's CPU time per policy is printed beside its share.

Each step sends a batch of single-sample requests at once (lognormal lengths, the stop forced
at the drawn length, so both policies decode the same tokens) through the project's client
(:mod:`megatron_gspo.rollout.vllm.http_client`) and waits for all of them, as a training step
waits for its batch. Round robin gives every server a third of the batch; least-loaded routing
(the project's default) sends each request where it would take the least time per token, by
each server's pace and the load it was measured at, measured on the requests it finished
(the first, warm-up, batch included), and lets no server hold more than ``--max-seqs`` (the
servers' own batch), so the slow server ends with a smaller share, or none.
Both run on the same servers and draws, round robin first. Printed per policy: samples/s over
the steps after the first, each server's share of requests and its CPU seconds.

The last line: ``fleet: round-robin <X> samples/s, least-loaded <Y> samples/s, ratio <Y/X>``.

    python benchmarks/fleet.py [--steps 6] [--batch 48] [--median 32] [--max-seqs 64]

Needs vllm (``.ci/vllm-setup.sh``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class CpuQuota:
    """A CPU cgroup whose processes together run at most ``cores`` of CPU time (per 100 ms
    period), idle cores or not: the quota a batch system or a container gives. The cgroup v1
    ``cpu`` controller (``cpu.cfs_quota_us``) or v2's ``cpu.max``; needs them writable (root)."""

    V1, V2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")
    PERIOD_US = 100_000

    def __init__(self, name: str, cores: float) -> None:
        quota = max(1000, int(cores * self.PERIOD_US))
        if (self.V1 / "cpu.cfs_quota_us").is_file():
            self.path = self.V1 / name
            self.path.mkdir(exist_ok=True)
            (self.path / "cpu.cfs_period_us").write_text(str(self.PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        elif "cpu" in _read(self.V2 / "cgroup.controllers").split():
            self.path = self.V2 / name
            self.path.mkdir(exist_ok=True)
            (self.path / "cpu.max").write_text(f"{quota} {self.PERIOD_US}")
        else:
            raise SystemExit(
                "benchmarks/fleet.py slows a server with a CPU quota: it needs a writable cgroup "
                f"cpu controller ({self.V1} or {self.V2}/cpu.max, as root); none here"
            )

    def join(self) -> None:
        """Move the calling process (a server's, before it execs) into the cgroup; the
        processes it starts (vLLM's engine and worker) inherit it."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def remove(self) -> None:
        try:
            self.path.rmdir()
        except OSError:  # a process left in it: it ends with its server
            pass


def tree_cpu_s(pid: int) -> float:
    """CPU seconds a server's processes (API server, engine, worker) have used."""
    import psutil

    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    return sum(sum(p.cpu_times()[:2]) for p in procs)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def run_policy(urls, key, policy: str, lengths, args) -> dict:
    from megatron_gspo.rollout.protocol import SamplingParams, longest_completion
    from megatron_gspo.rollout.vllm.fleet import Fleet
    from megatron_gspo.rollout.vllm.http_client import VLLMClient

    client = VLLMClient(urls, api_key=key, request_timeout_s=600)
    client.fleet = Fleet(
        urls, client.health, health_timeout_s=60, policy=policy, max_seqs=args.max_seqs
    )
    served = {u: 0 for u in urls}
    samples, elapsed = 0, 0.0
    import asyncio

    for step, batch in enumerate(lengths):

        async def run(batch=batch, step=step):
            async with client.session() as http:

                async def one(i: int, n: int):
                    p = SamplingParams(
                        group_size=1, max_new_tokens=n, min_new_tokens=n, seed=step * 1000 + i
                    )
                    request = lambda url: client.complete(http, url, [5, 6, 7], p, p.seed)  # noqa: E731
                    url, _ = await client.fleet.routed(request, tokens=longest_completion)
                    return url

                return await asyncio.gather(*[one(i, n) for i, n in enumerate(batch)])

        start = time.perf_counter()
        done = asyncio.run(run())
        took = time.perf_counter() - start
        if step == 0:
            continue  # warm-up: the servers' first batch
        elapsed += took
        samples += len(batch)
        for url in done:
            served[url] += 1
    return {"samples_per_s": samples / elapsed, "served": served, "elapsed_s": elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--median", type=int, default=32)
    ap.add_argument("--sigma", type=float, default=0.6)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--max-seqs", type=int, default=64)
    ap.add_argument("--slow-share", type=float, default=1 / 3)
    ap.add_argument("--fast-cores", type=float, default=0.5, help="each fast server's CPU quota")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from megatron_gspo.launch.supervisor import ServerSpec, Supervisor
    from megatron_gspo.rollout.vllm.http_client import wait_until_healthy
    from megatron_gspo.rollout.vllm.server_command import (
        RPC_DIR_ENV,
        new_job_key,
        server_command,
        server_env,
    )
    from megatron_gspo.rollout.vllm.single_node import cpu_serving_args, write_served_model
    from megatron_gspo.runtime.procs import free_port
    from tests.support.vllm_tiny import VLLM_TINY_MOE

    cfg = VLLM_TINY_MOE.model_copy(update={"max_seq_length": args.max_tokens + 16})
    from benchmarks.in_flight import draw_lengths

    lengths = draw_lengths(args, args.steps + 1)  # the first batch warms the servers
    flat = [n for step in lengths[1:] for n in step]
    print(
        f"lengths: median {statistics.median(flat):.0f}, mean {statistics.mean(flat):.0f}, "
        f"max {max(flat)} tokens; {args.batch} requests a step, {args.steps} steps; at most "
        f"{args.max_seqs} sequences a server (least-loaded)"
    )
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_served_model(Path(tmp) / "model", cfg)
        key = new_job_key()
        env = {**server_env(key), "VLLM_CPU_KVCACHE_SPACE": "1"}
        extra = [*cpu_serving_args(cfg.max_seq_length, max_num_seqs=64), "--seed", "0"]
        shares = (args.fast_cores, args.fast_cores, args.fast_cores * args.slow_share)
        quotas = [CpuQuota(f"gspo-fleet-{os.getpid()}-{i}", c) for i, c in enumerate(shares)]
        specs = []
        for i, core in enumerate(("0", "1", "0")):  # the slow one (the last) beside the first
            port = free_port()
            cmd = server_command(str(model_dir), host="127.0.0.1", port=port, extra_args=extra)
            bound = {**env, "VLLM_CPU_OMP_THREADS_BIND": core, "OMP_NUM_THREADS": "1"}
            specs.append(
                ServerSpec(
                    cmd, bound, f"http://127.0.0.1:{port}", Path(tmp) / f"s{i}.log",
                    preexec=quotas[i].join, scratch_env=RPC_DIR_ENV,
                )
            )  # fmt: skip
        urls = [s.url for s in specs]
        supervisor = Supervisor(specs, log=lambda line: None)
        runner = threading.Thread(target=supervisor.run, kwargs={"handle_signals": False})
        runner.start()
        try:
            wait_until_healthy(urls, timeout_s=900, interval_s=1)
            print(
                f"servers ready; CPU quotas {', '.join(f'{c:.2f}' for c in shares)} cores "
                f"(the last, {urls[2]}, the slow one)"
            )
            results = {}
            pids = supervisor.pids()
            for policy in ("round_robin", "least_loaded"):
                before = [tree_cpu_s(pids[u]) for u in urls]
                results[policy] = run_policy(urls, key, policy, lengths, args)
                used = [tree_cpu_s(pids[u]) - b for u, b in zip(urls, before, strict=True)]
                results[policy]["cpu"] = used
        finally:
            supervisor.stop()
            runner.join()
            for q in quotas:
                q.remove()
    for policy, r in results.items():
        shares = ", ".join(f"{u.rsplit(':', 1)[1]}: {n}" for u, n in r["served"].items())
        cpu = ", ".join(f"{c:.1f}" for c in r["cpu"])
        print(
            f"{policy}: {r['samples_per_s']:.2f} samples/s over {r['elapsed_s']:.1f} s; requests "
            f"by server port ({shares}; the last is the slow one); CPU s by server ({cpu})"
        )
    x = results["round_robin"]["samples_per_s"]
    y = results["least_loaded"]["samples_per_s"]
    print(
        f"fleet: round-robin {x:.2f} samples/s, least-loaded {y:.2f} samples/s, ratio {y / x:.2f}"
    )


if __name__ == "__main__":
    main()
