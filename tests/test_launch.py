"""``megatron-gspo launch``: roles, ranks and rendezvous from fake Slurm environments."""

from __future__ import annotations

import http.server
import json
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from megatron_gspo.launch import (
    LaunchError,
    assign_node,
    default_master_port,
    expand_hostlist,
    gpus_on_node,
    job_layout,
    launch,
    rollout_servers,
    trainer_command,
    wait_for_servers,
)

REPO = Path(__file__).resolve().parents[1]
MOE = str(REPO / "recipes" / "qwen3-30b-a3b-gspo.yaml")
TINY = str(REPO / "recipes" / "tiny-moe.yaml")
JUDGE = str(REPO / "recipes" / "qwen3-30b-a3b-judge.yaml")


@pytest.mark.parametrize(
    "expr,expected",
    [
        ("node1", ["node1"]),
        ("gpu[01-03,7]", ["gpu01", "gpu02", "gpu03", "gpu7"]),
        ("a[1-2]b[3-4],login", ["a1b3", "a1b4", "a2b3", "a2b4", "login"]),
        ("x-[098-101]", ["x-098", "x-099", "x-100", "x-101"]),
    ],
)
def test_hostlist_expands_in_slurm_order(expr, expected):
    assert expand_hostlist(expr) == expected


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="scontrol is not installed")
def test_hostlist_matches_scontrol():
    expr = "rack[1-2]-gpu[008-010,12],cpu5"
    out = subprocess.run(
        ["scontrol", "show", "hostnames", expr], capture_output=True, text=True, check=True
    ).stdout.split()
    assert expand_hostlist(expr) == out


@pytest.mark.parametrize("bad", ["gpu[1-3", "gpu1-3]", "gpu[3-1]"])
def test_hostlist_refuses_malformed(bad):
    with pytest.raises(LaunchError):
        expand_hostlist(bad)


def _env(nodelist: str, node: str, **extra: str) -> dict[str, str]:
    return {
        "SLURM_JOB_NODELIST": nodelist,
        "SLURMD_NODENAME": node,
        "SLURM_JOB_ID": "123456",
        "SLURM_GPUS_ON_NODE": "8",
        **extra,
    }


def _assign(env: dict[str, str], **layout_kw):
    role = layout_kw.pop("role", None)
    nproc = layout_kw.pop("nproc_per_node", None)
    layout = job_layout(
        expand_hostlist(env["SLURM_JOB_NODELIST"]),
        master_port=default_master_port(env.get("SLURM_JOB_ID")),
        **layout_kw,
    )
    return layout, assign_node(
        layout,
        env["SLURMD_NODENAME"],
        gpus_per_node=gpus_on_node(env),
        role=role,
        nproc_per_node=nproc,
        visible_devices=[d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d],
    )


def test_disaggregated_trainer_node_gets_its_rank_and_the_server_urls():
    layout, a = _assign(_env("gpu[01-06]", "gpu03"), rollout_nodes=2)
    assert a.role == "trainer" and (a.node_rank, a.nnodes, a.nproc) == (2, 4, 8)
    assert layout.master_addr == "gpu01" and layout.master_port == 29500 + 456
    assert a.env["MEGATRON_GSPO_VLLM_URLS"] == "http://gpu05:8000,http://gpu06:8000"
    assert a.env["MASTER_ADDR"] == "gpu01" and "CUDA_VISIBLE_DEVICES" not in a.env


def test_disaggregated_rollout_node_serves_on_all_its_gpus():
    _, a = _assign(_env("gpu[01-06]", "gpu06"), rollout_nodes=2)
    assert a.role == "rollout" and (a.node_rank, a.nnodes, a.nproc) == (1, 2, 8)


def test_explicit_trainer_count_leaves_spare_nodes_idle():
    layout = job_layout(["n1", "n2", "n3", "n4"], trainer_nodes=2, rollout_nodes=1)
    assert layout.trainer_nodes == ("n1", "n2") and layout.rollout_nodes == ("n3",)
    with pytest.raises(LaunchError, match="neither"):
        assign_node(layout, "n4", gpus_per_node=8)


