"""The embedded rollout engine: batched sampling from the Megatron policy in this process.

It decodes with Megatron-Core's static KV cache (``StaticInferenceContext``), so a generation
of ``n`` tokens costs ``n`` single-token forwards rather than ``n`` forwards of a growing
sequence. Prompts of different lengths are left-padded and the padding is masked out of
attention; RoPE depends only on relative positions, so the shift changes nothing.

Every rank runs the same generation (same prompts, same random stream): expert and tensor
parallel forwards are collective and need identical shapes on all ranks. That duplicates work
across data-parallel ranks, and pipeline, sequence or context parallelism cannot decode this way:
``rollout.local_worker: true`` samples once, in a worker process with a single-rank snapshot
of the weights (:mod:`megatron_gspo.rollout.local_worker`), for any trainer layout.
"""

from __future__ import annotations

import torch
from megatron.core.inference.contexts import StaticInferenceContext

from megatron_gspo.model.routes import RouteRecorder, route_dtype
from megatron_gspo.parallel.platform import cuda_redirect_suspended
from megatron_gspo.rollout.protocol import Capabilities, Completion, RolloutRequest, RolloutResult
from megatron_gspo.rollout.sampling import sample_tokens
from megatron_gspo.runtime.errors import InputError


class LocalEngine:
    capabilities = Capabilities()

    def __init__(
        self, model: torch.nn.Module, *, max_batch_size: int = 256, use_cache: bool = True
    ):
        config = model.config
        if config.pipeline_model_parallel_size > 1:
            raise InputError(
                "the in-process engine needs parallel.pipeline_model_parallel_size=1; set "
                "rollout.local_worker: true (a generation worker process) or rollout.engine: vllm"
            )
        if config.context_parallel_size > 1:
            raise InputError(
                "the in-process engine cannot decode with parallel.context_parallel_size > 1 "
                "(each rank holds a share of every sequence); set rollout.local_worker: true "
                "(a generation worker process) or rollout.engine: vllm"
            )
        if config.sequence_parallel:
            raise InputError(
                "the in-process engine does not support parallel.sequence_parallel (single-token "
                "decode steps cannot be split over tensor-parallel ranks); set "
                "rollout.local_worker: true (a generation worker process) or rollout.engine: vllm"
            )
        self.model = model
        # Decoding tensors and the random stream live where the weights do (a GPU's).
        self.device = next(model.parameters()).device
        self.max_batch_size = max_batch_size
        self.use_cache = use_cache
        self.version: int | None = None
        self._recorder: RouteRecorder | None = None

    def sync_weights(self, version: int) -> None:
        """Nothing to copy: the engine samples from the trainer's own parameters."""
        self.version = version

    def step_metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass

    @torch.no_grad()
    def generate(self, request: RolloutRequest) -> RolloutResult:
        params = request.params
        generator = torch.Generator(self.device).manual_seed(params.seed)
        flat = [p for p in request.prompts for _ in range(params.group_size)]
        out: list[Completion] = []
        was_training = self.model.training
        self.model.eval()
        try:
            with cuda_redirect_suspended():  # the decode loop is a hot path
                for start in range(0, len(flat), self.max_batch_size):
                    out += self._generate_batch(
                        flat[start : start + self.max_batch_size], params, generator
                    )
        finally:
            self.model.train(was_training)
        g = params.group_size
        return RolloutResult([out[i : i + g] for i in range(0, len(out), g)])

    @torch.no_grad()
    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Teacher-forced log-probs of every token after the first of each sequence, under the
        weights held now (the sampler's own numerics: what ``rollout_sampler_kl`` checks).
        Collective like :meth:`generate`."""
        out: list[list[float]] = []
        was_training = self.model.training
        self.model.eval()
        try:
            with cuda_redirect_suspended():
                for start in range(0, len(sequences), self.max_batch_size):
                    out += self._score_batch(sequences[start : start + self.max_batch_size])
        finally:
            self.model.train(was_training)
        return out

    def _score_batch(self, sequences: list[list[int]]) -> list[list[float]]:
        width = max(len(s) for s in sequences)
        tokens = torch.zeros(len(sequences), width, dtype=torch.long)
        for i, s in enumerate(sequences):
            tokens[i, : len(s)] = torch.tensor(s)
        tokens = tokens.to(self.device)
        positions = torch.arange(width, device=self.device)[None].expand_as(tokens)
        # Right padding after each sequence: the causal mask keeps it out of every real token.
        causal = torch.triu(torch.ones(width, width, dtype=torch.bool, device=self.device), 1)
        logits = self._forward(tokens, positions, causal[None, None], None)
        lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, tokens[:, 1:, None])[..., 0]
        return [lp[i, : len(s) - 1].tolist() for i, s in enumerate(sequences)]

    def _forward(self, tokens, positions, mask, ctx):
        """Full-vocabulary logits; Megatron's padded ids are cut off, so never sampled."""
        if ctx is None:
            logits = self.model(tokens, positions, mask, runtime_gather_output=True)
        else:
            logits = self.model(
                tokens, positions, mask, inference_context=ctx, runtime_gather_output=True
            )
        return logits[..., : self.model.vocab_size_unpadded]

    def _generate_batch(self, prompts: list[list[int]], params, generator) -> list[Completion]:
        recorder = self._route_recorder() if params.return_routes else None
        if recorder is None:
            return self._completions(*self._decode(prompts, params, generator), None)
        recorder.start()
        try:
            decoded = self._decode(prompts, params, generator)
        finally:
            forwards = recorder.stop()
        # A prefill over the prompts, then each forward adds the position it decoded (the
        # last one, where the forward recomputes the whole sequence).
        routes = torch.cat([forwards[0], *(f[:, -1:] for f in forwards[1:])], dim=1)
        return self._completions(*decoded, routes)

    def _decode(self, prompts: list[list[int]], params, generator):
        """Sample every prompt's response: (tokens, left padding, prompt width, log-probs,
        lengths, finished)."""
        n, width = len(prompts), max(len(p) for p in prompts)
        total = width + params.max_new_tokens
        dev = self.device
        pad = torch.tensor([width - len(p) for p in prompts], device=dev)
        tokens = torch.zeros(n, total, dtype=torch.long)
        for i, p in enumerate(prompts):
            tokens[i, width - len(p) : width] = torch.tensor(p)
        tokens = tokens.to(dev)
        key_pad = torch.arange(total, device=dev)[None] < pad[:, None]  # True: a key is padding
        causal = torch.triu(torch.ones(total, total, dtype=torch.bool, device=dev), 1)
        stop = torch.tensor(list(params.stop_token_ids), dtype=torch.long, device=dev)

        ctx = StaticInferenceContext(n, total) if self.use_cache else None
        positions = torch.arange(total, device=dev)[None].expand(n, total)
        logits = self._forward(
            tokens[:, :width],
            positions[:, :width],
            causal[None, None, :width, :width] | key_pad[:, None, None, :width],
            ctx,
        )[:, -1]
        if ctx is not None:
            ctx.sequence_len_offset = width

        logprobs = torch.zeros(n, params.max_new_tokens, device=dev)
        done = torch.zeros(n, dtype=torch.bool, device=dev)
        lengths = torch.full((n,), params.max_new_tokens, device=dev)
        for t in range(params.max_new_tokens):
            allowed = logits
            if t < params.min_new_tokens and len(stop):
                allowed = logits.index_fill(-1, stop, float("-inf"))
            nxt = sample_tokens(
                allowed, temperature=params.temperature, top_p=params.top_p, generator=generator
            )
            logprobs[:, t] = torch.log_softmax(logits.float(), -1).gather(-1, nxt[:, None])[:, 0]
            pos = width + t
            tokens[:, pos] = torch.where(done, 0, nxt)
            finished_now = ~done & torch.isin(nxt, stop)
            lengths = torch.where(finished_now, t + 1, lengths)
            done |= finished_now
            if bool(done.all()) or t + 1 == params.max_new_tokens:
                break
            end = pos + 1
            if ctx is not None:
                logits = self._forward(
                    tokens[:, pos : pos + 1],
                    positions[:, pos : pos + 1],
                    key_pad[:, None, None, :end],
                    ctx,
                )[:, -1]
                ctx.sequence_len_offset = end
            else:
                logits = self._forward(
                    tokens[:, :end],
                    positions[:, :end],
                    causal[None, None, :end, :end] | key_pad[:, None, None, :end],
                    None,
                )[:, -1]
        return tokens.cpu(), pad.cpu(), width, logprobs.cpu(), lengths.cpu(), done.cpu()

    def _completions(self, tokens, pad, width, logprobs, lengths, done, routes):
        completions = []
        for i in range(tokens.shape[0]):
            k = int(lengths[i])
            completions.append(
                Completion(
                    token_ids=tokens[i, width : width + k].tolist(),
                    logprobs=logprobs[i, :k].tolist(),
                    finish_reason="stop" if bool(done[i]) else "length",
                    policy_version=self.version,
                    routes=None
                    if routes is None
                    else self._sample_routes(routes, i, pad, width, k),
                )
            )
        return completions

    def _route_recorder(self) -> RouteRecorder:
        if self._recorder is None:
            self._recorder = RouteRecorder(self.model)
        return self._recorder

    def _sample_routes(self, routes: torch.Tensor, i: int, pad, width: int, new: int):
        """Sample ``i``'s ``[tokens, layers, k]`` routes out of a batch's ``[layers, positions,
        n, k]``: its prompt (after its left padding), then its response but the last token,
        which was sampled and never read."""
        rows = routes[:, int(pad[i]) : width + new - 1, i].transpose(0, 1)
        return rows.cpu().numpy().astype(route_dtype(self.model.config.num_moe_experts))
