"""Weight sync into a running vLLM server: in memory (collective) against disk, in one run.

Starts one CPU vLLM server (the project's weight transfer engine and key, as ``launch`` starts
them) on a Qwen3-MoE of ~235 MB in fp32 that this script writes itself, then, with the trainer
at 1 rank and at 2 ranks (expert parallel: rank 0 gathers the other half of the experts),
alternates collective and disk syncs of the trainer's weights through vLLM's RL API and
prints, per path and layout, the median over the repeats of the throughput (bytes synced / wall
time of the whole sync, from ``/pause`` to ``/resume``) and of its breakdown: gather (trainer
shards to full tensors on rank 0; for disk: gather and write), pack (into buckets), transport
(waiting for the broadcasts), server (``/update_weights``: receiving and ``load_weights``),
start and finish (``/start_weight_update`` and ``/finish_weight_update``: vLLM's layerwise
reload set up and completed, MoE prepack included), and the share of start and finish in the
wall time.

The last line is the median over every sync of both layouts:
``weight_sync: collective <X> MB/s, disk <Y> MB/s, ratio <X/Y>``.

    python benchmarks/weight_sync.py [--repeats 5] [--sync-dir DIR] [--layers 8] [--bucket-mb 64]

The disk path writes to ``--sync-dir`` (default: a temporary directory on this machine's local
disk, which the page cache makes as fast as a disk path can be; a cluster's shared filesystem
is slower). Needs vllm (``.ci/vllm-setup.sh``).
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import statistics
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
    from benchmarks._ranks import join_world

    join_world(rank, world, port)
    import torch.distributed as dist

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

    from benchmarks._ranks import run_ranks
    from megatron_gspo.rollout.vllm.single_node import served, write_served_model

    cfg = model_config(args.layers)
    work = Path(tempfile.mkdtemp(prefix="weight-sync-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    sync_dir = Path(args.sync_dir or work / "sync")
    sync_dir.mkdir(parents=True, exist_ok=True)
    write_served_model(work / "model", cfg)
    size_mb = sum(p.stat().st_size for p in (work / "model").glob("*.safetensors")) / 1e6
    print(
        f"model: Qwen3-MoE, {cfg.num_layers} layers, {cfg.num_experts} experts, "
        f"{size_mb:.0f} MB in fp32"
    )

    extra = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "256"]
    extra += ["--max-num-seqs", "8"]
    with served(work / "model", extra) as (url, key):
        results = {}
        for world in (int(w) for w in args.worlds.split(",")):
            got = run_ranks(
                trainer, world, cfg, url, key, str(sync_dir), args.repeats, args.bucket_mb
            )
            results[world] = got

    keys = [
        "weight_sync_gather_s",
        "weight_sync_pack_s",
        "weight_sync_transport_s",
        "weight_sync_server_s",
        "weight_sync_start_s",
        "weight_sync_finish_s",
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
            reload = statistics.median(
                (m["weight_sync_start_s"] + m["weight_sync_finish_s"]) / wall for wall, m in rows
            )
            print(
                f"{world} rank{'s' if world > 1 else ' '}  {path:<12}"
                f"{statistics.median(rates):>8.0f}{statistics.median(w for w, _ in rows):>8.3f}"
                f"  {cols}   reload share {reload:.0%}"
            )
        print(
            f"{world} rank{'s' if world > 1 else ' '}  first collective sync (forms the group): "
            f"{connect_s:.2f} s"
        )
    x, y = statistics.median(overall["collective"]), statistics.median(overall["disk"])
    print(f"weight_sync: collective {x:.0f} MB/s, disk {y:.0f} MB/s, ratio {x / y:.2f}")


if __name__ == "__main__":
    main()
