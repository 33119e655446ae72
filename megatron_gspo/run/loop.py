"""The GSPO loop: sample episodes, score them, update the policy, sync, checkpoint, report.

Every rank runs :func:`train` (``torchrun`` or a single process); its parts come from
:class:`megatron_gspo.run.session.Session`. One step:

1. the next prompts, and ``group_size`` episodes of each from the rollout engine (one model
   turn, or several with an environment's turns between them: :mod:`megatron_gspo.episodes`;
   with ``rollout.max_staleness`` K >= 1 sampled ahead by weights at most K updates old:
   :mod:`megatron_gspo.episodes.pipeline`);
2. rank 0 scores them (reward functions, the environment's turn rewards) and shares the
   scores; samples whose score failed are dropped or zeroed; advantages per episode or per
   turn (:mod:`megatron_gspo.episodes.scoring`);
3. the trainer updates the policy with the recipe's loss (GSPO by default);
4. once generation in flight has finished, the engine is given the new weights;
5. evaluation, metrics, and every ``run.checkpoint_every`` steps a checkpoint.

An engine that cannot sample any more (fewer vLLM servers serve than
``rollout.vllm.min_servers``: :class:`~megatron_gspo.rollout.protocol.EngineDownError`) ends
the run as SIGTERM does: a checkpoint of the last step trained (what it had sampled ahead
kept, or its prompts drawn again), then exit 75.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_gspo.config import Recipe
from megatron_gspo.episodes.dynamic_sampling import groups_without_signal
from megatron_gspo.episodes.pipeline import Batch
from megatron_gspo.parallel import init_parallel
from megatron_gspo.rollout.protocol import EngineDownError
from megatron_gspo.run.checks import refuse_problems
from megatron_gspo.run.plot import BackgroundPlots
from megatron_gspo.run.rundir import RunOptions, open_run
from megatron_gspo.run.session import Session
from megatron_gspo.run.signals import PREEMPTED_MARKER, catch_sigterm, sigterm_received
from megatron_gspo.runtime.rank0 import on_rank0
from megatron_gspo.trainer.metrics import merge_sampler_kl
from megatron_gspo.trainer.packing import Sample

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


def _empty_responses(batch: Batch) -> bool:
    return any(not e.token_ids for g in batch.episodes for e in g)


PREEMPTED = PREEMPTED_MARKER


class Preempted(Exception):
    """The run stopped on SIGTERM (or ``why``) after saving a checkpoint at ``step`` (or,
    ``saved=False``, during start-up, having written nothing); resume to continue."""

    def __init__(
        self, step: int, run_dir: Path, *, saved: bool = True, why: str = "on SIGTERM"
    ) -> None:
        what = f"after saving step {step}" if saved else "during start-up (nothing to save)"
        super().__init__(f"stopped {why} {what} in {run_dir}")
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

    Where it starts, or why it refuses to, is :mod:`megatron_gspo.run.rundir`'s decision: resume
    from the directory's checkpoint (``resume_from_last_good``: the newest that verifies;
    ``trust_unverified``: one without a manifest), or, ``resume=False``, start afresh,
    refused where the directory holds a run unless ``overwrite`` (which deletes it first)."""
    stop = StopFlag()  # first: a SIGTERM during start-up stops the run, not the process
    run_dir = Path(output_dir)
    total = steps if steps is not None else recipe.run.steps
    groups = init_parallel(recipe.parallel)
    on_rank0(refuse_problems, recipe, run_dir)
    options = RunOptions(resume, overwrite, resume_from_last_good, trust_unverified)
    total_from = "--steps" if steps is not None else "run.steps"
    lock, start = open_run(run_dir, options, total=total, total_from=total_from)
    if start.done:
        return _release(lock, run_dir)
    _stop_before_start(stop, start.step, run_dir, lock)
    run = Session(recipe, run_dir, groups)
    _stop_before_start(stop, start.step, run_dir, lock)
    run.resume(start)
    _stop_before_start(stop, start.step, run_dir, lock)
    run.begin(start)
    rank0 = run.rank0
    if recipe.eval.every and run.start == 0:
        run.logger.log(0, run.evaluate(0))
    run.rollouts.resume(version=run.start)
    bar = _progress(total, run.start, enabled=rank0)
    plots = BackgroundPlots(run_dir) if rank0 and recipe.run.plot_every else None
    step, stopping = run.start, False
    for step in range(run.start + 1, total + 1):
        t0 = time.perf_counter()
        # A checkpoint written in the background is published once its writers are done.
        run.checkpoints.poll()
        # 1. Episodes: the policy holds step - 1 updates; the batch may come from an older
        # version (rollout.max_staleness).
        drawn_from = (run.stream.position, run.stream.skipped)
        try:
            batch = run.rollouts.take(step, current_version=step - 1)
        except EngineDownError as e:
            # Nothing of this step is trained: keep step - 1, and the prompts it would draw.
            run.stream.position, run.stream.skipped = drawn_from
            if step - 1 not in (run.checkpoints.latest_step(), run.checkpoints.pending):
                run.save(step - 1, best=False)
            _exit_engine_down(run, step - 1, lock, e)
        if _empty_responses(batch):
            raise RuntimeError("the rollout engine returned an empty response")
        # 2. Rewards, failed scores, credit (advantages); dynamic sampling tops the batch up.
        samples, metrics = run.scorer(batch.prompts, batch.episodes)
        samples = run.fill(step, samples, metrics)
        metrics.update(
            batch.stats,
            **staleness_metrics(samples, step - 1),
            train_groups_without_signal=groups_without_signal(samples),
            **{run.rollouts.dropped_metric: run.rollouts.dropped},
            prompts_skipped_overlong=run.stream.skipped,
            bad_records_skipped=run.stream.bad_records,
        )
        t1 = time.perf_counter()
        # 3. The update: old log-probs, then one optimizer step per mini-batch.
        if len(samples) >= recipe.train.mini_batches:
            metrics.update(run.trainer.step(samples, version=step - 1))
        else:  # failed scores or the overlong filter took (nearly) every sample
            log.warning("step %d: %d sample(s) left to train on; no update", step, len(samples))
            metrics["update_skipped"] = 1.0
        # 4. Weight sync, once generation in flight has finished on the weights it started with
        # (or under it: rollout.in_flight_updates).
        run.rollouts.pause()
        if (waited := run.rollouts.waited()) is not None:
            metrics["time_waiting_for_generation_s"] = waited
        down: EngineDownError | None = None
        try:
            run.engine.sync_weights(step)
            metrics.update(run.engine.step_metrics())
            # What the engine computes otherwise on the weights it just received.
            metrics.update(merge_sampler_kl(metrics, run.probe_sampler(samples)))
        except EngineDownError as e:
            down = e  # the step is trained: it is logged and saved, then the run stops
        t2 = time.perf_counter()
        # 5. Evaluation, metrics, checkpoint.
        improved = False
        if down is None and run.is_eval_step(step, total):
            try:
                metrics.update(run.evaluate(step))
            except EngineDownError as e:
                down = e
            else:
                value = metrics["eval_reward_mean"]
                best = run.best_eval
                improved = recipe.eval.keep_best and (best is None or value > best["value"])
                if improved:
                    run.best_eval = {"step": step, "value": value}
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        metrics.update(
            time_rollout_s=t1 - t0,
            time_train_s=t2 - t1,
            step_time_s=t2 - t0,
            train_tokens_per_s=tokens / max(t2 - t1, 1e-9),
            # The loop's time lost to checkpoints since the last step's report (the previous
            # step's save, this one's publication of a background save).
            checkpoint_blocked_s=run.checkpoints.take_blocked_s(),
        )
        run.logger.log(step, metrics)
        _report(bar, step, total, metrics)
        # A sampler that keeps disagreeing with the trainer stops the run (before its save).
        run.kl_guard.check(step, metrics)
        stopping = stop.any_rank()
        due = step % recipe.run.checkpoint_every == 0 or step == total or stopping or improved
        if due or down is not None:
            run.save(step, best=improved)
        if down is not None:
            _exit_engine_down(run, step, lock, down)
        if plots is not None and step % recipe.run.plot_every == 0:
            plots.request()
        if stopping:
            log.warning("SIGTERM: saved a checkpoint at step %d; exiting", step)
            break
        if step < total:
            run.rollouts.resume(version=step)
    run.close()
    if plots is not None:
        plots.close(final=not stopping)  # the run's last figures, drawn before it returns
    if bar is not None:
        bar.close()
    if stopping:
        if rank0:
            (run_dir / PREEMPTED).write_text(f"{step}\n")
        _release(lock, run_dir)
        raise Preempted(step, run_dir)
    return _release(lock, run_dir)


