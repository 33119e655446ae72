"""One GSPO update of the policy on a batch of rollouts.

Reads as the algorithm does; each phase is a method of :class:`GSPOTrainer`:

1. ``plan``: split the rollout batch into mini-batches (one optimizer step each) and each
   mini-batch into this rank's micro-batches (:mod:`megatron_gspo.trainer.minibatches`);
2. ``compute_old_logprobs``: a forward-only pass of the pre-update policy over every
   mini-batch (which also records the routes for the flip rate and routing replay), unless the
   recipe trains on the rollout's own log-probs;
3. ``apply_off_policy_correction``: TIS/MIS weights where the recipe asks for them;
4. ``train_minibatch``: Megatron's schedule runs forward and backward, ``_loss`` (the loss
   closure) turns the last stage's vocab-parallel logits into fp32 log-probs and the policy
   loss; one optimizer step;
5. metrics reduced over micro-batches and ranks (:mod:`megatron_gspo.trainer.metrics`).

Normalization: Megatron averages each micro-batch's loss over the ``M`` micro-batches and the
``D`` data(-and-context)-parallel ranks, and scales the router's aux loss the same way. The loss
function therefore multiplies the policy loss, already divided by the mini-batch's global
sequence count ``N``, by ``D * M``: the gradient is then exactly ``(1/N) sum_i``, whatever the
layout, while the aux loss keeps Megatron's own mean.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from megatron_gspo.config import LossConfig
from megatron_gspo.loss import get_policy_loss, token_logprobs
from megatron_gspo.loss.kl import reference_kl
from megatron_gspo.model.router_stats import set_replay
from megatron_gspo.model.routes import routes_for_routers
from megatron_gspo.runtime.errors import InputError
from megatron_gspo.trainer.correction import apply_correction, correction_of
from megatron_gspo.trainer.metrics import (
    MISMATCH,
    reduce_reports,
    reports_metrics,
    router_metrics,
    sampler_kl_metrics,
)
from megatron_gspo.trainer.minibatches import MiniBatchPlan, StepPlanner
from megatron_gspo.trainer.packing import (
    MicroBatch,
    Sample,
)
from megatron_gspo.trainer.policy import Policy


def _loss_kwargs(loss: LossConfig) -> dict:
    kwargs: dict = {"max_log_ratio": loss.max_log_ratio}
    if loss.eps_low is not None:
        kwargs["eps_low"] = loss.eps_low
    if loss.eps_high is not None:
        kwargs["eps_high"] = loss.eps_high
    return kwargs


class GSPOTrainer:
    """Applies the policy loss of a recipe to rollout batches with a :class:`Policy`."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.recipe = policy.recipe
        self.groups = policy.groups
        self.loss_name = self.recipe.loss.name
        self.replay = self.recipe.train.routing_replay
        # Ids past the tokenizer's vocabulary are Megatron's padding: never scored.
        self.vocab_size = self.recipe.model.vocab_size
        self.loss_fn = get_policy_loss(self.loss_name)
        self.correction = correction_of(self.recipe)
        # Per-token weights need per-token advantages: GSPO takes them in its token form,
        # which with A_{i,t} = A_i w_t is GSPO with each token's gradient weighted.
        token_name = "gspo_token" if self.loss_name == "gspo" else self.loss_name
        self.token_loss_fn = get_policy_loss(token_name)
        self.loss_kwargs = _loss_kwargs(self.recipe.loss)
        self.kl_coef = self.recipe.loss.kl_coef
        self.kl_metrics = ("kl_ref",) if self.kl_coef > 0 else ()
        self.unit_weight = "num_valid_tokens" if self.loss_name == "grpo" else "num_valid_sequences"
        # Micro-batches are built on the CPU and moved to the model's device (a GPU's).
        self.device = next(policy.model.parameters()).device
        self.planner = StepPlanner(self.recipe, self.groups, policy.config, self.device)
        self.cp_size = self.planner.cp_size

    def plan(self, samples: list[Sample]) -> list[MiniBatchPlan]:
        return self.planner.plan(samples)

    # ---------------------------------------------------------------- passes
    def _schedule(
        self, plan: MiniBatchPlan, forward_step, *, forward_only: bool, model=None
    ) -> list[dict]:
        mbs = plan.microbatches
        return self.policy.run_schedule(
            forward_step,
            list(enumerate(mbs)),
            len(mbs),
            # Megatron's shapes are those of the full sequences (it divides by CP itself).
            seq_length=max(mb.tokens.shape[1] for mb in mbs) * self.cp_size,
            micro_batch_size=max(mb.tokens.shape[0] for mb in mbs),
            forward_only=forward_only,
            model=model,
        )

    def _model_forward(self, model, mb: MicroBatch):
        padding = mb.padding_mask
        if padding is not None and self.recipe.parallel.sequence_parallel:
            core = model
            while hasattr(core, "module"):
                core = core.module
            if not core.pre_process:
                # GPTModel splits the mask along the sequence on the first stage only.
                tp = self.recipe.parallel.tensor_model_parallel_size
                padding = padding.chunk(tp, dim=1)[parallel_state.get_tensor_model_parallel_rank()]
        return model(
            mb.tokens,
            mb.position_ids,
            mb.attention_mask,
            padding_mask=padding,
            packed_seq_params=mb.packed_seq_params(self.groups.cp),
        )

    def _logprob_pass(self, plan: MiniBatchPlan, *, model=None, before=None, after=None):
        """A forward-only pass over the plan's micro-batches (the policy's, or ``model``'s):
        yields each micro-batch with its fp32 log-probs, zero off the loss mask (last stage).
        ``before(m_idx)`` and ``after()`` run around each micro-batch's forward."""

        def forward_step(data_iterator, model):
            m_idx, mb = next(data_iterator)
            if before is not None:
                before(m_idx)
            out = self._model_forward(model, mb)
            if after is not None:
                after()

            def loss_func(logits):
                lp = token_logprobs(
                    logits, mb.targets, tp_group=self.groups.tp, vocab_size=self.vocab_size
                )
                return lp.sum() * 0, torch.tensor(1), {"logprobs": lp, "mb": m_idx}

            return out, loss_func

        for rep in self._schedule(plan, forward_step, forward_only=True, model=model):
            mb = plan.microbatches[rep["mb"]]
            yield mb, rep["logprobs"].float() * mb.loss_mask

    @torch.no_grad()
    def compute_old_logprobs(
        self, plans: list[MiniBatchPlan], version: int | None = None
    ) -> dict[str, float]:
        """Put the pre-update policy's log-probs into every micro-batch (on the last stage).

        Also records every micro-batch's routes, and measures the train/rollout mismatch
        against the rollout log-probs the micro-batches were built with: over every token
        (``rollout_kl_k3``, which holds the policy's own change since a stale sample's weights)
        and over the tokens sampled by the weights the policy holds, ``version``
        (``rollout_sampler_kl``: the engine's error alone).
        """
        stats = self.policy.router_stats
        # sum |d|, sum k3(d), tokens; then sum k3(d) and tokens of the on-policy tokens, and
        # of the tokens sampled after an in-flight update
        diff = torch.zeros(7, dtype=torch.float64)
        self.policy.train(False)
        for p_idx, plan in enumerate(plans):
            hooks = {}
            if stats is not None:

                def before(m_idx, p_idx=p_idx, plan=plan):
                    rollout = self._router_routes(plan.microbatches[m_idx])
                    if self.replay == "rollout":
                        set_replay(RouterReplayAction.REPLAY_FORWARD, rollout)
                    stats.record((p_idx, m_idx), rollout=rollout)

                hooks = dict(before=before, after=self._forward_done)
            for mb, lp in self._logprob_pass(plan, **hooks):
                if mb.has_rollout_logprobs and reports_metrics(tokens=True):
                    d = (lp - mb.old_logprobs).double()
                    k3 = (d.exp() - 1 - d) * mb.loss_mask
                    after = torch.zeros_like(k3)
                    if mb.after_update is not None:
                        after = mb.after_update.to(k3) * mb.loss_mask
                    on = torch.zeros_like(k3)
                    if version is not None:
                        # Not a token whose KV cache older weights computed: that is the
                        # in-flight update's error, reported on its own, not the engine's.
                        on = (mb.versions == version).to(k3) * mb.loss_mask * (1 - after)
                    sums = [d.abs().sum(), k3.sum(), mb.loss_mask.sum(), (k3 * on).sum(), on.sum()]
                    sums += [(k3 * after).sum(), after.sum()]
                    diff += torch.stack(sums).to(diff)
                mb.old_logprobs = lp
        self.policy.train(True)
        # Each replica measured its own samples, once: sum over the world.
        dist.all_reduce(diff)
        if diff[2] == 0:
            return {}
        return {
            "rollout_logprob_abs_diff": float(diff[0] / diff[2]),
            "rollout_kl_k3": float(diff[1] / diff[2]),
            **sampler_kl_metrics(float(diff[3]), float(diff[4])),
            **_split_k3(diff),
        }

    @torch.no_grad()
    def sampler_kl(self, samples: list[Sample]) -> dict[str, float]:
        """``rollout_sampler_kl`` of samples whose ``rollout_logprobs`` the engine computed with
        the weights the policy holds now: the policy scores the same tokens (one forward-only
        pass), and the figure is the mean k3 over their scored tokens. Collective."""
        diff = torch.zeros(2, dtype=torch.float64)
        (plan,) = self.planner.plan(samples, mini_batches=1)
        self.policy.train(False)
        for mb, lp in self._logprob_pass(plan):
            if mb.has_rollout_logprobs and reports_metrics(tokens=True):
                d = (lp - mb.old_logprobs).double()
                k3 = (d.exp() - 1 - d) * mb.loss_mask
                diff += torch.stack([k3.sum(), mb.loss_mask.sum()]).to(diff)
        self.policy.train(True)
        dist.all_reduce(diff)
        return sampler_kl_metrics(float(diff[0]), float(diff[1]))

    @torch.no_grad()
    def compute_reference_logprobs(self, plans: list[MiniBatchPlan]) -> None:
        """Put the frozen reference policy's log-probs into every micro-batch (loss.kl_coef)."""
        for plan in plans:
            for mb, lp in self._logprob_pass(plan, model=self.policy.reference):
                mb.ref_logprobs = lp

    def apply_off_policy_correction(
        self, plans: list[MiniBatchPlan]
    ) -> tuple[list[MiniBatchPlan], dict[str, float]]:
        """Weigh (TIS) or mask (MIS) units by pi_old / pi_behaviour; recount what is trained
        (:mod:`megatron_gspo.trainer.correction`)."""
        return apply_correction(plans, self.correction, self.groups.cp)

    def _router_routes(self, mb: MicroBatch) -> list[torch.Tensor] | None:
        """The micro-batch's rollout routes as this stage's routers see its tokens (filler
        routes for a filler micro-batch under rollout replay, which still routes)."""
        routes = mb.routes
        if routes is None and self.replay == "rollout":
            model = self.recipe.model
            filler = torch.arange(model.moe_router_topk, dtype=torch.int16, device=self.device)
            routes = filler.expand(*mb.tokens.shape, len(model.moe_layers), len(filler))
        if routes is None or self.policy.router_stats is None:
            return None
        parallel = self.recipe.parallel
        return routes_for_routers(
            routes,
            self.policy.router_stats.layer_index,
            sequence_parallel=parallel.sequence_parallel,
            tp_rank=parallel_state.get_tensor_model_parallel_rank(),
            tp_size=parallel.tensor_model_parallel_size,
        )

    def _forward_done(self) -> None:
        self.policy.router_stats.done()
        if self.replay != "none":
            set_replay(None)

    def train_minibatch(self, p_idx: int, plan: MiniBatchPlan) -> dict[str, float]:
        stats = self.policy.router_stats
        num_micro = len(plan.microbatches)
        scale = self.groups.dp_cp_size * num_micro

        def forward_step(data_iterator, model):
            m_idx, mb = next(data_iterator)
            key = (p_idx, m_idx)
            if stats is not None:
                rollout = None
                if self.replay == "rollout" or mismatch:
                    rollout = self._router_routes(mb)
                if self.replay == "old_policy":
                    set_replay(RouterReplayAction.REPLAY_FORWARD, stats.recorded_indices(key))
                elif self.replay == "rollout":
                    set_replay(RouterReplayAction.REPLAY_FORWARD, rollout)
                if mismatch:
                    # No old-policy pass: the pre-update routing is this forward's.
                    stats.record(key, rollout=rollout)
                else:
                    stats.compare(key)
            out = self._model_forward(model, mb)
            if stats is not None:
                self._forward_done()
            return out, lambda logits: self._loss(
                logits, mb, plan.num_sequences, scale, mismatch=mismatch
            )

        # With the rollout's log-probs as old ones, the first mini-batch's forward is the
        # pre-update policy: where the train/inference mismatch is measured for free.
        mismatch = self.recipe.train.old_logprobs == "rollout" and p_idx == 0
        reports = self._schedule(plan, forward_step, forward_only=False)
        metrics = self.policy.optimizer_step()
        metrics.update(
            reduce_reports(
                reports,
                self.unit_weight,
                extra_token_metrics=(*(MISMATCH if mismatch else ()), *self.kl_metrics),
            )
        )
        return metrics

    def _loss(
        self,
        logits: torch.Tensor,
        mb: MicroBatch,
        num_sequences: int,
        scale: int,
        *,
        mismatch: bool = False,
    ):
        lp, entropy = token_logprobs(
            logits,
            mb.targets,
            tp_group=self.groups.tp,
            return_entropy=True,
            vocab_size=self.vocab_size,
        )
        if mb.num_sequences == 0 or not self._any_token(mb):
            # A filler micro-batch (or one the off-policy correction masked entirely) keeps
            # the schedule in step across ranks; no loss.
            zero = lp.sum() * 0
            return zero, torch.tensor(1), {"num_valid_sequences": torch.tensor(0.0)}
        loss_fn, advantages = self.loss_fn, mb.advantages
        if mb.token_advantages is not None:
            loss_fn, advantages = self.token_loss_fn, mb.token_advantages[mb.region]
        # Padded or packed (cu_seqlens), normalized by the mini-batch's global sequence count.
        region = mb.region
        sequences = {
            "cu_seqlens": mb.cu_seqlens,
            "num_sequences": num_sequences,
            "cp_group": self.groups.cp,
        }
        loss, metrics = loss_fn(
            lp[region],
            mb.old_logprobs[region],
            advantages,
            mb.loss_mask[region],
            **sequences,
            **self.loss_kwargs,
        )
        metrics = dict(metrics)
        if self.kl_coef > 0:
            kl, kl_metrics = reference_kl(
                lp[region], mb.ref_logprobs[region], mb.loss_mask[region], **sequences
            )
            loss = loss + self.kl_coef * kl
            metrics.update(kl_metrics)
        mask = mb.loss_mask
        token_sums = {"entropy": entropy.detach() * mask}
        if mismatch:
            d = (lp.detach() - mb.old_logprobs) * mask
            token_sums["rollout_logprob_abs_diff"] = d.abs()
            token_sums["rollout_kl_k3"] = (d.exp() - 1 - d) * mask
        metrics.update(self._token_means(token_sums, mask))
        metrics["loss"] = loss.detach()
        return loss * scale, torch.tensor(1), metrics

    def _any_token(self, mb: MicroBatch) -> bool:
        """Whether the micro-batch has a token to train on, decided alike on its CP ranks (a
        rank's share of the sequences can hold none, and the loss's reductions are
        collective)."""
        any_token = mb.loss_mask.any().reshape(1).to(torch.int32)
        if self.cp_size > 1:
            dist.all_reduce(any_token, op=dist.ReduceOp.MAX, group=self.groups.cp)
        return bool(any_token)

    @torch.no_grad()
    def _token_means(self, sums: dict[str, torch.Tensor], mask: torch.Tensor) -> dict:
        """Means over the micro-batch's response tokens of the given per-token values; under
        context parallelism over the full sequences, like the loss's own metrics."""
        totals = torch.stack([v.sum() for v in sums.values()] + [mask.sum()]).double()
        if self.cp_size > 1:
            dist.all_reduce(totals, group=self.groups.cp)
        count = totals[-1].clamp(min=1)
        return {k: totals[i] / count for i, k in enumerate(sums)}

    # ---------------------------------------------------------------- the step
    def step(self, samples: list[Sample], version: int | None = None) -> dict[str, float]:
        """One rollout batch: old log-probs, then one optimizer step per mini-batch.
        ``version``: the weights version the policy holds (tells on-policy samples)."""
        from_rollout = self.recipe.train.old_logprobs == "rollout"
        if from_rollout and any(s.rollout_logprobs is None for s in samples):
            raise InputError("train.old_logprobs=rollout needs log-probs from the rollout engine")
        # Micro-batches carry the rollout's log-probs as old ones until recomputed.
        t0 = time.perf_counter()
        plans = self.plan(samples)
        metrics: dict[str, float] = {}
        stats = self.policy.router_stats
        if stats is not None:
            stats.clear()
        t1 = time.perf_counter()
        if not from_rollout:
            metrics.update(self.compute_old_logprobs(plans, version))
        t2 = time.perf_counter()
        if self.policy.reference is not None:
            self.compute_reference_logprobs(plans)
        if self.correction.mode != "none":
            plans, corrected = self.apply_off_policy_correction(plans)
            metrics.update(corrected)
        if stats is not None:
            stats.reset_counts()
        per_mini = defaultdict(list)
        for p_idx, plan in enumerate(plans):
            if plan.num_sequences == 0:
                # Everything masked: no update from this mini-batch (Adam would still move).
                continue
            for k, v in self.train_minibatch(p_idx, plan).items():
                per_mini[k].append(v)
        if not per_mini:
            raise InputError(
                "the off-policy correction masked every sequence of the batch; widen "
                "train.off_policy_correction's band or check the rollout engine's log-probs"
            )
        metrics.update({k: sum(v) / len(v) for k, v in per_mini.items()})
        # Where a step's time goes on this rank (benchmarks/step_time.py reads them).
        metrics.update(
            time_plan_s=t1 - t0, time_old_logprobs_s=t2 - t1, time_update_s=time.perf_counter() - t2
        )
        if from_rollout and "rollout_kl_k3" in metrics and _all_of(samples, version):
            # The first mini-batch's forward measured every token, each sampled by these weights.
            first = plans[0].samples
            tokens = sum(sum(s.response_mask or [1] * len(s.response_ids)) for s in first)
            metrics.update(sampler_kl_metrics(metrics["rollout_kl_k3"] * tokens, tokens))
        metrics["seq_log_ratio_abs_max"] = max(per_mini["seq_log_ratio_abs_max"])
        if stats is not None:
            metrics.update(
                router_metrics(stats, sequence_parallel=self.recipe.parallel.sequence_parallel)
            )
        return metrics


def _all_of(samples: list[Sample], version: int | None) -> bool:
    return version is not None and all(s.policy_version == version for s in samples)


def _split_k3(diff: torch.Tensor) -> dict[str, float]:
    """``rollout_kl_k3`` over the tokens sampled after an in-flight update and over the rest
    (none without in-flight updates: nothing then)."""
    if diff[6] == 0:
        return {}
    rest = diff[2] - diff[6]
    return {
        "rollout_kl_k3_after_update": float(diff[5] / diff[6]),
        "rollout_kl_k3_before_update": float((diff[1] - diff[5]) / rest) if rest > 0 else 0.0,
    }
