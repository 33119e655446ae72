"""vLLM servers for tests (CPU build), and the checks that a server computes what the trainer
does."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest
import torch

from megatron_gspo.config import ParallelConfig, VLLMConfig
from megatron_gspo.rollout import RolloutRequest, SamplingParams
from megatron_gspo.rollout.vllm import (
    VLLMClient,
    VLLMEngine,
    VLLMUnavailableError,
    wait_until_healthy,
)
from megatron_gspo.rollout.vllm.server_command import on_ready_hook
from tests.support.ranks import run_distributed
from tests.support.runs import train_run
from tests.support.vllm_tiny import (
    VLLMServer,
)

requires_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm is not installed (see .ci/vllm-setup.sh for the vLLM test environment)",
)


SERVER_START_TIMEOUT_S = 300


# fp32 on both sides; measured differences are ~1e-6 (different kernels and summation order).
LOGPROB_ATOL = 1e-4


PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14, 15], [20]]


def start_server(model_dir: Path, log: Path, request, **server) -> VLLMServer:
    srv = VLLMServer(model_dir, log, **server)
    start = time.monotonic()
    try:
        wait_until_healthy([srv.url], timeout_s=SERVER_START_TIMEOUT_S, interval_s=1.0)
    except VLLMUnavailableError as e:
        srv.stop()
        pytest.fail(f"{e}\n--- server log ({log}) ---\n{srv.log_tail()}")
    print(f"vllm server on {model_dir.name} ready in {time.monotonic() - start:.1f} s")
    if (ready := on_ready_hook()) is not None:  # as launch and serve_vllm.py do
        ready(srv.proc.pid)
    srv.failed_before = request.session.testsfailed
    return srv


def stop_server(srv: VLLMServer, request) -> None:
    srv.stop()
    if request.session.testsfailed > srv.failed_before:
        reporter = request.config.pluginmanager.getplugin("terminalreporter")
        reporter.write_line(f"--- vllm server log ({srv.log_path}) ---\n{srv.log_tail()}")


def client_for(server: VLLMServer) -> VLLMClient:
    return VLLMClient([server.url], api_key=server.key, request_timeout_s=120, max_retries=1)


def hf_token_logprobs(model_dir: Path, prompt: list[int], response: list[int]) -> torch.Tensor:
    model = hf_model(model_dir)
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    return lp[len(prompt) - 1 :]


_HF_MODELS: dict[Path, torch.nn.Module] = {}


def hf_model(model_dir: Path) -> torch.nn.Module:
    if model_dir not in _HF_MODELS:
        from transformers import AutoModelForCausalLM

        _HF_MODELS[model_dir] = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32
        ).eval()
    return _HF_MODELS[model_dir]


def served_prompt_logprobs(client: VLLMClient, prompt: list[int]) -> torch.Tensor:
    """The server's log-prob of every prompt token after the first (teacher forcing)."""
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
    rows = client.call(client.urls[0], "/v1/completions", body)["choices"][0]["prompt_logprobs"]
    return torch.tensor(
        [row[str(t)]["logprob"] for row, t in zip(rows[1:], prompt[1:], strict=True)]
    )


def _trainer_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """The Megatron policy's own log-probs of the same tokens (full vocabulary, any layout)."""
    ids = torch.tensor([prompt])
    n = len(prompt)
    mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        logits = model(ids, torch.arange(n)[None], mask, runtime_gather_output=True)[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0]


def _one_dim_mismatches(client: VLLMClient, cfg, full: dict[str, torch.Tensor]) -> list[str]:
    """The 1-D tensors (norms, DeepSeek's expert bias, which goes in fp32) whose bytes on the
    server differ from the trainer's: vLLM's SHA-256 of every served parameter (dev mode's
    ``/weight_checker``, per worker) against the trainer's full tensor (a plain copy under its
    HF name) in the dtype it is sent in. Matrices are left out: vLLM fuses and repacks them."""
    import hashlib

    from megatron_gspo.weights.hf import HFMapping

    mapping = HFMapping(cfg)
    served = client.call(client.urls[0], "/weight_checker", {"action": "checksum"})["checksums"]
    workers = {k.rsplit(":", 1)[0] for k in served}
    bad, compared = [], 0
    for megatron_name, t in full.items():
        if t.ndim != 1:
            continue
        (name,) = mapping.by_megatron[megatron_name].hf
        sent = t.to(mapping.hf_dtype(name, torch.float32)).contiguous()
        digest = hashlib.sha256(sent.view(torch.uint8).numpy()).hexdigest()
        bad += [f"{w}:{name}" for w in workers if served.get(f"{w}:{name}") != digest]
        compared += 1
    assert compared and workers, "no 1-D tensor compared"
    return bad