def _exit_engine_down(run: Session, step: int, lock, error: EngineDownError):
    """End the run with exit 75 after the checkpoint of ``step``, as SIGTERM does (the marker
    tells ``launch``): requeued, it resumes there once the engine samples again."""
    log.error("%s", error)
    run.close()
    if dist.get_rank() == 0:
        (run.run_dir / PREEMPTED).write_text(f"{step}\n")
    _release(lock, run.run_dir)
    raise Preempted(step, run.run_dir, why="as the rollout engine is down") from error


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
    """How many updates behind the policy each sample's weights were (its oldest token's);
    where tokens say their own versions, the share of samples whose tokens come from more than
    one (``episodes_spanning_versions``) and of model tokens by age (``tokens_by_age/K``)."""
    lags = [current_version - s.policy_version for s in samples if s.policy_version is not None]
    if not lags:
        return {}
    out = {"staleness_mean": sum(lags) / len(lags), "staleness_max": float(max(lags))}
    per_token = [s for s in samples if s.token_versions is not None]
    if per_token:
        ages: Counter[int] = Counter()
        spanning = 0
        for s in per_token:
            mask = s.response_mask or [1] * len(s.response_ids)
            own = [v for v, m in zip(s.token_versions, mask, strict=True) if m and v >= 0]
            ages.update(current_version - v for v in own)
            spanning += len(set(own)) > 1
        out["episodes_spanning_versions"] = spanning / len(per_token)
        total = sum(ages.values()) or 1
        out.update({f"tokens_by_age/{k}": n / total for k, n in sorted(ages.items())})
    return out


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
