"""The GSPO loop: sample groups, score them, update the policy, sync, checkpoint, report.

Every rank runs this function (``torchrun`` or a single process). One step:

1. take the next prompts;
2. the rollout engine samples ``group_size`` responses to each (with ``rollout.max_staleness``
   K >= 1 this batch was sampled ahead, while the trainer trained on earlier ones, by weights
   at most K updates old: :mod:`megatron_gspo.rollout.pipeline`);
3. rank 0 scores them with the reward functions and shares the rewards;
4. group advantages ``A_i = (r_i - mean_group r) / (std_group r + eps)``;
5. the trainer updates the policy with the recipe's loss (GSPO by default);
6. once generation in flight has finished, the engine is given the new weights;
7. metrics, and every ``run.checkpoint_every`` steps a checkpoint.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_gspo.checkpoint import Checkpointer
from megatron_gspo.checks import refuse_problems
from megatron_gspo.config import Recipe
from megatron_gspo.data.packing import Sample
from megatron_gspo.data.prompts import Prompt, PromptStream
from megatron_gspo.data.rewards import RewardComputer, overlong_penalty
from megatron_gspo.dynamic_sampling import fill_with_signal, groups_without_signal
from megatron_gspo.errors import PREEMPTED_MARKER, catch_sigterm, sigterm_received
from megatron_gspo.evaluation import eval_prompts, evaluate, is_eval_step
from megatron_gspo.loss import group_advantages
from megatron_gspo.metrics import MetricsLogger
from megatron_gspo.model.routes import check_routes
from megatron_gspo.parallel import init_parallel
from megatron_gspo.policy import Policy
from megatron_gspo.rollout import RolloutRequest, RolloutResult, SamplingParams, make_engine
from megatron_gspo.rollout.pipeline import OnPolicyRollouts, RolloutPipeline
from megatron_gspo.rollout.protocol import Completion
from megatron_gspo.rundir import RunOptions, begin, on_rank0, open_run
from megatron_gspo.train_step import GSPOTrainer

log = logging.getLogger(__name__)


class StopFlag:
    """Set by SIGTERM (Slurm pre-emption, ``scontrol requeue``): finish the step, save, exit."""

    def __init__(self) -> None:
        catch_sigterm()

    @property
    def requested(self) -> bool:
        return sigterm_received()

    def any_rank(self) -> bool:
        flag = torch.tensor([1 if self.requested else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def score(
    result: RolloutResult,
    prompts: list[Prompt],
    stream: PromptStream,
    rewards: RewardComputer | None,
    recipe: Recipe,
) -> tuple[list[Sample], dict[str, float]]:
    """Rewards (computed on rank 0, shared with all), advantages, and the samples to train on."""
    group = recipe.rollout.group_size
    payload: list = [None]
    if dist.get_rank() == 0:
        texts = [stream.tokenizer.decode(c.token_ids) for g in result.completions for c in g]
        answers = [p.answer for p in prompts for _ in range(group)]
        payload = [rewards(texts, answers)]
    dist.broadcast_object_list(payload, src=0)
    values, stats = payload[0]
    completions = [c for g in result.completions for c in g]
    lengths = torch.tensor([float(len(c.token_ids)) for c in completions])
    truncated = [c.finish_reason == "length" for c in completions]
    penalty = recipe.reward.overlong_penalty
    penalties = [0.0] * len(completions)
    if penalty is not None:
        limit = recipe.rollout.max_new_tokens
        penalties = [
            overlong_penalty(len(c.token_ids), limit, penalty.cache_tokens, penalty.max_penalty)
            for c in completions
        ]
    r = torch.tensor(values, dtype=torch.float32)
    # Advantages see the shaped reward; reward_* metrics report the task's own.
    shaped = r + torch.tensor(penalties, dtype=torch.float32)
    adv = group_advantages(shaped, group, scale=recipe.loss.advantage_scale)
    samples, k = [], 0
    for p_idx, (prompt, completions) in enumerate(zip(prompts, result.completions, strict=True)):
        for c in completions:
            samples.append(
                Sample(
                    prompt_ids=prompt.token_ids,
                    response_ids=c.token_ids,
                    advantage=float(adv[k]),
                    rollout_logprobs=c.logprobs,
                    reward=values[k],
                    prompt_index=p_idx,
                    policy_version=c.policy_version,
                    routes=_checked_routes(c, prompt, recipe),
                )
            )
            k += 1
    finished = [c.finish_reason == "stop" for c in completions]
    per_group_std = (
        shaped.view(-1, group).std(dim=1, unbiased=False) if group > 1 else torch.zeros(1)
    )
    filtered = 0
    if recipe.train.overlong_filter:
        kept = [s for s, cut in zip(samples, truncated, strict=True) if not cut]
        filtered, samples = len(samples) - len(kept), kept
    metrics = {
        "reward_mean": float(r.mean()),
        "reward_std": float(r.std(unbiased=False)),
        "reward_max": float(r.max()),
        "groups_without_signal": float((per_group_std == 0).float().mean()),
        "response_length_mean": float(lengths.mean()),
        "response_length_max": float(lengths.max()),
        "finished_fraction": sum(finished) / len(finished),
        "reward_errors": float(stats.errors),
        "reward_timeouts": float(stats.timeouts),
        "overlong_fraction": sum(truncated) / len(truncated),
    }
    if penalty is not None:
        metrics["overlong_penalty_mean"] = sum(penalties) / len(penalties)
    if recipe.train.overlong_filter:
        metrics["overlong_filtered"] = float(filtered)
    return samples, metrics


def _checked_routes(c: Completion, prompt: Prompt, recipe: Recipe):
    """The completion's routes, which must cover every token the model reads (an engine that
    returns fewer rows than the sequence has tokens would misalign every later one)."""
    if not recipe.wants_rollout_routes:
        return None
    if c.routes is None:
        raise ValueError(
            f"rollout.engine {recipe.rollout.engine!r} returned no expert routes, which "
            "train.routing_replay: rollout / rollout.return_routes need"
        )
    m = recipe.model
    check_routes(
        c.routes,
        num_tokens=len(prompt.token_ids) + len(c.token_ids) - 1,
        num_moe_layers=len(m.moe_layers),
        topk=m.moe_router_topk,
        num_experts=m.num_experts,
        where=f"the routes of a response to prompt {prompt.token_ids[:8]}...",
    )
    return c.routes


def _empty_responses(result: RolloutResult) -> bool:
    return any(not c.token_ids for g in result.completions for c in g)


PREEMPTED = PREEMPTED_MARKER


class Preempted(Exception):
    """The run stopped on SIGTERM after saving a checkpoint at ``step`` (or, ``saved=False``,
    during start-up, having written nothing); resume to continue."""

    def __init__(self, step: int, run_dir: Path, *, saved: bool = True) -> None:
        what = f"after saving step {step}" if saved else "during start-up (nothing to save)"
        super().__init__(f"stopped on SIGTERM {what} in {run_dir}")
        self.step, self.run_dir = step, run_dir


def train(
    recipe: Recipe,
    *,
    output_dir: str | Path,
    resume: bool = True,
    steps: int | None = None,
    overwrite: bool = False,
    resume_from_last_good: bool = False,
    trust_unverified: bool = False,
) -> Path:
    """Run the recipe to ``steps`` (default ``run.steps``); returns the run directory.

    Where it starts, or why it refuses to, is :mod:`megatron_gspo.rundir`'s decision: resume
    from the directory's checkpoint (``resume_from_last_good``: the newest that verifies;
    ``trust_unverified``: one without a manifest), or, ``resume=False``, start afresh,
    refused where the directory holds a run unless ``overwrite`` (which deletes it first)."""
    stop = StopFlag()  # first: a SIGTERM during start-up stops the run, not the process
    run_dir = Path(output_dir)
    total = steps if steps is not None else recipe.run.steps
    groups = init_parallel(recipe.parallel)
    rank0 = dist.get_rank() == 0
    on_rank0(refuse_problems, recipe, run_dir)
    options = RunOptions(resume, overwrite, resume_from_last_good, trust_unverified)
    total_from = "--steps" if steps is not None else "run.steps"
    lock, begin_at = open_run(run_dir, options, total=total, total_from=total_from)
    if begin_at.done:
        return _release(lock, run_dir)
    _stop_before_start(stop, begin_at.step, run_dir, lock)
    max_prompt_tokens = recipe.model.max_seq_length - recipe.rollout.max_new_tokens
    stream = PromptStream(
        recipe.data, seed=recipe.rollout.seed, max_prompt_tokens=max_prompt_tokens
    )
    eval_set = eval_prompts(recipe, max_prompt_tokens) if recipe.eval.every else []
    rewards = RewardComputer(recipe.reward) if rank0 else None
    policy = Policy(recipe, groups)
    trainer = GSPOTrainer(policy)
    engine = make_engine(recipe, policy)
    checkpoints = Checkpointer(run_dir / "checkpoints", policy, keep=recipe.run.keep_checkpoints)

    _stop_before_start(stop, begin_at.step, run_dir, lock)
    start, best_eval = 0, None
    latest = begin_at.step or None
    if latest is not None:
        state = checkpoints.load(latest, manifest=begin_at.manifest)
        start, stream.position = latest, state["data_position"]
        stream.skipped = state.get("prompts_skipped", 0)
        best_eval = state.get("eval_best")
        log.info("resumed from %s at step %d", checkpoints.dir, start)
    elif recipe.run.init_from:
        policy.load_weights(recipe.run.init_from)
        log.info("initial weights from %s", recipe.run.init_from)
    # Whatever a server loaded at start-up, it samples from the trainer's weights from here on;
    # the weights version is the number of steps applied.
    engine.sync_weights(start)

    _stop_before_start(stop, start, run_dir, lock)
    if rank0:
        begin(run_dir, begin_at)
    logger = MetricsLogger(
        run_dir,
        enabled=rank0,
        tensorboard=recipe.run.tensorboard,
        wandb_project=recipe.run.wandb_project,
        config=recipe.model_dump(),
    )
    if rank0:
        (run_dir / "recipe.yaml").write_text(_yaml(recipe))
    params = dict(
        group_size=recipe.rollout.group_size,
        temperature=recipe.rollout.temperature,
        top_p=recipe.rollout.top_p,
        max_new_tokens=recipe.rollout.max_new_tokens,
        stop_token_ids=tuple(recipe.rollout.stop_token_ids or [stream.tokenizer.eos_id]),
        return_routes=recipe.wants_rollout_routes,
    )
    rollouts = _rollouts(recipe, engine, stream, params, next_step=start + 1)
    if latest is not None:
        rollouts.restore(state.get("rollout_queue", []))

    def run_eval(step: int) -> dict[str, float]:
        # Called while no generation is in flight (before the pipeline starts, or paused).
        if recipe.rollout.max_staleness == 0:
            generate = engine.generate
        else:
            generate = engine.generate_rank0 if rank0 else None
        return evaluate(
            generate,
            eval_set,
            stream.tokenizer.decode,
            rewards,
            recipe,
            step=step,
            params=params,
        )

    if recipe.eval.every and start == 0:
        logger.log(0, run_eval(0))
    rollouts.resume()
    bar = _progress(total, start, enabled=rank0)
    step, stopping = start, False
    for step in range(start + 1, total + 1):
        t0 = time.perf_counter()
        # The policy holds step - 1 updates; the batch may come from an older version.
        batch = rollouts.take(step, current_version=step - 1)
        if _empty_responses(batch.result):
            raise RuntimeError("the rollout engine returned an empty response")
        samples, metrics = score(batch.result, batch.prompts, stream, rewards, recipe)
        if recipe.rollout.dynamic_sampling is not None:

            def more(round_: int, step=step) -> list[Sample]:
                prompts = stream.next_batch(recipe.rollout.prompts_per_step)
                request = _request(prompts, params, _step_seed(recipe, step) * 1_009 + round_)
                return score(engine.generate(request), prompts, stream, rewards, recipe)[0]

            samples, filled = fill_with_signal(
                samples,
                more,
                want=recipe.rollout.prompts_per_step,
                max_rounds=recipe.rollout.dynamic_sampling.max_rounds,
            )
            metrics.update(filled)
        metrics["train_groups_without_signal"] = groups_without_signal(samples)
        metrics.update(
            staleness_metrics(samples, step - 1),
            rollout_batches_dropped=rollouts.dropped,
            prompts_skipped_overlong=stream.skipped,
            bad_records_skipped=stream.bad_records,
        )
        t1 = time.perf_counter()
        if len(samples) >= recipe.train.mini_batches:
            metrics.update(trainer.step(samples))
        else:  # train.overlong_filter took (nearly) every response of the batch
            log.warning("step %d: %d sample(s) left to train on; no update", step, len(samples))
            metrics["update_skipped"] = 1.0
        # Generation in flight finishes on the weights it started with, then the sync.
        rollouts.pause()
        engine.sync_weights(step)
        t2 = time.perf_counter()
        improved = False
        if is_eval_step(recipe, step, total):
            metrics.update(run_eval(step))
            value = metrics["eval_reward_mean"]
            improved = recipe.eval.keep_best and (best_eval is None or value > best_eval["value"])
            if improved:
                best_eval = {"step": step, "value": value}
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        metrics.update(
            time_rollout_s=t1 - t0,
            time_train_s=t2 - t1,
            step_time_s=t2 - t0,
            train_tokens_per_s=tokens / max(t2 - t1, 1e-9),
        )
        logger.log(step, metrics)
        _report(bar, step, total, metrics)
        stopping = stop.any_rank()
        if step % recipe.run.checkpoint_every == 0 or step == total or stopping or improved:
            # Batches already generated for later steps are saved, so a resumed run trains on
            # exactly what this one would have.
            checkpoints.save(
                step,
                {
                    "data_position": stream.position,
                    "prompts_skipped": stream.skipped,
                    "rollout_queue": rollouts.state(),
                    "eval_best": best_eval,
                },
            )
            if improved:
                checkpoints.mark_best(step)
        if rank0 and recipe.run.plot_every and (step % recipe.run.plot_every == 0 or step == total):
            _plot(run_dir)
        if stopping:
            log.warning("SIGTERM: saved a checkpoint at step %d; exiting", step)
            break
        if step < total:
            rollouts.resume()
    rollouts.close()
    if bar is not None:
        bar.close()
    logger.close()
    engine.close()
    if rewards is not None:
        rewards.close()
    if stopping:
        if rank0:
            (run_dir / PREEMPTED).write_text(f"{step}\n")
        _release(lock, run_dir)
        raise Preempted(step, run_dir)
    return _release(lock, run_dir)


def _release(lock, run_dir: Path) -> Path:
    if lock is not None:
        lock.release()
    return run_dir


def _stop_before_start(stop: StopFlag, step: int, run_dir: Path, lock) -> None:
    """A SIGTERM before the first step: exit 75 having written nothing but the pre-emption
    marker (which tells ``launch`` to pass 75 on)."""
    if not stop.any_rank():
        return
    if dist.get_rank() == 0:
        (run_dir / PREEMPTED).write_text(f"{step}\n")
    _release(lock, run_dir)
    raise Preempted(step, run_dir, saved=False)


def staleness_metrics(samples: list[Sample], current_version: int) -> dict[str, float]:
    """How many updates behind the policy each sample's weights were."""
    lags = [current_version - s.policy_version for s in samples if s.policy_version is not None]
    if not lags:
        return {}
    return {"staleness_mean": sum(lags) / len(lags), "staleness_max": float(max(lags))}


