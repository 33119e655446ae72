"""Which nodes train and which serve, and this node's part: pure functions of the job.

Node order: the first ``trainer_nodes`` nodes of the expanded ``SLURM_JOB_NODELIST`` train,
the next ``rollout_nodes`` serve the policy, the next ``reward_nodes`` serve a reward model (a
judge: :mod:`megatron_gspo.rewards.served`). The first trainer node is the rendezvous host.
On a node that does both (a single-node job with ``rollout_gpus`` > 0) the trainer takes the
first GPUs and vLLM the last ``rollout_gpus``. A rollout node runs ``vllm_servers_per_node``
servers (one per ``vllm_tp`` GPUs) on consecutive ports from ``vllm_port``; a reward node one
server on ``reward_port``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from megatron_gspo.launch.errors import LaunchError

__all__ = ["JobLayout", "NodeAssignment", "Role", "assign_node", "job_layout", "job_nodes"]

Role = Literal["trainer", "rollout", "reward"]

VLLM_URLS_ENV = "MEGATRON_GSPO_VLLM_URLS"
REWARD_URLS_ENV = "MEGATRON_GSPO_REWARD_URLS"


@dataclass(frozen=True)
class JobLayout:
    """Which nodes train and which serve, and where they meet."""

    trainer_nodes: tuple[str, ...]
    rollout_nodes: tuple[str, ...]
    master_addr: str
    master_port: int
    vllm_port: int
    # GPUs per trainer node given to a vLLM server on the same node (single-node split).
    colocated_rollout_gpus: int = 0
    # Independent vLLM servers per serving node (each on vllm_tp GPUs, its own port): one
    # server per replica, so that each receives the weight sync itself.
    vllm_servers_per_node: int = 1
    # Nodes serving reward models, one server each on reward_port.
    reward_nodes: tuple[str, ...] = ()
    reward_port: int = 8100

    @property
    def reward_urls(self) -> list[str]:
        """Where the trainer reaches the reward servers (their roots)."""
        return [f"http://{h}:{self.reward_port}" for h in self.reward_nodes]

    @property
    def serving_nodes(self) -> tuple[str, ...]:
        return self.rollout_nodes or (self.trainer_nodes if self.colocated_rollout_gpus else ())

    @property
    def vllm_urls(self) -> list[str]:
        """Where the trainer reaches the servers: every server of every serving node."""
        return [
            f"http://{h}:{self.vllm_port + i}"
            for h in self.serving_nodes
            for i in range(self.vllm_servers_per_node)
        ]


def job_layout(
    nodes: Sequence[str],
    *,
    trainer_nodes: int | None = None,
    rollout_nodes: int = 0,
    rollout_gpus: int = 0,
    master_port: int = 29500,
    vllm_port: int = 8000,
    vllm_servers_per_node: int = 1,
    reward_nodes: int = 0,
    reward_port: int = 8100,
) -> JobLayout:
    """Split the job's nodes: the first ``trainer_nodes`` train, the next ``rollout_nodes``
    serve. ``trainer_nodes`` defaults to every node the rollout does not take; ``rollout_gpus``
    instead puts a vLLM server on each trainer node's last GPUs."""
    nodes = list(nodes)
    if not nodes:
        raise LaunchError("the job has no nodes (is SLURM_JOB_NODELIST set?)")
    if len(set(nodes)) != len(nodes):
        raise LaunchError(f"the node list repeats a node: {nodes}")
    if rollout_nodes < 0 or reward_nodes < 0:
        raise LaunchError(
            f"rollout_nodes and reward_nodes must be >= 0, got {rollout_nodes}, {reward_nodes}"
        )
    if trainer_nodes is None:
        trainer_nodes = len(nodes) - rollout_nodes - reward_nodes
    if trainer_nodes < 1:
        raise LaunchError(
            f"no node left to train: the job has {len(nodes)} node(s) and rollout takes "
            f"{rollout_nodes}"
        )
    if trainer_nodes + rollout_nodes + reward_nodes > len(nodes):
        raise LaunchError(
            f"{trainer_nodes} trainer + {rollout_nodes} rollout + {reward_nodes} reward nodes "
            f"requested, but the job has {len(nodes)}: {','.join(nodes)}"
        )
    if rollout_nodes and rollout_gpus:
        raise LaunchError(
            "rollout_gpus (vLLM beside the trainer) and rollout_nodes (vLLM on its own nodes) "
            "are two different layouts; set one"
        )
    trainers = tuple(nodes[:trainer_nodes])
    return JobLayout(
        trainer_nodes=trainers,
        rollout_nodes=tuple(nodes[trainer_nodes : trainer_nodes + rollout_nodes]),
        master_addr=trainers[0],
        master_port=master_port,
        vllm_port=vllm_port,
        colocated_rollout_gpus=rollout_gpus,
        vllm_servers_per_node=vllm_servers_per_node,
        reward_nodes=tuple(
            nodes[trainer_nodes + rollout_nodes : trainer_nodes + rollout_nodes + reward_nodes]
        ),
        reward_port=reward_port,
    )


@dataclass(frozen=True)
class NodeAssignment:
    """What one node runs."""

    role: Role
    node: str
    # Rank of this node among the nodes of its role (torchrun's --node-rank for trainers).
    node_rank: int
    # Nodes of this role (torchrun's --nnodes for trainers).
    nnodes: int
    # Processes (trainer) or GPUs (rollout) on this node.
    nproc: int
    # The GPUs this role may use on this node; None leaves CUDA_VISIBLE_DEVICES alone.
    devices: tuple[int, ...] | None = None
    env: dict[str, str] = field(default_factory=dict)


