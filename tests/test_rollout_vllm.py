"""The vLLM engine against a real ``vllm serve`` on 127.0.0.1 (CPU build, tiny Qwen3-MoE).

One server per module (loading it takes ~25 s). The tests check what the trainer relies on:
grouped samples with exact token ids and the policy's own log-probs (compared with a
teacher-forced transformers forward), a weight sync after which the server samples exactly what
the Megatron trainer would, and a prompt, clear failure when a server is down.

The tests that start a server skip where ``vllm`` is not importable (``.ci/vllm-setup.sh``
builds the environment); those that need no server (a server that is down is reported promptly,
on every rank) run everywhere: the client is plain HTTP.
"""

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
from tests._dist import run_distributed
from tests.vllm_tiny import (
    EOS_ID,
    VLLM_TINY_DENSE,
    VLLM_TINY_MOE,
    VLLMServer,
    free_port,
    write_tiny_model,
)

requires_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm is not installed (see .ci/vllm-setup.sh for the vLLM test environment)",
)

SERVER_START_TIMEOUT_S = 300
# fp32 on both sides; measured differences are ~1e-6 (different kernels and summation order).
LOGPROB_ATOL = 1e-4
PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14, 15], [20]]


def _start(model_dir: Path, log: Path, request) -> VLLMServer:
    srv = VLLMServer(model_dir, log)
    start = time.monotonic()
    try:
        wait_until_healthy([srv.url], timeout_s=SERVER_START_TIMEOUT_S, interval_s=1.0)
    except VLLMUnavailableError as e:
        srv.stop()
        pytest.fail(f"{e}\n--- server log ({log}) ---\n{srv.log_tail()}")
    print(f"vllm server on {model_dir.name} ready in {time.monotonic() - start:.1f} s")
    srv.failed_before = request.session.testsfailed
    return srv


def _stop(srv: VLLMServer, request) -> None:
    srv.stop()
    if request.session.testsfailed > srv.failed_before:
        reporter = request.config.pluginmanager.getplugin("terminalreporter")
        reporter.write_line(f"--- vllm server log ({srv.log_path}) ---\n{srv.log_tail()}")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-moe"), VLLM_TINY_MOE, seed=0)


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-dense"), VLLM_TINY_DENSE, seed=0)


@pytest.fixture(scope="module")
def moe_server(moe_dir, tmp_path_factory, request):
    srv = _start(moe_dir, tmp_path_factory.mktemp("vllm-moe") / "server.log", request)
    yield srv
    _stop(srv, request)


@pytest.fixture(scope="module")
def dense_server(dense_dir, tmp_path_factory, request):
    srv = _start(dense_dir, tmp_path_factory.mktemp("vllm-dense") / "server.log", request)
    yield srv
    _stop(srv, request)


def _client(server: VLLMServer) -> VLLMClient:
    return VLLMClient([server.url], request_timeout_s=120, max_retries=1)


def _hf_token_logprobs(model_dir: Path, prompt: list[int], response: list[int]) -> torch.Tensor:
    model = _hf_model(model_dir)
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    return lp[len(prompt) - 1 :]


_HF_MODELS: dict[Path, torch.nn.Module] = {}


def _hf_model(model_dir: Path) -> torch.nn.Module:
    if model_dir not in _HF_MODELS:
        from transformers import AutoModelForCausalLM

        _HF_MODELS[model_dir] = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32
        ).eval()
    return _HF_MODELS[model_dir]


@requires_vllm
def test_groups_of_samples_with_exact_ids_and_the_policys_logprobs(moe_server, moe_dir):
    client = _client(moe_server)
    params = SamplingParams(
        group_size=4, temperature=1.0, top_p=0.9, max_new_tokens=10, stop_token_ids=(EOS_ID,)
    )
    result = client.generate(RolloutRequest(PROMPTS, params))
    assert [len(g) for g in result.completions] == [4, 4, 4]
    worst = 0.0
    for prompt, group in zip(PROMPTS, result.completions, strict=True):
        assert len({tuple(c.token_ids) for c in group}) > 1, "all samples of a group are equal"
        for c in group:
            assert 1 <= len(c.token_ids) == len(c.logprobs) <= params.max_new_tokens
            assert all(0 <= t < VLLM_TINY_MOE.vocab_size for t in c.token_ids)
            stopped = c.token_ids[-1] == EOS_ID
            assert c.finish_reason == ("stop" if stopped else "length"), c
            assert EOS_ID not in c.token_ids[:-1], "generation went on past a stop id"
            assert all(lp <= 0 for lp in c.logprobs)
            ref = _hf_token_logprobs(moe_dir, prompt, c.token_ids)
            diff = (torch.tensor(c.logprobs) - ref).abs().max().item()
            worst = max(worst, diff)
    print(f"max |vLLM - transformers| token log-prob: {worst:.2e}")
    assert worst < LOGPROB_ATOL, f"vLLM log-probs differ from the HF forward by {worst:.2e}"


