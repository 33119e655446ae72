"""The vLLM engine against real vLLM servers on 127.0.0.1 (CPU build; tiny Qwen3-MoE and Qwen3).

One server per model and module (loading one takes ~25 s), started as ``launch`` starts them
(the weight transfer engine of vLLM's RL API, job-key middleware). The tests check what the
trainer relies on: grouped
samples with exact token ids and the policy's own log-probs (against a teacher-forced
transformers forward); after each of two successive weight syncs (collective at 1 rank, EP2 and
TP2, and disk), greedy samples and prompt log-probs equal to the Megatron trainer's own and the
norms byte for byte, and ``/weight_info`` reporting the trainer's version; a sync interrupted
half-way leaving the server refusing generation until a complete one; a manifest that does
not match the served model refused by name; every route closed without the job's key; and a
server that hangs, dies or is down named promptly.

The tests that start a server skip where ``vllm`` is not importable (``.ci/vllm-setup.sh``
builds the environment); those that need no server run everywhere: the client is plain HTTP.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from megatron_gspo.config import ParallelConfig, VLLMConfig
from megatron_gspo.rollout import RolloutRequest, SamplingParams
from megatron_gspo.rollout.vllm import (
    VLLMClient,
    VLLMEngine,
    VLLMRequestError,
    VLLMUnavailableError,
    wait_until_healthy,
)
from megatron_gspo.rollout.vllm.rl_api import Servers
from tests.support.ranks import run_distributed
from tests.support.runs import loop_recipe, run_metrics
from tests.support.vllm_checks import (
    LOGPROB_ATOL,
    PROMPTS,
    check_sync,
    client_for,
    hf_token_logprobs,
    moe_sync_layouts,
    requires_vllm,
    restore_served_weights,
    servers_of,
    start_server,
    stop_server,
    train_with_vllm,
)
from tests.support.vllm_tiny import (
    EOS_ID,
    VLLM_TINY_DENSE,
    VLLM_TINY_MOE,
    free_port,
    write_tiny_model,
)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-moe"), VLLM_TINY_MOE, seed=0)


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-dense"), VLLM_TINY_DENSE, seed=0)


@pytest.fixture(scope="module")
def moe_server(moe_dir, tmp_path_factory, request):
    srv = start_server(moe_dir, tmp_path_factory.mktemp("vllm-moe") / "server.log", request)
    yield srv
    stop_server(srv, request)


@pytest.fixture(scope="module")
def dense_server(dense_dir, tmp_path_factory, request):
    srv = start_server(dense_dir, tmp_path_factory.mktemp("vllm-dense") / "server.log", request)
    yield srv
    stop_server(srv, request)


@requires_vllm
def test_groups_of_samples_with_exact_ids_and_the_policys_logprobs(moe_server, moe_dir):
    client = client_for(moe_server)
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
            ref = hf_token_logprobs(moe_dir, prompt, c.token_ids)
            diff = (torch.tensor(c.logprobs) - ref).abs().max().item()
            worst = max(worst, diff)
    print(f"max |vLLM - transformers| token log-prob: {worst:.2e}")
    assert worst < LOGPROB_ATOL, f"vLLM log-probs differ from the HF forward by {worst:.2e}"


@requires_vllm
def test_a_cpu_servers_worker_runs_below_the_trainers_priority_its_front_end_does_not(moe_server):
    """Its busy-polling takes only CPU the trainer leaves; its API server and engine core keep
    the priority that answers health probes (server_command.lower_worker_priority)."""
    import os

    import psutil

    from megatron_gspo.rollout.vllm.server_command import CPU_WORKER_NICE

    server = psutil.Process(moe_server.proc.pid)
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    want = {}
    for p in [server, *server.children(recursive=True)]:
        lowered = p.name().startswith("VLLM::Worker")
        want.update({t.id: mine + CPU_WORKER_NICE * lowered for t in p.threads()})
    assert len(want) > 3 and len(set(want.values())) == 2, want
    got = {tid: os.getpriority(os.PRIO_PROCESS, tid) for tid in want}
    assert got == want


@requires_vllm
def test_same_seed_same_samples(moe_server):
    client = client_for(moe_server)
    params = SamplingParams(group_size=3, temperature=1.0, max_new_tokens=6, seed=11)
    a = client.generate(RolloutRequest(PROMPTS[:2], params))
    b = client.generate(RolloutRequest(PROMPTS[:2], params))
    assert [[c.token_ids for c in g] for g in a.completions] == [
        [c.token_ids for c in g] for g in b.completions
    ]


@requires_vllm
def test_a_server_that_returns_no_routes_is_named_with_the_flag_it_needs(moe_server):
    """Routes (R3) need --enable-return-routed-experts, which vLLM's CPU build refuses
    (test_routing_replay.py); a server without it answers without routed_experts."""
    client = VLLMClient([moe_server.url], api_key=moe_server.key, max_retries=1, moe_layers=[0, 1])
    params = SamplingParams(group_size=2, max_new_tokens=3, return_routes=True)
    with pytest.raises(VLLMRequestError, match="--enable-return-routed-experts"):
        client.generate(RolloutRequest(PROMPTS[:1], params))


@requires_vllm
@moe_sync_layouts
def test_after_each_sync_the_moe_server_computes_what_the_trainer_does(
    moe_server, moe_dir, tmp_path, world, parallel, weight_sync
):
    """Two successive syncs: the second is where a stale expert prepack would show."""
    check_sync(moe_server, moe_dir, tmp_path, VLLM_TINY_MOE, world, parallel, weight_sync)


@requires_vllm
def test_the_training_loop_samples_from_vllm_one_step_off_policy(moe_server, moe_dir, tmp_path):
    """``megatron-gspo train`` with the vLLM engine and ``max_staleness: 1``: the first sync
    replaces the served checkpoint with the trainer's weights, each batch after the first
    comes from the weights one update old, and the server ends on the last version."""

    data = loop_recipe(
        tmp_path / "run",
        model=VLLM_TINY_MOE.model_dump(),
        rollout={
            "engine": "vllm",
            "max_staleness": 1,
            "vllm": {"urls": [moe_server.url], "bucket_mb": 0.1, "sync_timeout_s": 120},
        },
        run={"plot_every": 0, "tensorboard": False},
    )
    try:
        run_distributed(train_with_vllm, 1, data, 3, moe_server.key)
        held = servers_of(moe_server).versions()[moe_server.url]
    finally:
        restore_served_weights(moe_server, moe_dir)
    records = run_metrics(tmp_path / "run")
    assert [r["staleness_max"] for r in records] == [0, 1, 1], records
    assert records[0]["rollout_logprob_abs_diff"] < LOGPROB_ATOL, "the first batch is on-policy"
    assert records[-1]["rollout_kl_k3"] > 0
    assert held == 3, f"the server holds version {held} after 3 steps"
    # The probe after each sync: the server and the trainer score the same tokens with the
    # same weights, and agree to fp32 round-off, while the stale batches' tokens do not.
    for r in records:
        assert r["rollout_sampler_kl"] < LOGPROB_ATOL**2, r
        assert r["rollout_sampler_kl_tokens"] > 0, r
    assert records[-1]["rollout_kl_k3"] > 100 * records[-1]["rollout_sampler_kl"], records


def _mismatched_trainer(rank, world, cfg, url, key):
    from megatron_gspo.model import build_model
    from megatron_gspo.parallel import init_parallel

    init_parallel(ParallelConfig())
    engine = VLLMEngine(
        VLLMConfig(urls=[url], sync_timeout_s=60),
        cfg,
        build_model(cfg, ParallelConfig()),
        urls=[url],
        api_key=key,
    )
    try:
        engine.sync_weights(1)
    except Exception as e:  # noqa: BLE001 - the message is what is tested
        return f"{type(e).__name__}: {e}", engine.server_versions()
    return "no error", None


@requires_vllm
def test_a_manifest_that_does_not_match_the_served_model_is_refused(moe_server):
    """A dense trainer against the MoE server: refused at /init_weight_transfer_engine, before
    anything changes, naming the server and a tensor; the server keeps what it held and goes
    on serving (not paused)."""
    s = servers_of(moe_server)
    held = s.versions()
    message, versions = run_distributed(
        _mismatched_trainer, 1, VLLM_TINY_DENSE, moe_server.url, moe_server.key
    )[0]
    assert moe_server.url in message and "model.layers.0.mlp" in message, message
    assert versions == held, versions
    assert s.is_paused() == {moe_server.url: False}


# Every route of vLLM's RL API (and the dev routes beside it), with a body that would change
# the server if it were accepted.
RL_ROUTES = [
    ("POST", "/pause?mode=abort", None),
    ("POST", "/resume", None),
    ("GET", "/is_paused", None),
    ("POST", "/init_weight_transfer_engine", {"init_info": {"path": "/tmp"}}),
    ("POST", "/start_weight_update", None),
    ("POST", "/update_weights", {"update_info": {"path": "/tmp"}}),
    ("POST", "/finish_weight_update", {"weight_version": "forged"}),
    ("POST", "/update_weight_version", {"new_version": "forged"}),
    ("GET", "/weight_info", None),
    ("POST", "/weight_checker", {"action": "reset"}),
    ("GET", "/get_world_size", None),
    ("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "/tmp"}}),
    ("POST", "/reset_prefix_cache", None),
    ("POST", "/v1/completions", {"prompt": [1, 2], "max_tokens": 1}),
]


@requires_vllm
def test_the_servers_routes_need_the_job_key(moe_server):
    """Without the key (or with another) every route is refused and nothing changes: the
    server is not paused, its weights version and its weights' checksums are what they were."""
    from megatron_gspo.rollout.vllm.http_client import _http

    url = moe_server.url
    s = servers_of(moe_server)
    client = client_for(moe_server)
    checksums = client.call(url, "/weight_checker", {"action": "checksum"})["checksums"]
    version = s.versions()
    for key in (None, "not-the-key"):
        for method, path, body in RL_ROUTES:
            status, _ = _http(method, url + path, body, 30, key)
            assert status == 401, f"{method} {path} answered {status} with key {key!r}"
    assert _http("GET", url + "/health", None, 30)[0] == 200
    assert s.versions() == version
    assert s.is_paused() == {url: False}
    assert client.call(url, "/weight_checker", {"action": "checksum"})["checksums"] == checksums
    with pytest.raises(VLLMRequestError, match="job key"):
        Servers(VLLMClient([url], api_key="not-the-key"), timeout_s=30).versions()