def test_single_node_split_hands_out_slurms_device_ids():
    env = _env("gpu07", "gpu07", CUDA_VISIBLE_DEVICES="8,9,10,11,12,13,14,15")
    layout, trainer = _assign(env, rollout_gpus=2, role="trainer")
    _, rollout = _assign(env, rollout_gpus=2, role="rollout")
    assert trainer.nproc == 6 and trainer.env["CUDA_VISIBLE_DEVICES"] == "8,9,10,11,12,13"
    assert rollout.nproc == 2 and rollout.env["CUDA_VISIBLE_DEVICES"] == "14,15"
    assert trainer.env["MEGATRON_GSPO_VLLM_URLS"] == "http://gpu07:8000"
    with pytest.raises(LaunchError, match="--role"):
        _assign(env, rollout_gpus=2)


def test_cpu_node_runs_one_trainer_process_by_default():
    env = {"SLURM_JOB_NODELIST": "cpu1", "SLURMD_NODENAME": "cpu1"}
    layout, a = _assign(env)
    assert (a.role, a.nproc, a.nnodes) == ("trainer", 1, 1) and not layout.vllm_urls
    assert layout.master_port == 29500


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(rollout_nodes=6), "no node left to train"),
        (dict(trainer_nodes=5, rollout_nodes=2), "the job has 6"),
        (dict(rollout_nodes=1, rollout_gpus=2), "two different layouts"),
    ],
)
def test_layouts_the_allocation_cannot_host_are_refused(kwargs, match):
    with pytest.raises(LaunchError, match=match):
        job_layout(expand_hostlist("gpu[01-06]"), **kwargs)


def test_more_processes_than_gpus_is_refused():
    with pytest.raises(LaunchError, match="exceeds"):
        _assign(_env("gpu01", "gpu01"), nproc_per_node=9)


def test_trainer_command_is_torchrun_with_this_nodes_rendezvous():
    layout, a = _assign(_env("gpu[01-06]", "gpu02"), rollout_nodes=2)
    cmd = trainer_command(a, layout, "r.yaml", output_dir="runs/x", train_args=["--steps", "3"])
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    for flag in [
        "--nnodes=4",
        "--node-rank=1",
        "--nproc-per-node=8",
        "--master-addr=gpu01",
        f"--master-port={29500 + 456}",
    ]:
        assert flag in cmd, (flag, cmd)
    tail = cmd[cmd.index("megatron_gspo.cli") :]
    assert tail == ["megatron_gspo.cli", "train", "r.yaml", "--output-dir", "runs/x"] + [
        "--steps",
        "3",
    ]


def test_rollout_node_runs_one_server_per_tensor_parallel_group_on_its_own_address():
    layout, a = _assign(_env("gpu[01-03]", "gpu03"), rollout_nodes=1, vllm_servers_per_node=2)
    servers = rollout_servers(
        a, layout, "ckpt/Qwen3", key="k3y", tensor_parallel=4, weight_transfer="nccl",
        dtype="bfloat16",
    )  # fmt: skip
    assert [s.url for s in servers] == ["http://gpu03:8000", "http://gpu03:8001"]
    assert layout.vllm_urls == [s.url for s in servers], "the trainer looks elsewhere"
    for i, s in enumerate(servers):
        cmd = s.cmd
        assert cmd[1:3] == ["-m", "vllm.entrypoints.launchers.api_server.entry"]
        assert cmd[cmd.index("--model") + 1] == "ckpt/Qwen3"
        assert cmd[cmd.index("--tensor-parallel-size") + 1] == "4"
        assert "--data-parallel-size" not in cmd, "replicas behind one URL miss the weight sync"
        # The job's address only, never every interface.
        assert cmd[cmd.index("--host") + 1] == "gpu03" and "0.0.0.0" not in cmd
        assert cmd[cmd.index("--port") + 1] == str(8000 + i)
        # The sync goes through vLLM's RL API, its NCCL engine between GPUs.
        assert json.loads(cmd[cmd.index("--weight-transfer-config") + 1]) == {"backend": "nccl"}
        assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
        assert cmd[cmd.index("--middleware") + 1].endswith("JobKeyMiddleware")
        # The key sits in the environment: a command line is readable by every user.
        assert "k3y" not in " ".join(cmd) and s.env["VLLM_API_KEY"] == "k3y"
        assert s.env["VLLM_SERVER_DEV_MODE"] == "1"
        assert s.env["CUDA_VISIBLE_DEVICES"] == ",".join(str(d) for d in range(4 * i, 4 * i + 4))
    with pytest.raises(LaunchError, match="does not divide"):
        rollout_servers(a, layout, "m", key="k", tensor_parallel=3)


