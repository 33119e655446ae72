"""``megatron-gspo launch``: start this node's part of a Slurm job (see :mod:`.cli`)."""

from megatron_gspo.launch.cli import launch
from megatron_gspo.launch.commands import (
    ServerProcess,
    rollout_servers,
    servers_per_node,
    trainer_command,
)
from megatron_gspo.launch.errors import LaunchError
from megatron_gspo.launch.processes import run_forwarding_term, wait_for_servers
from megatron_gspo.launch.roles import JobLayout, NodeAssignment, assign_node, job_layout
from megatron_gspo.launch.slurm import (
    default_master_port,
    expand_hostlist,
    gpus_on_node,
    this_node,
)

__all__ = [
    "JobLayout",
    "LaunchError",
    "NodeAssignment",
    "ServerProcess",
    "assign_node",
    "default_master_port",
    "expand_hostlist",
    "gpus_on_node",
    "job_layout",
    "launch",
    "rollout_servers",
    "run_forwarding_term",
    "servers_per_node",
    "this_node",
    "trainer_command",
    "wait_for_servers",
]
