"""Slurm's environment, read without Slurm: host lists, GPUs, node names, ports.

Implemented here so that role assignment needs no Slurm binary and is testable anywhere.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping

from megatron_gspo.launch.errors import LaunchError

__all__ = ["default_master_port", "expand_hostlist", "gpus_on_node", "this_node"]


def expand_hostlist(expr: str) -> list[str]:
    """Expand a Slurm host list (``gpu[01-03,7],login1``) in the order Slurm lists it.

    The same order as ``scontrol show hostnames``: ranges keep their zero padding and, with
    several bracket groups in one name, the first group varies slowest. Implemented here so
    that the role computation needs no Slurm binary and is testable anywhere.
    """
    hosts: list[str] = []
    for item in _split_top_level(expr.strip()):
        hosts.extend(_expand_one(item))
    return hosts


def _split_top_level(expr: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(expr):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise LaunchError(f"host list {expr!r}: unbalanced ']'")
        elif ch == "," and depth == 0:
            items.append(expr[start:i])
            start = i + 1
    if depth:
        raise LaunchError(f"host list {expr!r}: unbalanced '['")
    items.append(expr[start:])
    return [s for s in (x.strip() for x in items) if s]


def _expand_one(name: str) -> list[str]:
    open_ = name.find("[")
    if open_ < 0:
        return [name]
    close = name.index("]", open_)
    prefix, body, rest = name[:open_], name[open_ + 1 : close], name[close + 1 :]
    values: list[str] = []
    for part in body.split(","):
        lo, sep, hi = part.partition("-")
        if not sep:
            values.append(lo)
            continue
        if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
            raise LaunchError(f"host list range {part!r} in {name!r} is not lo-hi")
        width = len(lo)
        values.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    tails = _expand_one(rest)
    return [prefix + v + t for v in values for t in tails]


def default_master_port(job_id: str | None) -> int:
    """A rendezvous port that differs between jobs sharing a node (29500 + job id mod 1000)."""
    if job_id and job_id.isdigit():
        return 29500 + int(job_id) % 1000
    return 29500


def gpus_on_node(env: Mapping[str, str]) -> int:
    """GPUs Slurm gave this node: SLURM_GPUS_ON_NODE, else the CUDA_VISIBLE_DEVICES list."""
    if env.get("SLURM_GPUS_ON_NODE", "").isdigit():
        return int(env["SLURM_GPUS_ON_NODE"])
    visible = env.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible and visible != "NoDevFiles":
        return len([d for d in visible.split(",") if d.strip()])
    return 0


def this_node(env: Mapping[str, str]) -> str:
    """This node's name as Slurm spells it (SLURMD_NODENAME), else the short host name."""
    return env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
