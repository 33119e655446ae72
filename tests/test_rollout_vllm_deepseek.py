"""The DeepSeek-V3 family through a real vLLM server on 127.0.0.1 (CPU build).

A tiny DeepSeek-V3 (multi-latent attention with DeepSeek-V3's latent and head sizes, which
vLLM's CPU MLA needs; a dense layer, then an MoE layer with a shared expert and sigmoid routing
over expert groups with a correction bias), its ``config.json`` written by the project's export
(:func:`~megatron_gspo.model.hf_config.hf_config_from_model_config`), served as ``launch``
serves models (weight transfer engine, job key). One server for the module.

- The served log-probs, of prompts (teacher forced) and of sampled tokens (decoding), equal
  transformers' forward: this is where vLLM 0.32's CPU rotary kernel, which misreads MLA's
  query layout, showed (1.5 nats off in the prompt, 6.4 in decoding, without
  :mod:`megatron_gspo.rollout.vllm.server_side.cpu_rope`).
- After each of two weight syncs (collective at 1 rank and EP2, disk; the expert bias goes in
  fp32), the server's greedy samples and prompt log-probs equal the Megatron trainer's own,
  and its norms and expert bias equal the trainer's byte for byte.
- Served without that correction, the training loop stops within
  ``rollout.max_rollout_kl_steps`` steps (``rollout.max_rollout_kl``), on-policy and one step
  off-policy alike.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_gspo.rollout import RolloutRequest, SamplingParams
from tests.support.ranks import run_distributed
from tests.support.runs import loop_recipe, run_metrics
from tests.support.vllm_checks import (
    LOGPROB_ATOL,
    PROMPTS,
    check_sync,
    client_for,
    hf_model,
    hf_token_logprobs,
    moe_sync_layouts,
    requires_vllm,
    served_prompt_logprobs,
    start_server,
    stop_server,
    train_with_vllm,
)
from tests.support.vllm_tiny import EOS_ID, VLLM_TINY_DEEPSEEK, write_tiny_model


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-deepseek"), VLLM_TINY_DEEPSEEK, seed=0)


@pytest.fixture(scope="module")
def deepseek_server(deepseek_dir, tmp_path_factory, request):
    srv = start_server(
        deepseek_dir, tmp_path_factory.mktemp("vllm-ds") / "server.log", request, mla=True
    )
    yield srv
    stop_server(srv, request)


def _hf_prompt_logprobs(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        logits = hf_model(model_dir)(input_ids=ids).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0]


@requires_vllm
def test_the_served_deepseek_computes_what_transformers_does(deepseek_server, deepseek_dir):
    client = client_for(deepseek_server)
    prompt = [5, 17, 33, 2, 90, 41, 7, 64, 200, 3, 99, 12]
    served = served_prompt_logprobs(client, prompt)
    prefill = (served - _hf_prompt_logprobs(deepseek_dir, prompt)).abs().max().item()
    params = SamplingParams(
        group_size=2, temperature=1.0, max_new_tokens=12, stop_token_ids=(EOS_ID,), seed=3
    )
    result = client.generate(RolloutRequest(PROMPTS, params))
    decode = 0.0
    for prompt_ids, group in zip(PROMPTS, result.completions, strict=True):
        for c in group:
            ref = hf_token_logprobs(deepseek_dir, prompt_ids, c.token_ids)
            decode = max(decode, (torch.tensor(c.logprobs) - ref).abs().max().item())
    print(f"max |vLLM - transformers| log-prob: prompt {prefill:.2e}, sampled {decode:.2e}")
    assert prefill < LOGPROB_ATOL, f"prompt log-probs differ from transformers by {prefill:.2e}"
    assert decode < LOGPROB_ATOL, f"sampled log-probs differ from transformers by {decode:.2e}"


@requires_vllm
@moe_sync_layouts
def test_after_each_sync_the_deepseek_server_computes_what_the_trainer_does(
    deepseek_server, deepseek_dir, tmp_path, world, parallel, weight_sync
):
    check_sync(
        deepseek_server, deepseek_dir, tmp_path, VLLM_TINY_DEEPSEEK, world, parallel, weight_sync
    )


@pytest.fixture(scope="module")
def unfixed_server(deepseek_dir, tmp_path_factory, request):
    log = tmp_path_factory.mktemp("vllm-ds-unfixed") / "server.log"
    # The project's plugin leaves vLLM's CPU rotary kernel alone.
    srv = start_server(
        deepseek_dir, log, request, env={"MEGATRON_GSPO_CPU_ROPE_FIX": "0"}, mla=True
    )
    yield srv
    stop_server(srv, request)


@requires_vllm
@pytest.mark.slow
@pytest.mark.parametrize("staleness", [0, 1])
def test_a_deepseek_served_without_the_rotary_correction_is_stopped(
    unfixed_server, tmp_path, staleness
):
    """The sampler-mismatch guard at its defaults: on-policy the batch's own tokens show the
    served model's error, one step off-policy the probe after each sync does."""
    from megatron_gspo.config import RolloutConfig

    # Weights large enough that attention depends on positions, as a trained model's does:
    # at the initializer's 0.02 every score is near 0 and wrong positions change nothing
    # (measured: 1e-7 with the bug, 0.65-1.06 at 0.5).
    model = {**VLLM_TINY_DEEPSEEK.model_dump(), "init_method_std": 0.5}
    data = loop_recipe(
        tmp_path / "run",
        model=model,
        rollout={
            "engine": "vllm",
            "max_staleness": staleness,
            "vllm": {"urls": [unfixed_server.url], "bucket_mb": 0.1, "sync_timeout_s": 120},
        },
        run={"plot_every": 0, "tensorboard": False},
    )
    defaults = RolloutConfig()
    with pytest.raises(RuntimeError, match="rollout_sampler_kl stayed above"):
        run_distributed(train_with_vllm, 1, data, 10, unfixed_server.key)
    records = run_metrics(tmp_path / "run")
    figures = [r["rollout_sampler_kl"] for r in records]
    print(f"max_staleness {staleness}: rollout_sampler_kl by step {figures}")
    assert len(records) == defaults.max_rollout_kl_steps, figures
    assert all(f > defaults.max_rollout_kl for f in figures), figures