def test_dry_run_prints_the_command_and_environment():
    env = _env("gpu[01-06]", "gpu04", MEGATRON_GSPO_VLLM_KEY="s3cret")
    result = CliRunner().invoke(
        launch, [MOE, "--rollout-nodes", "2", "--dry-run", "--steps", "5"], env=env
    )
    assert result.exit_code == 0, result.output
    assert "MEGATRON_GSPO_VLLM_URLS=http://gpu05:8000,http://gpu06:8000" in result.output
    assert "--node-rank=3" in result.output and "--steps 5" in result.output
    rollout = CliRunner().invoke(
        launch,
        [MOE, "--rollout-nodes", "2", "--dry-run"],
        env={**env, "SLURMD_NODENAME": "gpu05"},
    )
    assert rollout.exit_code == 0, rollout.output
    assert "--model checkpoints/Qwen3-30B-A3B --host gpu05 --port 8000" in rollout.output
    assert "VLLM_API_KEY=<job key>" in rollout.output and "s3cret" not in rollout.output


def test_a_cpu_rollout_node_serves_the_recipes_shape_with_vllm_cpus_arguments(tmp_path):
    """slurm/cpu_vllm.sbatch's rollout node: no GPU, no checkpoint to serve."""
    recipe = str(REPO / "recipes" / "tiny-multi-turn-vllm.yaml")
    env = {**_env("cpu[01-03]", "cpu03", MEGATRON_GSPO_VLLM_KEY="k" * 64)}
    del env["SLURM_GPUS_ON_NODE"]
    args = [recipe, "--rollout-nodes", "2", "--role", "rollout", "--dry-run"]
    missing = CliRunner().invoke(launch, args, env=env)
    assert missing.exit_code != 0 and "--vllm-model-from-recipe" in missing.output
    served = tmp_path / "served"
    result = CliRunner().invoke(launch, [*args, "--vllm-model-from-recipe", str(served)], env=env)
    assert result.exit_code == 0, result.output
    assert f"--model {served / 'cpu03'} --host cpu03 --port 8000" in result.output
    for arg in ["--dtype float32", "--enforce-eager", "--max-model-len 64"]:
        assert arg in result.output, result.output
    assert "--dtype bfloat16" not in result.output
    assert not served.exists(), "a dry run wrote the model"