def _step_seed(recipe: Recipe, step: int) -> int:
    """The sampling seed of a step's rollout batch."""
    return recipe.rollout.seed * 1_000_003 + step


def _request(prompts: list[Prompt], params: dict, seed: int) -> RolloutRequest:
    return RolloutRequest([p.token_ids for p in prompts], SamplingParams(**params, seed=seed))


def _rollouts(recipe: Recipe, engine, stream: PromptStream, params: dict, *, next_step: int):
    """On-policy sampling (``max_staleness: 0``) or the asynchronous pipeline."""

    def draw(step: int) -> list[Prompt]:
        return stream.next_batch(recipe.rollout.prompts_per_step)

    def request(step: int, prompts: list[Prompt]) -> RolloutRequest:
        return _request(prompts, params, _step_seed(recipe, step))

    k = recipe.rollout.max_staleness
    if k == 0:
        return OnPolicyRollouts(engine.generate, draw, request)
    generate = engine.generate_rank0 if dist.get_rank() == 0 else None
    return RolloutPipeline(generate, draw, request, max_staleness=k, next_step=next_step)


def _yaml(recipe: Recipe) -> str:
    import yaml

    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)


def _plot(run_dir: Path) -> None:
    from megatron_gspo.plot import plot_run

    try:
        plot_run(run_dir)
    except Exception as e:  # noqa: BLE001 - a failed plot must not end a training run
        log.warning("plotting failed: %s", e)


def _progress(total: int, start: int, *, enabled: bool):
    if not enabled or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)


def _report(bar, step: int, total: int, m: dict[str, float]) -> None:
    line = (
        f"step {step}/{total}  reward {m['reward_mean']:.3f}  "
        f"clip {m.get('clip_fraction', 0.0):.3f}  kl {m.get('approx_kl', 0.0):.2e}  "
        f"len {m['response_length_mean']:.1f}  {m['step_time_s']:.2f}s"
    )
    if bar is not None:
        bar.set_postfix_str(f"reward {m['reward_mean']:.3f}  {m['step_time_s']:.2f}s/step")
        bar.update(1)
        if step % 10 == 0:
            bar.write(line)
    elif dist.get_rank() == 0:
        log.info(line)