def assign_node(
    layout: JobLayout,
    node: str,
    *,
    gpus_per_node: int,
    role: Role | None = None,
    nproc_per_node: int | None = None,
    visible_devices: Sequence[str] | None = None,
) -> NodeAssignment:
    """This node's role and rank. ``role`` picks one side of a node that does both.

    ``visible_devices`` is the CUDA_VISIBLE_DEVICES Slurm set; a split node hands out entries
    of it (Slurm may give GPUs 4-7 of a shared node), not bare indices."""
    if node in layout.reward_nodes:
        if role not in (None, "reward"):
            raise LaunchError(f"node {node!r} is a reward node; it cannot take --role {role}")
        # The servers' own environment (job key) comes from rollout.vllm.server_command.
        return NodeAssignment(
            role="reward",
            node=node,
            node_rank=layout.reward_nodes.index(node),
            nnodes=len(layout.reward_nodes),
            nproc=gpus_per_node,
        )
    in_trainers = node in layout.trainer_nodes
    in_rollout = node in layout.rollout_nodes or (in_trainers and layout.colocated_rollout_gpus)
    if role == "reward":
        raise LaunchError(f"node {node!r} is not a reward node")
    if not (in_trainers or in_rollout):
        raise LaunchError(
            f"node {node!r} is in neither the trainer nodes {list(layout.trainer_nodes)} nor "
            f"the rollout nodes {list(layout.rollout_nodes)}"
        )
    if role is None:
        if in_trainers and in_rollout:
            raise LaunchError(
                f"node {node!r} both trains and serves (rollout_gpus="
                f"{layout.colocated_rollout_gpus}); start launch once per role with --role"
            )
        role = "trainer" if in_trainers else "rollout"
    if role == "trainer" and not in_trainers:
        raise LaunchError(f"node {node!r} is a rollout node; it cannot take --role trainer")
    if role == "rollout" and not in_rollout:
        raise LaunchError(f"node {node!r} is a trainer node and rollout_gpus is 0")

    split = layout.colocated_rollout_gpus
    if split and split >= gpus_per_node:
        raise LaunchError(
            f"rollout_gpus={split} leaves no GPU for the trainer on a node with "
            f"{gpus_per_node} GPUs"
        )
    if role == "trainer":
        nodes = layout.trainer_nodes
        devices = tuple(range(gpus_per_node - split)) if split else None
        usable = gpus_per_node - split
        nproc = nproc_per_node or usable or 1
        if usable and nproc > usable:
            raise LaunchError(f"nproc_per_node={nproc} exceeds the {usable} GPU(s) for training")
        env = {"MASTER_ADDR": layout.master_addr, "MASTER_PORT": str(layout.master_port)}
        if layout.vllm_urls:
            env[VLLM_URLS_ENV] = ",".join(layout.vllm_urls)
        if layout.reward_urls:
            env[REWARD_URLS_ENV] = ",".join(layout.reward_urls)
    else:
        nodes = layout.rollout_nodes or layout.trainer_nodes
        devices = tuple(range(gpus_per_node - split, gpus_per_node)) if split else None
        nproc = split or gpus_per_node
        # The servers' own environment (dev mode, job key) comes from rollout.vllm.server_command.
        env = {}
    if devices is not None:
        ids = list(visible_devices) if visible_devices else [str(i) for i in range(gpus_per_node)]
        if len(ids) < gpus_per_node:
            raise LaunchError(
                f"CUDA_VISIBLE_DEVICES lists {len(ids)} GPUs, expected {gpus_per_node}"
            )
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[i] for i in devices)
    return NodeAssignment(
        role=role,
        node=node,
        node_rank=nodes.index(node),
        nnodes=len(nodes),
        nproc=nproc,
        devices=devices,
        env=env,
    )


def job_nodes(recipe, *, trainer: int, rollout: int = 0, reward: int = 0) -> str:
    """The job's node count, as slurm/disaggregated.sbatch takes it; raises LaunchError where the
    recipe and the serving nodes disagree (a served reward with no server, reward nodes with
    nothing to serve)."""
    from megatron_gspo.rewards.served import SERVED

    served = [f for f in recipe.reward.functions if f.name in SERVED]
    if reward and not served:
        raise LaunchError(
            f"--reward-nodes {reward}, but reward.functions name no served reward "
            f"({', '.join(SERVED)}): nothing for those nodes to serve"
        )
    unnamed = [f.name for f in served if not f.kwargs.get("url")]
    if unnamed and not reward:
        raise LaunchError(
            f"reward {unnamed[0]!r} has no kwargs.url: the job must serve it on its own nodes "
            "(--reward-nodes N, REWARD_NODES=N), or the recipe name a running server"
        )
    if rollout and recipe.rollout.engine != "vllm":
        raise LaunchError(
            f"--rollout-nodes {rollout}, but rollout.engine is {recipe.rollout.engine!r}: "
            "only vllm rollouts run on their own nodes"
        )
    total = trainer + rollout + reward
    parts = [f"{trainer} trainer"] + [
        f"{n} {what}" for n, what in ((rollout, "rollout"), (reward, "reward")) if n
    ]
    env = f"NODES={total} TRAINER_NODES={trainer}"
    env += f" ROLLOUT_NODES={rollout}" if rollout else ""
    env += f" REWARD_NODES={reward}" if reward else ""
    return f"job: {' + '.join(parts)} = {total} nodes ({env})"