def _sync_and_compare(rank, world, cfg, parallel, url, key, vllm_cfg, seeds):
    """After each sync of new trainer weights: the server's greedy samples and prompt log-probs
    against the trainer's own (LocalEngine and a forward of the same Megatron model)."""
    from megatron_gspo.model import build_model
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.rollout.local import LocalEngine
    from megatron_gspo.weights import load_full_state_dict
    from tests.support.vllm_tiny import random_full_state_dict

    init_parallel(parallel)
    model = build_model(cfg, parallel)
    model.eval()
    engine = VLLMEngine(vllm_cfg, cfg, model, urls=[url], api_key=key)
    request = RolloutRequest(
        PROMPTS, SamplingParams(group_size=1, temperature=0.0, max_new_tokens=8)
    )
    client = VLLMClient([url], api_key=key, request_timeout_s=120, max_retries=1)
    rounds = []
    for version, seed in enumerate(seeds, 1):
        full = random_full_state_dict(cfg, seed)
        load_full_state_dict(model, full)
        local = LocalEngine(model).generate(request)
        before = engine.generate(request)
        engine.sync_weights(version)
        after = engine.generate(request)
        exact = _one_dim_mismatches(client, cfg, full) if rank == 0 else []
        prompt_diff = 0.0
        for prompt in (p for p in PROMPTS if len(p) > 1):
            trainer = _trainer_prompt_logprobs(model, prompt)
            if rank == 0:
                served = served_prompt_logprobs(client, prompt)
                prompt_diff = max(prompt_diff, float((served - trainer).abs().max()))
        rounds.append(
            {
                "local": [g[0].token_ids for g in local.completions],
                "local_lp": [g[0].logprobs for g in local.completions],
                "before": [g[0].token_ids for g in before.completions],
                "after": [g[0].token_ids for g in after.completions],
                "after_lp": [g[0].logprobs for g in after.completions],
                "versions": [g[0].policy_version for g in after.completions],
                "prompt_diff": prompt_diff,
                "one_dim_mismatches": exact,
                "sync": engine.last_sync,
            }
        )
    left = (
        sorted(p.name for p in Path(vllm_cfg.sync_dir).iterdir())
        if vllm_cfg.sync_dir and rank == 0
        else None
    )
    return rounds, left


def check_sync(server, model_dir, tmp_path, cfg, world, parallel, weight_sync) -> None:
    vllm_cfg = VLLMConfig(
        urls=[server.url],
        request_timeout_s=120,
        max_retries=1,
        weight_sync=weight_sync,
        sync_dir=str(tmp_path / "sync") if weight_sync == "disk" else None,
        # Many small buckets: the stream of buckets is what is under test.
        bucket_mb=0.1,
        sync_timeout_s=120,
    )
    if weight_sync == "disk":
        (tmp_path / "sync").mkdir()
    try:
        results = run_distributed(
            _sync_and_compare, world, cfg, parallel, server.url, server.key, vllm_cfg, [1234, 99]
        )
    finally:
        restore_served_weights(server, model_dir)
    rounds, left = results[0]
    for other, _ in results[1:]:
        assert [r["after"] for r in other] == [r["after"] for r in rounds], (
            "ranks got other rollouts"
        )
    for version, r in enumerate(rounds, 1):
        print(f"sync {version}: prompt log-probs {r['prompt_diff']:.1e} off; {r['sync']}")
        assert r["before"] != r["local"], f"sync {version}: the server already had these weights"
        assert r["after"] == r["local"], (
            f"after sync {version} the server samples something else than the trainer"
        )
        worst = max(
            (torch.tensor(a) - torch.tensor(b)).abs().max().item()
            for a, b in zip(r["after_lp"], r["local_lp"], strict=True)
        )
        assert worst < LOGPROB_ATOL, f"sync {version}: sampled log-probs differ by {worst:.2e}"
        assert r["prompt_diff"] < LOGPROB_ATOL, (
            f"sync {version}: prompt log-probs differ from the trainer's forward by "
            f"{r['prompt_diff']:.2e}"
        )
        assert r["versions"] == [version] * len(PROMPTS), f"samples stamped {r['versions']}"
        assert not r["one_dim_mismatches"], (
            f"sync {version}: served bytes differ from the trainer's: {r['one_dim_mismatches']}"
        )
    if weight_sync == "disk":
        assert left == ["step-000002"], f"sync_dir should hold only the latest checkpoint: {left}"


# The MoE layouts every MoE family's sync is checked in.
moe_sync_layouts = pytest.mark.parametrize(
    "world,parallel,weight_sync",
    [
        (1, ParallelConfig(), "collective"),
        (2, ParallelConfig(expert_model_parallel_size=2), "collective"),
        (1, ParallelConfig(), "disk"),
    ],
    ids=["collective-1rank", "collective-ep2", "disk-1rank"],
)


def train_with_vllm(rank, world, data: dict, steps: int, key: str):
    import os

    from megatron_gspo.rollout.vllm.server_command import JOB_KEY_ENV

    os.environ[JOB_KEY_ENV] = key
    train_run(rank, world, data, steps, True)


def servers_of(server, timeout_s: float = 120.0):
    """vLLM's RL routes of one test server, with its key."""
    from megatron_gspo.rollout.vllm.rl_api import Servers

    return Servers(VLLMClient([server.url], api_key=server.key), timeout_s=timeout_s)


def restore_served_weights(server, model_dir: Path) -> None:
    """Later tests start from the weights on disk again: the disk path of the ``gspo`` engine,
    through the same routes, back to vLLM's label for the checkpoint a server started with."""
    if getattr(server, "weight_transfer", "gspo") != "gspo":
        return  # the disk path is the gspo engine's; a test's own server goes away after it
    s = servers_of(server)
    s.pause("abort")
    try:
        s.start_weight_update()
    except Exception:  # noqa: BLE001 - an update a failed test left open: close it first
        s.finish_weight_update()
        s.start_weight_update()
    s.update_weights({"path": str(model_dir)})
    s.finish_weight_update("default")
    s.resume()