@requires_vllm
def test_after_each_sync_the_dense_server_computes_what_a_tp2_trainer_does(
    dense_server, dense_dir, tmp_path
):
    parallel = ParallelConfig(tensor_model_parallel_size=2)
    check_sync(dense_server, dense_dir, tmp_path, VLLM_TINY_DENSE, 2, parallel, "collective")


def _interrupted_sync(rank, world, cfg, url, key):
    """Sync 1, then a sync that the trainer abandons half-way (its tensor stream fails after a
    third of the tensors), then sync 3; what the engine and the server say after each."""
    import megatron_gspo.weights.stream as stream
    from megatron_gspo.model import build_model
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.rollout.local import LocalEngine
    from megatron_gspo.weights import load_full_state_dict
    from tests.support.vllm_tiny import random_full_state_dict

    init_parallel(ParallelConfig())
    model = build_model(cfg, ParallelConfig())
    config = VLLMConfig(urls=[url], sync_timeout_s=15, request_timeout_s=60, bucket_mb=0.05)
    engine = VLLMEngine(config, cfg, model, urls=[url], api_key=key)
    s = Servers(VLLMClient([url], api_key=key), timeout_s=60)
    greedy = RolloutRequest(PROMPTS, SamplingParams(group_size=1, temperature=0.0))
    out = {}
    engine.sync_weights(1)
    out["after 1"] = (s.versions()[url], s.is_paused()[url])

    full = stream.iter_full_tensors

    def half(*args, **kwargs):
        tensors = list(full(*args, **kwargs))
        yield from tensors[: len(tensors) // 3]
        raise RuntimeError("the trainer went away")

    load_full_state_dict(model, random_full_state_dict(cfg, 7))
    stream.iter_full_tensors = half
    try:
        engine.sync_weights(2)
    except Exception as e:  # noqa: BLE001 - the message is what is tested
        out["sync 2"] = str(e)
    finally:
        stream.iter_full_tensors = full
    out["after 2"] = (s.versions()[url], s.is_paused()[url])
    try:
        engine.generate(greedy)
    except Exception as e:  # noqa: BLE001
        out["generate after 2"] = str(e)
    engine.sync_weights(3)
    out["after 3"] = (s.versions()[url], s.is_paused()[url])
    served = engine.generate(greedy)
    out["samples"] = [g[0].token_ids for g in served.completions]
    out["trainer"] = [g[0].token_ids for g in LocalEngine(model).generate(greedy).completions]
    out["stamped"] = {g[0].policy_version for g in served.completions}
    return out


@requires_vllm
def test_a_sync_interrupted_half_way_leaves_the_server_refusing_until_a_complete_one(
    dense_server, dense_dir
):
    try:
        out = run_distributed(
            _interrupted_sync, 1, VLLM_TINY_DENSE, dense_server.url, dense_server.key
        )[0]
    finally:
        restore_served_weights(dense_server, dense_dir)
    print(out)
    assert out["after 1"] == (1, False)
    assert "the trainer went away" in out["sync 2"] and "partial" in out["sync 2"], out["sync 2"]
    # vLLM's own label: whoever asks (this trainer, a restarted one) sees a partial update.
    assert out["after 2"] == ("partial", True), out["after 2"]
    assert "sync to version 2 failed" in out["generate after 2"], out["generate after 2"]
    assert out["after 3"] == (3, False)
    assert out["samples"] == out["trainer"] and out["stamped"] == {3}


def _engines_take_turns(rank, world, cfg, url, key, sync_dir):
    """A collective and a disk engine on one server, syncing in turn (what
    benchmarks/weight_sync.py does, and a requeued job on the other transport): the disk
    engine's init drops the gloo group the collective one formed."""
    from megatron_gspo.model import build_model
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.rollout.local import LocalEngine

    init_parallel(ParallelConfig())
    model = build_model(cfg, ParallelConfig())
    engines = [
        VLLMEngine(
            VLLMConfig(urls=[url], weight_sync=path, sync_dir=sync_dir, sync_timeout_s=60),
            cfg,
            model,
            urls=[url],
            api_key=key,
        )
        for path in ("collective", "disk")
    ]
    s = Servers(VLLMClient([url], api_key=key), timeout_s=60)
    versions = []
    for version, engine in enumerate(engines * 2 + engines[:1], 1):
        engine.sync_weights(version)
        versions.append(s.versions()[url])
    greedy = RolloutRequest(PROMPTS, SamplingParams(group_size=1, temperature=0.0))
    served = engines[0].generate(greedy)
    trainer = LocalEngine(model).generate(greedy)
    return {
        "versions": versions,
        "samples": [g[0].token_ids for g in served.completions],
        "trainer": [g[0].token_ids for g in trainer.completions],
    }


@requires_vllm
def test_engines_that_take_turns_on_a_server_each_get_a_working_transfer_group(
    dense_server, dense_dir, tmp_path
):
    try:
        out = run_distributed(
            _engines_take_turns,
            1,
            VLLM_TINY_DENSE,
            dense_server.url,
            dense_server.key,
            str(tmp_path / "sync"),
            timeout=300,
        )[0]
    finally:
        restore_served_weights(dense_server, dense_dir)
    assert out["versions"] == [1, 2, 3, 4, 5], out["versions"]
    assert out["samples"] == out["trainer"], out


def _sync_into_a_failing_server(rank, world, cfg, url, key, pgid):
    import os
    import signal

    from megatron_gspo.model import build_model
    from megatron_gspo.parallel import init_parallel

    init_parallel(ParallelConfig())
    engine = VLLMEngine(
        VLLMConfig(urls=[url], sync_timeout_s=5, request_timeout_s=30, max_retries=0),
        cfg,
        build_model(cfg, ParallelConfig()),
        urls=[url],
        api_key=key,
        retry_backoff_s=0.05,
    )
    engine.sync_weights(1)
    errors = {}
    os.killpg(pgid, signal.SIGSTOP)  # a server that hangs mid-job
    start = time.monotonic()
    try:
        engine.sync_weights(2)
    except Exception as e:  # noqa: BLE001
        errors["hung"] = (str(e), time.monotonic() - start)
    os.killpg(pgid, signal.SIGKILL)  # and then dies
    for what, call in [
        ("dead", lambda: engine.sync_weights(3)),
        (
            "generate",
            lambda: engine.generate(RolloutRequest([[1, 2]], SamplingParams(group_size=1))),
        ),
    ]:
        try:
            call()
        except Exception as e:  # noqa: BLE001
            errors[what] = (str(e), 0.0)
    return errors


@requires_vllm
def test_a_server_that_hangs_or_dies_during_sync_is_named(dense_server):
    """Last test on this server: it is stopped and killed."""
    errors = run_distributed(
        _sync_into_a_failing_server,
        1,
        VLLM_TINY_DENSE,
        dense_server.url,
        dense_server.key,
        dense_server.proc.pid,
    )[0]
    for what, (message, seconds) in errors.items():
        print(f"{what} ({seconds:.1f} s): {message}")
    assert set(errors) == {"hung", "dead", "generate"}, errors
    for what, (message, _) in errors.items():
        assert dense_server.url in message, f"{what}: the error does not name the server: {message}"
    assert errors["hung"][1] < 60, f"a hung server took {errors['hung'][1]:.0f} s to report"
    assert "sync" in errors["generate"][0], errors["generate"][0]


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
        VLLMConfig(urls=[url], max_retries=1, health_timeout_s=1),
        VLLM_TINY_MOE,
        None,
        retry_backoff_s=0.05,
    )
    try:
        engine.generate(RolloutRequest([[1, 2]], SamplingParams(group_size=1)))
    except VLLMUnavailableError as e:
        return str(e)
    return "no error"
