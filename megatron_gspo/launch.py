"""``megatron-gspo launch``: one process per node that starts what this node is for.

A Slurm job for GSPO has two kinds of nodes: trainer nodes, which run the Megatron policy under
``torchrun``, and rollout nodes, which run ``vllm serve``. The sbatch recipes in ``slurm/`` start
``launch`` once per node and this module decides, from the job's node list and two counts, which
role the node has, what its rank is, where the rendezvous is and which URLs the trainer reaches
the servers at. That decision is a pure function of the Slurm environment (``job_layout``,
``assign_node``), so it is tested from dictionaries without a cluster; the side effects (health
checks, starting and signalling processes) sit at the bottom of the file.

Node order: the first ``trainer_nodes`` nodes of the expanded ``SLURM_JOB_NODELIST`` train, the
next ``rollout_nodes`` serve. The first trainer node is the rendezvous host. On a node that does
both (a single-node job with ``rollout_gpus`` > 0) the trainer takes the first GPUs and vLLM the
last ``rollout_gpus``.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import click

Role = Literal["trainer", "rollout"]

VLLM_URLS_ENV = "MEGATRON_GSPO_VLLM_URLS"


class LaunchError(ValueError):
    """The allocation cannot host the requested layout; the message says what to change."""


# --------------------------------------------------------------------------------------------
# Slurm's environment, read without Slurm.


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


# --------------------------------------------------------------------------------------------
# The layout of the whole job, and this node's part in it.


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

    @property
    def vllm_urls(self) -> list[str]:
        """Where the trainer reaches the servers: one per rollout node, or per trainer node
        that also serves."""
        hosts = self.rollout_nodes or (self.trainer_nodes if self.colocated_rollout_gpus else ())
        return [f"http://{h}:{self.vllm_port}" for h in hosts]


def job_layout(
    nodes: Sequence[str],
    *,
    trainer_nodes: int | None = None,
    rollout_nodes: int = 0,
    rollout_gpus: int = 0,
    master_port: int = 29500,
    vllm_port: int = 8000,
) -> JobLayout:
    """Split the job's nodes: the first ``trainer_nodes`` train, the next ``rollout_nodes``
    serve. ``trainer_nodes`` defaults to every node the rollout does not take; ``rollout_gpus``
    instead puts a vLLM server on each trainer node's last GPUs."""
    nodes = list(nodes)
    if not nodes:
        raise LaunchError("the job has no nodes (is SLURM_JOB_NODELIST set?)")
    if len(set(nodes)) != len(nodes):
        raise LaunchError(f"the node list repeats a node: {nodes}")
    if rollout_nodes < 0:
        raise LaunchError(f"rollout_nodes must be >= 0, got {rollout_nodes}")
    if trainer_nodes is None:
        trainer_nodes = len(nodes) - rollout_nodes
    if trainer_nodes < 1:
        raise LaunchError(
            f"no node left to train: the job has {len(nodes)} node(s) and rollout takes "
            f"{rollout_nodes}"
        )
    if trainer_nodes + rollout_nodes > len(nodes):
        raise LaunchError(
            f"{trainer_nodes} trainer + {rollout_nodes} rollout nodes requested, but the job "
            f"has {len(nodes)}: {','.join(nodes)}"
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
    in_trainers = node in layout.trainer_nodes
    in_rollout = node in layout.rollout_nodes or (in_trainers and layout.colocated_rollout_gpus)
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
    else:
        nodes = layout.rollout_nodes or layout.trainer_nodes
        devices = tuple(range(gpus_per_node - split, gpus_per_node)) if split else None
        nproc = split or gpus_per_node
        # The trainer's weight sync calls /collective_rpc (reload_weights), which vLLM only
        # serves in its development mode (see megatron_gspo/rollout/vllm.py).
        env = {"VLLM_SERVER_DEV_MODE": "1"}
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


# --------------------------------------------------------------------------------------------
# Commands.


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


def rollout_command(
    a: NodeAssignment,
    layout: JobLayout,
    model: str,
    *,
    tensor_parallel: int | None = None,
    served_model_name: str | None = None,
    vllm_args: Sequence[str] = (),
) -> list[str]:
    """``vllm serve`` on this node's GPUs: tensor parallel within a replica, data parallel
    across replicas, so one server per node exposes every GPU behind one URL."""
    gpus = max(a.nproc, 1)
    tp = tensor_parallel or gpus
    if gpus % tp:
        raise LaunchError(f"vLLM tensor_parallel={tp} does not divide the node's {gpus} GPU(s)")
    cmd = ["vllm", "serve", model, "--host", "0.0.0.0", "--port", str(layout.vllm_port)]
    cmd += ["--tensor-parallel-size", str(tp)]
    if gpus // tp > 1:
        cmd += ["--data-parallel-size", str(gpus // tp)]
    if served_model_name:
        cmd += ["--served-model-name", served_model_name]
    return cmd + list(vllm_args)


# --------------------------------------------------------------------------------------------
# Side effects: health checks and running the command with signals forwarded.


def wait_for_servers(
    urls: Sequence[str], *, timeout_s: float, interval_s: float = 5.0, log=print
) -> None:
    """Block until every server answers ``GET /health`` with 200; vLLM only does once the
    model is loaded, so a trainer that starts after this never sees a refused connection."""
    pending = list(urls)
    deadline = time.monotonic() + timeout_s
    last_report = 0.0
    while pending:
        still = []
        for url in pending:
            try:
                with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=5) as r:
                    ok = r.status == 200
            except (urllib.error.URLError, OSError):
                ok = False
            if not ok:
                still.append(url)
        pending = still
        if not pending:
            break
        now = time.monotonic()
        if now >= deadline:
            raise LaunchError(
                f"rollout servers not healthy after {timeout_s:.0f}s: {', '.join(pending)} "
                "(see the rollout logs)"
            )
        if now - last_report >= 60:
            log(f"launch: waiting for {len(pending)} rollout server(s): {', '.join(pending)}")
            last_report = now
        time.sleep(interval_s)
    log(f"launch: {len(urls)} rollout server(s) healthy")


def _run_forwarding_term(cmd: list[str], env: dict[str, str], *, workers_only: bool) -> int:
    """Run ``cmd`` and pass SIGTERM/SIGINT on; returns its exit status.

    With ``workers_only`` (torchrun) the signal goes to torchrun's children, the trainer
    ranks, and not to torchrun: the ranks checkpoint and exit 0, and torchrun then exits 0 as
    it would after any successful run. Signalling torchrun itself starts its shutdown timer.
    """
    import psutil

    proc = subprocess.Popen(cmd, env=env)

    def forward(signum: int, _frame) -> None:
        click.echo(f"launch: got {signal.Signals(signum).name}, forwarding", err=True)
        targets = []
        if workers_only:
            try:
                targets = psutil.Process(proc.pid).children(recursive=False)
            except psutil.NoSuchProcess:
                targets = []
        for p in targets or [proc]:
            try:
                p.send_signal(signum)
            except (psutil.NoSuchProcess, ProcessLookupError):
                pass

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            try:
                return proc.wait()
            except InterruptedError:  # pragma: no cover - PEP 475 retries wait() itself
                continue
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# --------------------------------------------------------------------------------------------
# The command.


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.argument("train_args", nargs=-1, type=click.UNPROCESSED)
@click.option(
    "--role",
    type=click.Choice(["auto", "trainer", "rollout"]),
    default="auto",
    show_default=True,
    help="Which side to run; auto decides from the node list (needed only on a node that "
    "both trains and serves).",
)
@click.option("--trainer-nodes", type=int, default=None, help="Default: the nodes left over.")
@click.option("--rollout-nodes", type=int, default=0, show_default=True)
@click.option(
    "--rollout-gpus",
    type=int,
    default=0,
    show_default=True,
    help="On a node that trains, give its last N GPUs to a vLLM server (single-node split).",
)
@click.option("--nodelist", default=None, help="Default: $SLURM_JOB_NODELIST.")
@click.option("--node", default=None, help="This node's name. Default: $SLURMD_NODENAME.")
@click.option("--gpus-per-node", type=int, default=None, help="Default: what Slurm gave.")
@click.option("--nproc-per-node", type=int, default=None, help="Default: the trainer's GPUs.")
@click.option("--master-port", type=int, default=None, help="Default: 29500 + job id mod 1000.")
@click.option("--vllm-port", type=int, default=8000, show_default=True)
@click.option("--vllm-model", default=None, help="HF model path to serve. Default: recipe's.")
@click.option("--vllm-tp", type=int, default=None, help="vLLM tensor parallel (default: all).")
@click.option("--vllm-args", default="", help="Extra `vllm serve` arguments, shell-quoted.")
@click.option("--output-dir", default=None, help="Passed to `train --output-dir`.")
@click.option(
    "--shutdown-timeout",
    type=int,
    default=300,
    show_default=True,
    help="Seconds torchrun waits for the ranks after a SIGTERM before killing them.",
)
@click.option(
    "--rollout-wait",
    type=float,
    default=1800.0,
    show_default=True,
    help="Seconds the trainer waits for the vLLM servers' /health.",
)
@click.option("--dry-run", is_flag=True, help="Print this node's command and exit.")
def launch(
    recipe: str,
    train_args: tuple[str, ...],
    role: str,
    trainer_nodes: int | None,
    rollout_nodes: int,
    rollout_gpus: int,
    nodelist: str | None,
    node: str | None,
    gpus_per_node: int | None,
    nproc_per_node: int | None,
    master_port: int | None,
    vllm_port: int,
    vllm_model: str | None,
    vllm_tp: int | None,
    vllm_args: str,
    output_dir: str | None,
    shutdown_timeout: int,
    rollout_wait: float,
    dry_run: bool,
) -> None:
    """Start this node's part of a Slurm job: `torchrun ... train RECIPE` on trainer nodes,
    `vllm serve` on rollout nodes. Arguments after RECIPE go to `train` (e.g. --steps 10)."""
    from megatron_gspo.config import RecipeError, load_recipe

    env = dict(os.environ)
    try:
        r = load_recipe(recipe)
        nodes = expand_hostlist(nodelist or env.get("SLURM_JOB_NODELIST") or this_node(env))
        layout = job_layout(
            nodes,
            trainer_nodes=trainer_nodes,
            rollout_nodes=rollout_nodes,
            rollout_gpus=rollout_gpus,
            master_port=master_port or default_master_port(env.get("SLURM_JOB_ID")),
            vllm_port=vllm_port,
        )
        a = assign_node(
            layout,
            node or this_node(env),
            gpus_per_node=gpus_on_node(env) if gpus_per_node is None else gpus_per_node,
            role=None if role == "auto" else role,  # type: ignore[arg-type]
            nproc_per_node=nproc_per_node,
            visible_devices=[d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d],
        )
        if a.role == "trainer":
            if layout.vllm_urls and r.rollout.engine != "vllm":
                raise LaunchError(
                    f"{recipe}: the job starts vLLM servers but rollout.engine is "
                    f"{r.rollout.engine!r}; set rollout.engine: vllm or drop the rollout nodes"
                )
            cmd = trainer_command(
                a,
                layout,
                recipe,
                output_dir=output_dir,
                train_args=train_args,
                shutdown_timeout_s=shutdown_timeout,
            )
        else:
            model = vllm_model or r.rollout.vllm.model
            if not model:
                raise LaunchError(
                    "a rollout node needs the model to serve: --vllm-model PATH (a Hugging "
                    "Face checkpoint directory) or rollout.vllm.model in the recipe"
                )
            cmd = rollout_command(
                a,
                layout,
                model,
                tensor_parallel=vllm_tp,
                served_model_name=r.rollout.vllm.model if vllm_model else None,
                vllm_args=shlex.split(vllm_args),
            )
    except (RecipeError, LaunchError) as e:
        raise click.ClickException(str(e)) from None

    summary = (
        f"launch: node {a.node} role={a.role} node_rank={a.node_rank}/{a.nnodes} "
        f"nproc={a.nproc} master={layout.master_addr}:{layout.master_port}"
    )
    click.echo(summary, err=True)
    for k, v in sorted(a.env.items()):
        click.echo(f"{k}={v}")
    click.echo(shlex.join(cmd))
    if dry_run:
        return
    sys.stdout.flush()
    if a.role == "trainer" and layout.vllm_urls:
        try:
            wait_for_servers(layout.vllm_urls, timeout_s=rollout_wait, log=click.echo)
        except LaunchError as e:
            raise click.ClickException(str(e)) from None
    rc = _run_forwarding_term(cmd, {**env, **a.env}, workers_only=a.role == "trainer")
    sys.exit(rc)
