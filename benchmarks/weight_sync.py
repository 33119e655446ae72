"""Weight sync into a running vLLM server: in memory (collective) against disk, in one run.

Starts one CPU vLLM server (this project's extension and key, as ``launch`` starts them) on a
Qwen3-MoE of ~235 MB in fp32 that this script writes itself, then, with the trainer at 1 rank
and at 2 ranks (expert parallel: rank 0 gathers the other half of the experts), alternates
collective and disk syncs of the trainer's weights and prints, per path and layout, the
median over the repeats of the throughput (bytes synced / wall time of the whole sync, from
the trainer's gather to every server holding and reporting the new version) and of its
breakdown: gather (trainer shards to full tensors on rank 0; for disk: gather and write),
pack (into buckets), transport (waiting for the broadcasts), server load (the server's
``load_weights`` and post-processing, MoE prepack included).

The last line is the median over every sync of both layouts:
``weight_sync: collective <X> MB/s, disk <Y> MB/s, ratio <X/Y>``.

    python benchmarks/weight_sync.py [--repeats 5] [--sync-dir DIR] [--layers 8] [--bucket-mb 64]

The disk path writes to ``--sync-dir`` (default: a temporary directory on this machine's local
disk, which the page cache makes as fast as a disk path can be; a cluster's shared filesystem
is slower). Needs vllm (``.ci/vllm-setup.sh``).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def model_config(layers: int):
    from megatron_gspo.config import ModelConfig

    return ModelConfig(
        num_layers=layers,
        hidden_size=512,
        num_attention_heads=8,
        num_query_groups=4,
        # vLLM's CPU attention supports head_dim 64 (not 16).
        head_dim=64,
        vocab_size=2048,
        max_seq_length=256,
        num_experts=8,
        moe_ffn_hidden_size=512,
        moe_router_topk=2,
        moe_aux_loss_coeff=0.0,
        rotary_base=10000,
    )


def write_model(directory: Path, cfg) -> None:
    import torch

    from megatron_gspo.rollout.vllm.export import write_hf_checkpoint
    from megatron_gspo.weights.hf import HFMapping

    g = torch.Generator().manual_seed(0)
    mapping = HFMapping(cfg)
    tensors = (
        (name, torch.randn(shape, generator=g) * 0.02) for name, shape in mapping.hf_shapes.items()
    )
    write_hf_checkpoint(directory, cfg, tensors, dtype=torch.float32)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer(
    rank: int,
    world: int,
    port: int,
    cfg,
    url: str,
    key: str,
    sync_dir: str,
    repeats: int,
    bucket_mb: float,
    queue,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron_gspo.config import ParallelConfig, VLLMConfig
    from megatron_gspo.model import build_model
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.rollout.vllm import VLLMEngine

    parallel = ParallelConfig(expert_model_parallel_size=world)
    init_parallel(parallel)
    model = build_model(cfg, parallel)
    engines = {
        path: VLLMEngine(
            VLLMConfig(
                urls=[url],
                weight_sync=path,
                sync_dir=sync_dir,
                bucket_mb=bucket_mb,
                sync_timeout_s=600,
                request_timeout_s=600,
            ),
            cfg,
            model,
            urls=[url],
            api_key=key,
        )
        for path in ("collective", "disk")
    }
    version, records = 0, []
    t0 = time.perf_counter()
    engines["collective"].sync_weights(version)  # forms the group
    connect_s = time.perf_counter() - t0
    for _ in range(repeats):
        for path, engine in engines.items():
            version += 1
            start = time.perf_counter()
            engine.sync_weights(version)
            wall = time.perf_counter() - start
            records.append((path, wall, dict(engine.last_sync)))
    if rank == 0:
        queue.put((world, connect_s, records))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--sync-dir", default=None)
    parser.add_argument("--worlds", default="1,2", help="trainer world sizes (EP = world)")
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    args = parser.parse_args()

    import torch.multiprocessing as mp

    from megatron_gspo.rollout.vllm.client import wait_until_healthy
    from megatron_gspo.rollout.vllm.server import new_job_key, server_command, server_env

    cfg = model_config(args.layers)
    work = Path(tempfile.mkdtemp(prefix="weight-sync-"))
    sync_dir = Path(args.sync_dir or work / "sync")
    sync_dir.mkdir(parents=True, exist_ok=True)
    write_model(work / "model", cfg)
    size_mb = sum(p.stat().st_size for p in (work / "model").glob("*.safetensors")) / 1e6
    print(
        f"model: Qwen3-MoE, {cfg.num_layers} layers, {cfg.num_experts} experts, "
        f"{size_mb:.0f} MB in fp32"
    )

    key, port = new_job_key(), free_port()
    url = f"http://127.0.0.1:{port}"
    env = server_env(key)
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    extra = [
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "256",
        "--skip-tokenizer-init",
        "--max-num-seqs",
        "8",
    ]
    log = open(work / "server.log", "w")  # noqa: SIM115 - closed below
    server = subprocess.Popen(
        server_command(str(work / "model"), host="127.0.0.1", port=port, extra_args=extra),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    try:
        t0 = time.perf_counter()
        wait_until_healthy([url], timeout_s=600, interval_s=1)
        print(f"server ready in {time.perf_counter() - t0:.0f} s ({url})")
        results = {}
        ctx = mp.get_context("spawn")
        for world in (int(w) for w in args.worlds.split(",")):
            queue = ctx.Queue()
            tport = free_port()
            procs = [
                ctx.Process(
                    target=trainer,
                    args=(
                        r,
                        world,
                        tport,
                        cfg,
                        url,
                        key,
                        str(sync_dir),
                        args.repeats,
                        args.bucket_mb,
                        queue,
                    ),
                )
                for r in range(world)
            ]
            for p in procs:
                p.start()
            got = queue.get(timeout=3600)
            for p in procs:
                p.join(timeout=120)
            if any(p.exitcode for p in procs):
                raise SystemExit(f"trainer at {world} rank(s) failed; see the output above")
            results[world] = got
    finally:
        os.killpg(server.pid, 15)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
        log.close()

    keys = [
        "weight_sync_gather_s",
        "weight_sync_pack_s",
        "weight_sync_transport_s",
        "weight_sync_server_load_s",
    ]
    print(
        f"\n{'layout':<8}{'path':<12}{'MB/s':>8}{'wall s':>8}  "
        + "".join(f"{k.removeprefix('weight_sync_'):>16}" for k in keys)
    )
    overall: dict[str, list[float]] = {"collective": [], "disk": []}
    for world, (_, connect_s, records) in results.items():
        for path in ("collective", "disk"):
            rows = [(wall, m) for p, wall, m in records if p == path]
            rates = [m["weight_sync_mb"] / wall for wall, m in rows]
            overall[path] += rates
            cols = "".join(f"{statistics.median(m[k] for _, m in rows):>16.3f}" for k in keys)
            print(
                f"{world} rank{'s' if world > 1 else ' '}  {path:<12}"
                f"{statistics.median(rates):>8.0f}{statistics.median(w for w, _ in rows):>8.3f}"
                f"  {cols}"
            )
        print(
            f"{world} rank{'s' if world > 1 else ' '}  first collective sync (forms the group): "
            f"{connect_s:.2f} s"
        )
    x, y = statistics.median(overall["collective"]), statistics.median(overall["disk"])
    print(f"weight_sync: collective {x:.0f} MB/s, disk {y:.0f} MB/s, ratio {x / y:.2f}")


if __name__ == "__main__":
    main()
