"""One GSPO step of the slice through the project's own Policy and GSPOTrainer, and the
embedded engine decoding with its weights, on the device this process has (a GPU where there
is one: Megatron builds the model on the current CUDA device)."""

from __future__ import annotations

import gc
import random

import torch

from megatron_gspo.config import Recipe
from megatron_gspo.launch.plan import GIB
from megatron_gspo.model.counts import active_parameters, count_parameters
from megatron_gspo.preflight.measure import median_time
from megatron_gspo.preflight.sizes import Size, gspo_step_flops
from megatron_gspo.rollout.local import LocalEngine
from megatron_gspo.rollout.protocol import RolloutRequest, SamplingParams
from megatron_gspo.trainer.packing import Sample


def rollout_batch(size: Size, vocab: int, seed: int = 0) -> list[Sample]:
    """Groups of 4 responses to the same prompt, random tokens, advantages and rollout
    log-probs (so the train/rollout mismatch metric runs too)."""
    rng = random.Random(seed)
    samples = []
    for i in range(size.sequences):
        if i % 4 == 0:
            prompt = [rng.randrange(vocab) for _ in range(size.prompt_len)]
        samples.append(
            Sample(
                prompt_ids=prompt,
                response_ids=[rng.randrange(vocab) for _ in range(size.response_len)],
                advantage=rng.gauss(0.0, 1.0),
                rollout_logprobs=[-rng.uniform(8.0, 12.0) for _ in range(size.response_len)],
                prompt_index=i // 4,
            )
        )
    return samples


def layer_spec() -> str:
    from megatron_gspo.model.spec import transformer_engine_available

    return "transformer_engine" if transformer_engine_available() else "local"


class SliceStep:
    """A policy of the slice on this rank, its trainer, and the step's figures."""

    def __init__(self, recipe: Recipe, groups) -> None:
        from megatron_gspo.trainer.policy import Policy
        from megatron_gspo.trainer.step import GSPOTrainer

        self.recipe = recipe
        self.policy = Policy(recipe, groups)
        self.trainer = GSPOTrainer(self.policy)
        self.device = self.trainer.device

    def run(self, samples: list[Sample], *, repeats: int, matmul_tflops: float) -> dict:
        """A warm-up step, then the median of ``repeats`` timed steps."""
        m = self.recipe.model
        seq_lens = [s.num_tokens for s in samples]
        tokens = sum(seq_lens)
        last: dict = {}

        def step() -> None:
            last.update(self.trainer.step(samples))

        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        seconds = median_time(step, self.device, repeats=repeats, warmup=1)
        if not torch.isfinite(torch.tensor(last["loss"])):
            raise RuntimeError(f"the step's loss is {last['loss']}")
        flops = gspo_step_flops(m, seq_lens)
        out = {
            "parameters B": count_parameters(m).total / 1e9,
            "active parameters B": active_parameters(m) / 1e9,
            "tokens per step": tokens,
            "step s": seconds,
            "tokens/s": tokens / seconds,
            "TFLOP per step": flops / 1e12,
            "MFU %": 100 * flops / seconds / (matmul_tflops * 1e12),
            "loss": float(last["loss"]),
        }
        if self.device.type == "cuda":
            out["peak allocated GiB"] = torch.cuda.max_memory_allocated(self.device) / GIB
        return out

    def decode(self, size: Size, *, repeats: int) -> dict:
        """The embedded engine on the policy's weights: ``decode_batch`` prompts at once,
        ``decode_new`` tokens each (no stop token, so every row decodes all of them)."""
        engine = LocalEngine(self.policy.model, max_batch_size=size.decode_batch)
        rng = random.Random(1)
        vocab = self.recipe.model.vocab_size
        request = RolloutRequest(
            prompts=[
                [rng.randrange(vocab) for _ in range(size.decode_prompt)]
                for _ in range(size.decode_batch)
            ],
            params=SamplingParams(group_size=1, max_new_tokens=size.decode_new),
        )
        got: list = []
        seconds = median_time(
            lambda: got.append(engine.generate(request)), self.device, repeats=repeats, warmup=1
        )
        new = got[-1].num_tokens
        if new != size.decode_batch * size.decode_new:
            raise RuntimeError(
                f"decoded {new} tokens, expected {size.decode_batch} x {size.decode_new}"
            )
        return {
            "batch": size.decode_batch,
            "prompt tokens": size.decode_prompt,
            "new tokens each": size.decode_new,
            "decode s": seconds,
            "new tokens/s": new / seconds,
        }

    def close(self) -> None:
        """Free the policy (its optimizer states fill the GPU) before another one is built."""
        del self.trainer, self.policy
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