@requires_vllm
def test_same_seed_same_samples(moe_server):
    client = _client(moe_server)
    params = SamplingParams(group_size=3, temperature=1.0, max_new_tokens=6, seed=11)
    a = client.generate(RolloutRequest(PROMPTS[:2], params))
    b = client.generate(RolloutRequest(PROMPTS[:2], params))
    assert [[c.token_ids for c in g] for g in a.completions] == [
        [c.token_ids for c in g] for g in b.completions
    ]


def _trainer_and_server(rank, world, cfg, parallel, url, sync_dir, prompts, params, seed):
    """A Megatron policy with weights unlike the server's; greedy outputs before/after sync."""
    from megatron_gspo.model import build_model
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.rollout.local import LocalEngine
    from megatron_gspo.weights import load_full_state_dict
    from tests.vllm_tiny import random_full_state_dict

    init_parallel(parallel)
    model = build_model(cfg, parallel)
    load_full_state_dict(model, random_full_state_dict(cfg, seed))
    request = RolloutRequest(prompts, params)
    local = LocalEngine(model).generate(request)
    engine = VLLMEngine(
        VLLMConfig(urls=[url], sync_dir=str(sync_dir), request_timeout_s=120, max_retries=1),
        cfg,
        model,
    )
    before = engine.generate(request)
    start = time.monotonic()
    engine.sync_weights()
    sync_s = time.monotonic() - start
    after = engine.generate(request)
    # A second sync replaces the first checkpoint directory instead of piling them up.
    engine.sync_weights()
    left = sorted(p.name for p in Path(sync_dir).iterdir()) if rank == 0 else None
    return local, before, after, sync_s, left


def _check_sync(server, model_dir, tmp_path, cfg, world, parallel) -> None:
    client = _client(server)
    params = SamplingParams(group_size=1, temperature=0.0, max_new_tokens=8)
    try:
        results = run_distributed(
            _trainer_and_server, world, cfg, parallel, server.url, tmp_path, PROMPTS, params, 1234
        )
    finally:
        # Later tests start from the weights on disk again.
        client.reload_weights(model_dir)
    local, before, after, sync_s, left = results[0]
    for r in results[1:]:
        assert r[2].completions == after.completions, "ranks received different rollouts"
    print(f"weight sync (gather + write + reload) took {sync_s:.2f} s")

    def ids(res):
        return [g[0].token_ids for g in res.completions]

    assert ids(before) != ids(local), "the server already had the trainer's weights"
    assert ids(after) == ids(local), "after sync_weights the server samples something else"
    worst = max(
        (torch.tensor(a[0].logprobs) - torch.tensor(b[0].logprobs)).abs().max().item()
        for a, b in zip(after.completions, local.completions, strict=True)
    )
    print(f"max |vLLM - Megatron| greedy token log-prob after sync: {worst:.2e}")
    assert worst < LOGPROB_ATOL, f"log-probs after sync differ from the trainer's by {worst:.2e}"
    assert left == ["step-000002"], f"sync_dir should hold only the latest checkpoint: {left}"


@requires_vllm
@pytest.mark.parametrize(
    "world,parallel",
    [(1, ParallelConfig()), (2, ParallelConfig(tensor_model_parallel_size=2))],
    ids=["single-rank", "tp2"],
)
def test_after_sync_weights_the_server_samples_what_the_trainer_would(
    dense_server, dense_dir, tmp_path, world, parallel
):
    _check_sync(dense_server, dense_dir, tmp_path, VLLM_TINY_DENSE, world, parallel)


@requires_vllm
@pytest.mark.xfail(
    strict=True,
    reason="vLLM 0.32 CPU: reload_weights into a running MoE model leaves wrong expert "
    "weights (reloading the very same checkpoint changes the greedy output); dense works",
)
def test_after_sync_weights_the_moe_server_samples_what_the_trainer_would(
    moe_server, moe_dir, tmp_path
):
    # Last test on this server: the failed reload leaves it with wrong weights.
    _check_sync(moe_server, moe_dir, tmp_path, VLLM_TINY_MOE, 1, ParallelConfig())


def test_a_server_that_is_down_is_named_promptly():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    client = VLLMClient([url], max_retries=2, retry_backoff_s=0.05)
    params = SamplingParams(group_size=2, max_new_tokens=4)
    start = time.monotonic()
    with pytest.raises(VLLMUnavailableError, match=url):
        client.generate(RolloutRequest([[1, 2, 3]], params))
    assert time.monotonic() - start < 5
    with pytest.raises(VLLMUnavailableError, match=url):
        wait_until_healthy([url], timeout_s=0.5, interval_s=0.1)


def test_engine_reports_a_server_down_on_every_rank():
    url = f"http://127.0.0.1:{free_port()}"
    results = run_distributed(_engine_down, 2, url)
    assert all(url in r for r in results), results


def _engine_down(rank, world, url):
    engine = VLLMEngine(
        VLLMConfig(urls=[url], max_retries=1), VLLM_TINY_MOE, None, retry_backoff_s=0.05
    )
    try:
        engine.generate(RolloutRequest([[1, 2]], SamplingParams(group_size=1)))
    except VLLMUnavailableError as e:
        return str(e)
    return "no error"
