"""The embedded engine: cached decoding equals uncached decoding, and its log-probs are the
policy's own (teacher-forced forward of the sampled sequence)."""

from __future__ import annotations

import torch

from megatron_gspo.config import ParallelConfig
from megatron_gspo.rollout import RolloutRequest, SamplingParams
from tests.support.ranks import run_distributed
from tests.support.tiny import TINY_MOE


def _generate(rank, world, parallel: ParallelConfig, request: RolloutRequest):
    from megatron_gspo.model import build_model
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.rollout.local import LocalEngine

    init_parallel(parallel)
    model = build_model(TINY_MOE, parallel)
    # Larger weights than the initializer's, so the sampled distribution is far from uniform.
    torch.manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    cached = LocalEngine(model, use_cache=True).generate(request)
    uncached = LocalEngine(model, use_cache=False).generate(request)
    # Teacher-forced log-probs of each sampled response, one sequence at a time.
    model.eval()
    forced = []
    with torch.no_grad():
        for prompt, group in zip(request.prompts, cached.completions, strict=True):
            for c in group:
                ids = torch.tensor([prompt + c.token_ids])
                n = ids.shape[1]
                logits = model(
                    ids,
                    torch.arange(n)[None],
                    torch.triu(torch.ones(n, n, dtype=torch.bool), 1)[None, None],
                    runtime_gather_output=True,
                )
                lp = torch.log_softmax(logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[
                    :, 0
                ]
                forced.append(lp[len(prompt) - 1 :])
    # The engine's own teacher-forced scoring of the same sequences, batched (padded).
    pairs = zip(request.prompts, cached.completions, strict=True)
    sequences = [p + c.token_ids for p, g in pairs for c in g]
    scored = LocalEngine(model).score(sequences)
    return cached, uncached, forced, scored


def test_cached_decoding_equals_uncached_and_logprobs_are_the_policys():
    request = RolloutRequest(
        prompts=[[1, 2, 3], [4, 5, 6, 7, 8], [9]],
        params=SamplingParams(
            group_size=3, temperature=1.0, max_new_tokens=8, stop_token_ids=(0,), seed=3
        ),
    )
    cached, uncached, forced, scored = run_distributed(_generate, 1, ParallelConfig(), request)[0]
    flat = [c for g in cached.completions for c in g]
    assert [len(g) for g in cached.completions] == [3, 3, 3]
    for c, u in zip(flat, [c for g in uncached.completions for c in g], strict=True):
        assert c.token_ids == u.token_ids, "the KV cache changed what was sampled"
        assert torch.allclose(torch.tensor(c.logprobs), torch.tensor(u.logprobs), atol=1e-5)
    for c, lp in zip(flat, forced, strict=True):
        assert len(c.token_ids) == len(c.logprobs) == len(lp)
        assert c.finish_reason == ("stop" if c.token_ids[-1] == 0 else "length")
        assert torch.allclose(torch.tensor(c.logprobs), lp, atol=1e-5), (c.logprobs, lp)
    # score(): every token after the first of each whole sequence, its response part the
    # same log-probs (what the sampler-mismatch probe compares with the trainer's).
    prompts = [p for p in request.prompts for _ in range(3)]
    for c, lp, p, row in zip(flat, forced, prompts, scored, strict=True):
        assert len(row) == len(p) + len(c.token_ids) - 1
        assert torch.allclose(torch.tensor(row[len(p) - 1 :]), lp, atol=1e-5), (row, lp)
