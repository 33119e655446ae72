"""Asynchronous rollouts: the RL loop with a vLLM server, synchronous against one step off-policy.

One CPU vLLM server (this project's extension and key) serves a small Qwen3-MoE that this
script writes; the trainer runs ``megatron-gspo train`` on the same model with the vLLM engine,
first with ``rollout.max_staleness: 0`` (sample, then train, then sync), then with ``1`` (the
next batch is sampled while the trainer trains on the current one), same recipe, same steps.
Server and trainer each get one of the machine's cores (CPU affinity, one thread each), as
the two sides of a disaggregated job get their own nodes. Throughput is samples trained per
second of wall time over the steps after the first ``--warmup``. The defaults (8 prompts x 4
samples x 64 new tokens) make sampling and training take comparable time, the case overlap is
for; when one side dominates, the gain is bounded by (sample + train) / max(sample, train).

The last line: ``async: sync <X> samples/s, staleness-1 <Y> samples/s, ratio <Y/X>``.

    python benchmarks/async_rollout.py [--steps 12] [--warmup 2]

Needs vllm (``.ci/vllm-setup.sh``) and two CPU cores.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def model_config():
    from megatron_gspo.config import ModelConfig

    return ModelConfig(
        num_layers=4,
        hidden_size=256,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=64,  # vLLM's CPU attention supports 64, not 16
        vocab_size=256,
        max_seq_length=128,
        num_experts=4,
        moe_ffn_hidden_size=256,
        moe_router_topk=2,
        moe_aux_loss_coeff=0.0,
        rotary_base=10000,
    )


def recipe(cfg, url: str, output_dir: Path, staleness: int, args) -> dict:
    return {
        "model": cfg.model_dump(),
        "data": {"task": "copy_digits", "task_options": {"min_len": 2, "max_len": 6}},
        "reward": {"functions": [{"name": "digit_match"}]},
        "rollout": {
            "engine": "vllm",
            "prompts_per_step": args.prompts,
            "group_size": args.group,
            "max_new_tokens": args.new_tokens,
            "max_staleness": staleness,
            "vllm": {"urls": [url], "bucket_mb": 64, "sync_timeout_s": 600},
        },
        "loss": {"name": "gspo", "eps_low": 0.003, "eps_high": 0.004},
        "optimizer": {"lr": 1e-3},
        "train": {"mini_batches": 2, "micro_batch_tokens": 2048},
        "memory": {"use_distributed_optimizer": False},
        "run": {
            "steps": args.steps,
            "output_dir": str(output_dir),
            "checkpoint_every": 100000,
            "plot_every": 0,
            "tensorboard": False,
        },
    }


def _mean(records: list[dict], key: str) -> float:
    return sum(r.get(key, 0.0) for r in records) / len(records)


def pinned(cpu: int):
    return lambda: os.sched_setaffinity(0, {cpu})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()

    from megatron_gspo.rollout.vllm.server_command import JOB_KEY_ENV
    from megatron_gspo.rollout.vllm.single_node import served, write_served_model

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("needs two CPU cores (one for the server, one for the trainer)")
    cfg = model_config()
    work = Path(tempfile.mkdtemp(prefix="async-rollout-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # failures print their log
    write_served_model(work / "model", cfg)

    extra = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "128"]
    extra += ["--max-num-seqs", "256"]
    rates = {}
    bind = {"VLLM_CPU_OMP_THREADS_BIND": str(cpus[1])}
    with served(work / "model", extra, env=bind, cpu=cpus[1]) as (url, key):
        trainer_env = {**os.environ, JOB_KEY_ENV: key, "OMP_NUM_THREADS": "1"}
        for staleness in (0, 1):
            run_dir = work / f"staleness-{staleness}"
            path = work / f"recipe-{staleness}.yaml"
            path.write_text(yaml.safe_dump(recipe(cfg, url, run_dir, staleness, args)))
            start = time.perf_counter()
            train_log = work / f"train-{staleness}.log"
            with open(train_log, "w") as out:
                done = subprocess.run(
                    [sys.executable, "-m", "megatron_gspo.cli", "train", str(path)],
                    env=trainer_env, preexec_fn=pinned(cpus[0]),
                    stdout=out, stderr=subprocess.STDOUT,
                )  # fmt: skip
            if done.returncode:
                tail = "\n".join(train_log.read_text().splitlines()[-30:])
                raise SystemExit(f"training with max_staleness {staleness} failed:\n{tail}")
            wall = time.perf_counter() - start
            records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
            timed = records[args.warmup :]
            seconds = sum(r["step_time_s"] for r in timed)
            samples = len(timed) * args.prompts * args.group
            rates[staleness] = samples / seconds
            print(
                f"max_staleness {staleness}: {rates[staleness]:.1f} samples/s; per step "
                f"{seconds / len(timed):.2f} s (waiting for rollouts "
                f"{_mean(timed, 'time_rollout_s'):.2f} s, training + sync "
                f"{_mean(timed, 'time_train_s'):.2f} s); staleness_max "
                f"{max(r.get('staleness_max', 0) for r in records):.0f}; "
                f"reward {records[0]['reward_mean']:.3f} -> {records[-1]['reward_mean']:.3f}; "
                f"run {wall:.0f} s"
            )
    x, y = rates[0], rates[1]
    print(f"async: sync {x:.1f} samples/s, staleness-1 {y:.1f} samples/s, ratio {y / x:.2f}")


if __name__ == "__main__":
    main()