def test_reward_nodes_serve_the_recipes_judge_and_the_trainer_gets_their_urls(tmp_path):
    env = _env("gpu[01-07]", "gpu01", MEGATRON_GSPO_VLLM_KEY="s3cret")
    args = [JUDGE, "--rollout-nodes", "2", "--reward-nodes", "1", "--dry-run"]
    trainer = CliRunner().invoke(launch, args, env=env)
    assert trainer.exit_code == 0, trainer.output
    assert "MEGATRON_GSPO_REWARD_URLS=http://gpu07:8100" in trainer.output
    assert "MEGATRON_GSPO_VLLM_URLS=http://gpu05:8000,http://gpu06:8000" in trainer.output
    judge = CliRunner().invoke(launch, args, env={**env, "SLURMD_NODENAME": "gpu07"})
    assert judge.exit_code == 0, judge.output
    assert "role=reward" in judge.output
    assert "--model checkpoints/Qwen3-32B --host gpu07 --port 8100" in judge.output
    assert "--tensor-parallel-size 8" in judge.output and "--runner" not in judge.output
    # The job's key guards it; nobody syncs weights into it.
    assert "VLLM_API_KEY=<job key>" in judge.output and "s3cret" not in judge.output
    assert "--weight-transfer-config" not in judge.output
    # A scalar reward model goes to vLLM's pooling runner.
    rm = tmp_path / "rm.yaml"
    rm.write_text(Path(JUDGE).read_text().replace("name: judge", "name: reward_model"))
    served = CliRunner().invoke(
        launch,
        [str(rm), "--rollout-nodes", "2", "--reward-nodes", "1", "--dry-run",
         "--reward-model", "checkpoints/Skywork-Reward"],
        env={**env, "SLURMD_NODENAME": "gpu07"},
    )  # fmt: skip
    assert served.exit_code == 0, served.output
    assert "--model checkpoints/Skywork-Reward" in served.output
    assert "--runner pooling" in served.output
    # Reward nodes and a recipe with nothing to serve on them.
    nothing = CliRunner().invoke(
        launch, [MOE, "--reward-nodes", "1", "--dry-run"], env={**env, "SLURMD_NODENAME": "gpu07"}
    )
    assert nothing.exit_code != 0 and "no served reward" in nothing.output


def test_a_job_with_servers_but_no_key_is_refused():
    for node in ("gpu04", "gpu05"):
        result = CliRunner().invoke(
            launch, [MOE, "--rollout-nodes", "2", "--dry-run"], env=_env("gpu[01-06]", node)
        )
        assert result.exit_code != 0 and "MEGATRON_GSPO_VLLM_KEY" in result.output, node


def test_rollout_nodes_with_an_embedded_engine_recipe_are_refused():
    result = CliRunner().invoke(
        launch, [TINY, "--rollout-nodes", "1", "--dry-run"], env=_env("n[1-2]", "n1")
    )
    assert result.exit_code != 0 and "rollout.engine" in result.output


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the name http.server calls
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_wait_for_servers_returns_once_healthy_and_times_out_otherwise():
    server = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        wait_for_servers([f"http://127.0.0.1:{server.server_port}"], timeout_s=10, log=lambda m: 0)
    finally:
        server.shutdown()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    with pytest.raises(LaunchError, match="not healthy"):
        wait_for_servers(
            [f"http://127.0.0.1:{closed}"], timeout_s=0.5, interval_s=0.1, log=lambda m: 0
        )


def test_sigterm_reaches_the_ranks_and_not_torchrun(tmp_path):
    """A stand-in torchrun that dies on SIGTERM, with one rank that checkpoints on it: only
    the rank may get the signal, so the launcher exits 0 with the rank's checkpoint."""
    agent = tmp_path / "agent.py"
    agent.write_text(
        textwrap.dedent(
            f"""
            import subprocess, sys
            rank = subprocess.Popen([sys.executable, "-c", '''
            import pathlib, signal, sys, time
            def stop(*_):
                pathlib.Path({str(tmp_path / "saved")!r}).write_text("ok")
                sys.exit(0)
            signal.signal(signal.SIGTERM, stop)
            pathlib.Path({str(tmp_path / "ready")!r}).write_text("")
            time.sleep(60)
            sys.exit(1)
            '''])
            sys.exit(rank.wait())
            """
        )
    )
    driver = textwrap.dedent(
        f"""
        import os, pathlib, signal, sys, threading, time
        from megatron_gspo.launch import run_forwarding_term
        def later():
            while not pathlib.Path({str(tmp_path / "ready")!r}).exists():
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGTERM)
        threading.Thread(target=later, daemon=True).start()
        sys.exit(run_forwarding_term([([sys.executable, {str(agent)!r}], dict(os.environ))],
                                     workers_only=True))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", driver], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "saved").read_text() == "ok"
