"""The command lines a node runs: ``torchrun ... train`` on trainer nodes, vLLM servers on
rollout nodes (built by :mod:`megatron_gspo.rollout.vllm.server_command`, the one place that
knows how a server for this trainer is started)."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from megatron_gspo.launch.errors import LaunchError
from megatron_gspo.launch.roles import JobLayout, NodeAssignment

__all__ = ["ServerProcess", "rollout_servers", "servers_per_node", "trainer_command"]


def trainer_command(
    a: NodeAssignment,
    layout: JobLayout,
    recipe: str,
    *,
    output_dir: str | None = None,
    train_args: Sequence[str] = (),
    shutdown_timeout_s: int = 300,
    python: str = sys.executable,
) -> list[str]:
    """``torchrun`` running ``megatron-gspo train`` with this node's rendezvous.

    ``--shutdown-timeout``: when Slurm signals a whole step (scancel, requeue, pre-emption),
    torchrun gets SIGTERM alongside its workers and would SIGKILL them 30 s later; the trainer
    needs longer to finish its step and write a checkpoint.
    """
    cmd = [
        python, "-m", "torch.distributed.run",
        f"--nnodes={a.nnodes}",
        f"--node-rank={a.node_rank}",
        f"--nproc-per-node={a.nproc}",
        f"--master-addr={layout.master_addr}",
        f"--master-port={layout.master_port}",
        f"--shutdown-timeout={shutdown_timeout_s}",
        "-m", "megatron_gspo.cli", "train", recipe,
    ]  # fmt: skip
    if output_dir:
        cmd += ["--output-dir", output_dir]
    return cmd + list(train_args)


@dataclass(frozen=True)
class ServerProcess:
    cmd: list[str]
    env: dict[str, str]
    url: str


def servers_per_node(gpus: int, tensor_parallel: int | None) -> int:
    """vLLM servers on a node with ``gpus`` GPUs for it: one per ``tensor_parallel`` GPUs."""
    gpus = max(gpus, 1)
    tp = tensor_parallel or gpus
    if gpus % tp:
        raise LaunchError(f"vLLM tensor_parallel={tp} does not divide the node's {gpus} GPU(s)")
    return gpus // tp


def rollout_servers(
    a: NodeAssignment,
    layout: JobLayout,
    model: str,
    *,
    key: str,
    tensor_parallel: int | None = None,
    served_model_name: str | None = None,
    vllm_args: Sequence[str] = (),
    base_env: Mapping[str, str] | None = None,
    python: str = sys.executable,
    return_routes: bool = False,
    weight_transfer: str = "gspo",
    dtype: str | None = None,
) -> list[ServerProcess]:
    """One vLLM server per ``tensor_parallel`` GPUs of this node, on consecutive ports.

    Independent servers rather than vLLM's ``--data-parallel-size``: the weight sync gives each
    server's workers group ranks of their own, and versions and pauses stay per URL. Each
    server listens on this node's own address (the one the trainer reaches it at), never on
    every interface, and needs the job key.
    """
    from megatron_gspo.rollout.vllm.server_command import server_command, server_env

    gpus = max(a.nproc, 1)
    n = servers_per_node(gpus, tensor_parallel)
    tp = gpus // n
    devices = (
        list(a.env["CUDA_VISIBLE_DEVICES"].split(",")) if "CUDA_VISIBLE_DEVICES" in a.env else None
    )
    out = []
    for i in range(n):
        port = layout.vllm_port + i
        try:
            env = server_env(key, {**(base_env or {}), **a.env}, return_routes=return_routes)
        except ValueError as e:
            raise LaunchError(str(e)) from None
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devices[i * tp : (i + 1) * tp])
        elif n > 1:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in range(i * tp, (i + 1) * tp))
        cmd = server_command(
            model,
            host=a.node,
            port=port,
            tensor_parallel=tp,
            served_model_name=served_model_name,
            extra_args=vllm_args,
            python=python,
            return_routes=return_routes,
            weight_transfer=weight_transfer,
            dtype=dtype,
        )
        out.append(ServerProcess(cmd, env, f"http://{a.node}:{port}"))
    return out


def reward_server(
    a: NodeAssignment,
    layout: JobLayout,
    model: str,
    *,
    key: str,
    base_env: Mapping[str, str] | None = None,
    pooling: bool = False,
    python: str = sys.executable,
) -> ServerProcess:
    """The reward node's vLLM server on all its GPUs, on ``layout.reward_port`` of its own
    address, needing the job key; ``pooling``: a scalar reward model (its /classify route)
    rather than a judge (its chat completions)."""
    from megatron_gspo.rollout.vllm.server_command import server_command, server_env

    try:
        env = server_env(key, {**(base_env or {}), **a.env})
    except ValueError as e:
        raise LaunchError(str(e)) from None
    extra = ["--runner", "pooling"] if pooling else []
    cmd = server_command(
        model,
        host=a.node,
        port=layout.reward_port,
        tensor_parallel=max(a.nproc, 1),
        served_model_name=model,
        extra_args=extra,
        python=python,
        weight_transfer=None,
    )
    return ServerProcess(cmd, env, f"http://{a.node}:{layout.reward_port}")
