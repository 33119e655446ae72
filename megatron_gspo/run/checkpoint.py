"""Training checkpoints: Megatron distributed checkpoints, written atomically, synchronously or
in the background (``run.async_save``).

A checkpoint is ``iter_NNNNNNN/`` holding the model and optimizer as a Megatron-Core
distributed checkpoint (each rank writes its shards), the LR schedule, the data position and
every rank's random generator states (:mod:`megatron_gspo.run.rng`). It is written into
``.iter_NNNNNNN.tmp`` and renamed into place only when every rank has finished and its
manifest is written; ``latest`` names the newest complete one and is replaced atomically after
the rename. Checkpoints beyond ``keep`` are renamed out of the way at once and their files
deleted in the background (:mod:`.checkpoint_files`). A process killed at any moment
(mid-write, mid-hash, mid-rename, mid-prune) therefore leaves ``latest`` naming a checkpoint
that verifies, and the next save or load removes the debris.

A ``manifest.json`` (:mod:`megatron_gspo.weights.manifest`) records the layout and model it was
saved with and every file's size and SHA-256; loading verifies them first (all ranks, a share
each) and names a missing, truncated or changed file. Each rank hashes the files it wrote
itself, right after writing them (from the page cache, never a second read of another rank's
files from a shared filesystem). Model and optimizer are saved in Megatron-Core's reshardable
forms (the distributed optimizer's ``fully_reshardable``), so a run resumes on another
TP/PP/EP/DP layout. Weights holding NaN or inf are never saved.

Asynchronous saves (``run.async_save: true``) hand the state to Megatron-Core's
``async_sharded_save`` and its ``AsyncCallsQueue``: a process forked from each rank writes the
shards (on a GPU from a host copy Megatron makes first; on a CPU from the clones it makes of
tensors that are views into a larger buffer, and the fork's copy-on-write view of the rest) and
then hashes them, while the loop trains on. The save is finalized at a later step
(:meth:`Checkpointer.poll`, collective): only then are the manifest written, the directory
renamed and ``latest`` flipped. One save is in flight at a time: a checkpoint due while one is
still being written waits for it (``checkpoint_blocked_s``), and the end of a run, SIGTERM and
the time-limit signal finish it (:meth:`Checkpointer.wait`) before they exit.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from torch.distributed.checkpoint.api import CheckpointException

from megatron_gspo.parallel.platform import cuda_redirect_suspended
from megatron_gspo.run.checkpoint_files import Remover, debris
from megatron_gspo.run.checkpoint_files import fsync_dir as _fsync_dir
from megatron_gspo.run.checkpoint_files import write_atomic as _write_atomic
from megatron_gspo.run.mcore_checkpoint import (
    SaveStrategy,
    async_save_kwargs,
    init_optimizer_state,
    keep_torch_adam_step,
    start_writer_queue_ignoring_sigterm,
    unshare_adam_steps,
    write_common_file,
)
from megatron_gspo.run.rng import get_rng_state, set_rng_state
from megatron_gspo.runtime.procs import forks_die_with_parent
from megatron_gspo.trainer.policy import Policy
from megatron_gspo.weights.manifest import (
    HASHES_FILE,
    MANIFEST,
    CheckpointError,
    hash_files,
    owner_of,
    verify,
    write_then_hash,
)
from megatron_gspo.weights.model_check import check_checkpoint_model

# Reshardable over TP, PP, EP and DP: a run resumes on another layout (fully_reshardable
# gathers the distributed optimizer's states per parameter; benchmarks/checkpoint_format.py
# measures what that costs against dp_reshardable, which resumes on the same DP size only).
OPTIMIZER_FORMAT = "fully_reshardable"
LATEST = "latest"
BEST = "best"
# Key prefix of the frozen reference policy's tensors (loss.kl_coef) in a checkpoint.
_REFERENCE = "reference."

log = logging.getLogger(__name__)


def _name(step: int) -> str:
    return f"iter_{step:07d}"


def _first_line(error: BaseException) -> str:
    """What went wrong, in a line: torch's checkpoint errors wrap each rank's error (and its
    traceback) in theirs."""
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    text = (str(error).splitlines() or [""])[0][:500]
    return f"{type(error).__name__}: {text}"


def current_layout(policy: Policy) -> dict[str, int]:
    return {
        "world_size": dist.get_world_size(),
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
        "expert_model_parallel_size": parallel_state.get_expert_model_parallel_world_size(),
        "context_parallel_size": parallel_state.get_context_parallel_world_size(),
        "data_parallel_size": parallel_state.get_data_parallel_world_size(),
        "distributed_optimizer": int(policy.recipe.memory.use_distributed_optimizer),
    }


# Checkpointer.load's default: verify the checkpoint before loading it.
_VERIFY = object()


class Checkpointer:
    def __init__(
        self,
        directory: str | Path,
        policy: Policy,
        *,
        keep: int = 2,
        optimizer_format: str = OPTIMIZER_FORMAT,
        async_save: bool = False,
    ) -> None:
        start_writer_queue_ignoring_sigterm()
        self.optimizer_metadata = {
            "distrib_optim_sharding_type": optimizer_format,
            "chained_optim_avoid_prefix": True,
        }
        self.dir = Path(directory)
        self.policy = policy
        self.keep = keep
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.async_save = async_save
        self._queue = None
        self._strategy = SaveStrategy()  # Megatron's plans reused while the structure holds
        self._remover = Remover()  # old checkpoints' files, deleted off the loop
        self._pending: int | None = None  # the step whose save is being written
        # Seconds the loop spent blocked by checkpoints since the last take_blocked_s().
        self._blocked_s = 0.0

    def latest_step(self) -> int | None:
        path = self.dir / LATEST
        if not path.is_file():
            return None
        text = path.read_text().strip()
        if not text.isdigit() or not (self.dir / _name(int(text))).is_dir():
            raise CheckpointError(
                f"{path}: names no complete checkpoint ({text!r}); point it at one of "
                f"{sorted(p.name for p in self.dir.glob('iter_*')) or 'none'} or start afresh"
            )
        return int(text)

    def _sharded_state(self, *, loading: bool, reference: bool = True) -> dict:
        model_sd = self.policy.model.sharded_state_dict()
        state = {
            "model": model_sd,
            "optimizer": self.policy.optimizer.sharded_state_dict(
                model_sd, is_loading=loading, metadata=self.optimizer_metadata
            ),
        }
        if reference and self.policy.reference is not None:
            state["reference"] = self.policy.reference.sharded_state_dict(prefix=_REFERENCE)
        return state

    def _check_finite(self, step: int) -> None:
        bad = torch.zeros(1)
        for name, param in self.policy.model.named_parameters():
            # A sum is not finite when an element is not (or on overflow: the mask confirms);
            # isfinite's mask on every weight was a fifth of an asynchronous save's hand-over.
            finite_sum = bool(torch.isfinite(param.detach().sum()))
            if not finite_sum and not bool(torch.isfinite(param).all()):
                bad.fill_(1.0)
                log.error("weight %s holds NaN or inf at step %d", name, step)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if bad.item():
            raise CheckpointError(
                f"the weights hold NaN or inf at step {step}: refusing to checkpoint them "
                f"({self.dir / LATEST} still names the last good checkpoint)"
            )

    # -- saving -------------------------------------------------------------------------------

    def save(self, step: int, trainer_state: dict[str, Any], *, best: bool = False) -> Path:
        """Checkpoint ``step`` (collective) into the directory returned: written and published
        before returning, or, with ``async_save``, handed to Megatron's writer and published
        by a later :meth:`poll` or :meth:`wait` (a save still in flight is finished first).
        ``best``: mark it the best once published."""
        start = time.perf_counter()
        try:
            self.wait()
            self._check_finite(step)
            self._save(step, trainer_state, best)
        finally:
            self._blocked_s += time.perf_counter() - start
        return self.dir / _name(step)

    def poll(self) -> None:
        """Publish an asynchronous save whose writers have finished (collective; cheap when
        none is in flight)."""
        if self._queue is None or not self._queue.get_num_unfinalized_calls():
            return
        start = time.perf_counter()
        try:
            self._finalize(blocking=False)
        finally:
            self._blocked_s += time.perf_counter() - start

    def wait(self) -> None:
        """Finish and publish the save in flight, if any (collective)."""
        if self._queue is not None and self._queue.get_num_unfinalized_calls():
            self._finalize(blocking=True)

    def close(self) -> None:
        """The end of a run: the save in flight published, old checkpoints' files gone."""
        self.wait()
        self._remover.join()

    def take_blocked_s(self) -> float:
        """Seconds the loop spent blocked by checkpoints since the last call."""
        blocked, self._blocked_s = self._blocked_s, 0.0
        return blocked

    @property
    def pending(self) -> int | None:
        """The step of the save being written in the background (None: none)."""
        return self._pending

    def _finalize(self, *, blocking: bool) -> None:
        step = self._pending
        try:
            done = self._queue.maybe_finalize_async_calls(blocking=blocking)
        except (OSError, RuntimeError, CheckpointException) as e:
            self._pending = None
            raise self._cannot_write(step, e) from e
        if done:
            self._pending = None

    def _cannot_write(self, step: int | None, error: BaseException) -> CheckpointError:
        name = _name(step) if step is not None else "?"
        if self.world == 1:  # the partial copy, which would hold the space until next time
            shutil.rmtree(self.dir / f".{name}.tmp", ignore_errors=True)
        free = shutil.disk_usage(self.dir).free if self.dir.is_dir() else None
        space = f"; {free / 2**20:.1f} MiB free there" if free is not None else ""
        return CheckpointError(
            f"cannot write checkpoint {self.dir / name}: {_first_line(error)}{space}; "
            f"{self.dir / LATEST} still names the last complete one"
        )

    def _save(self, step: int, trainer_state: dict[str, Any], best: bool) -> None:
        tmp, final = self.dir / f".{_name(step)}.tmp", self.dir / _name(step)
        try:
            if self.rank == 0:
                self.dir.mkdir(parents=True, exist_ok=True)
                self._remove_debris()
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
            dist.barrier()
            sharded = self._sharded_state(loading=False)  # the distributed optimizer's: .cuda()
            strategy, validate = self._strategy(sharded)
            # Megatron's writers end with the trainer (one a SIGKILL left would write on into a
            # directory the next run owns); a save rewrites no CUDA argument: no device mode.
            with forks_die_with_parent(), cuda_redirect_suspended():
                request = dist_checkpointing.save(
                    sharded,
                    str(tmp),
                    sharded_strategy=strategy,
                    validate_access_integrity=validate,
                    async_sharded_save=self.async_save,
                    **(async_save_kwargs() if self.async_save else {}),
                )
            torch.save(get_rng_state(), tmp / f"rng_rank{self.rank:05d}.pt")
            if self.rank == 0:
                state = {
                    "step": step,
                    "scheduler": self.policy.scheduler.state_dict(),
                    "has_reference": self.policy.reference is not None,
                    **trainer_state,
                }
                (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
        except (OSError, RuntimeError, CheckpointException) as e:  # a full disk, a quota, ...
            raise self._cannot_write(step, e) from e
        publish = functools.partial(self._publish, tmp, final, step, best)
        if request is None:
            try:
                dist.barrier()
                publish()
            except (OSError, RuntimeError, CheckpointException) as e:
                raise self._cannot_write(step, e) from e
            return
        if request.async_fn is not None:
            request = request._replace(
                async_fn=functools.partial(write_then_hash, request.async_fn, str(tmp))
            )
        request.add_finalize_fn(publish)
        if self._queue is None:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            # Temporal: a process forked per save; on a CPU the fork is what holds the
            # weights as they were (the persistent worker would be handed the live tensors).
            self._queue = AsyncCallsQueue(persistent=False)
        with forks_die_with_parent():
            self._queue.schedule_async_request(request)
        self._pending = step

    def _publish(self, tmp: Path, final: Path, step: int, best: bool) -> None:
        """The files written and hashed: the manifest, the rename, ``latest`` (collective)."""
        if self.rank == 0:
            write_common_file(tmp)
        dist.barrier()
        # Each rank hashes what it wrote itself (the async writer did already), rank 0 the
        # common files: from the page cache, never another rank's files.
        hashes_file = tmp / HASHES_FILE.format(rank=self.rank)
        if hashes_file.is_file():
            mine = json.loads(hashes_file.read_text())
            hashes_file.unlink()
        else:
            mine = {}
        mine.update(hash_files(self._unhashed(tmp, mine), tmp))
        parts: list[dict] = [None] * self.world  # type: ignore[list-item]
        dist.all_gather_object(parts, mine)
        if self.rank == 0:
            self._write_manifest(tmp, step, {k: v for part in parts for k, v in part.items()})
            _fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.dir)
            _write_atomic(self.dir / LATEST, f"{step}\n")
            if best:
                _write_atomic(self.dir / BEST, f"{step}\n")
            self._prune(step)
        dist.barrier()

    def _unhashed(self, directory: Path, done: dict[str, Any]) -> list[Path]:
        """This rank's files of ``directory`` not hashed yet."""
        return sorted(
            p
            for p in directory.rglob("*")
            if p.is_file()
            and p.name != MANIFEST
            and not p.name.startswith(".sha256_rank")
            and str(p.relative_to(directory)) not in done
            and owner_of(p.name) == self.rank
        )

    def _write_manifest(self, directory: Path, step: int, files: dict[str, Any]) -> None:
        manifest = {
            "format": 1,
            "step": step,
            "layout": current_layout(self.policy),
            # Megatron pads the vocabulary for TP; the embedding's rows cannot change on resume.
            "padded_vocab_size": self.policy.model.vocab_size,
            # The model it holds, so that a recipe with another shape is refused by name.
            "model": self.policy.recipe.model.model_dump(mode="json"),
            "files": dict(sorted(files.items())),
        }
        (directory / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")

    # -- loading ------------------------------------------------------------------------------

    def verify(self, step: int, *, trust_unverified: bool = False) -> dict[str, Any] | None:
        """:func:`verify` of the checkpoint of ``step``; returns its manifest."""
        return verify(self.dir / _name(step), trust_unverified=trust_unverified)

    def load(self, step: int, *, manifest: Any = _VERIFY) -> dict[str, Any]:
        """Load the checkpoint of ``step``, verified first unless ``manifest`` is what a
        verification of it just returned (:mod:`megatron_gspo.run.rundir` verifies before the
        policy is built; None: trusted without one)."""
        path = self.dir / _name(step)
        if manifest is _VERIFY:
            manifest = self.verify(step)
        check_checkpoint_model(path, self.policy, recorded=(manifest or {}).get("model"))
        saved_layout = (manifest or {}).get("layout")
        resharded = saved_layout is not None and saved_layout != current_layout(self.policy)
        if resharded:
            log.info("resharding %s: saved as %s, loading as %s", path, saved_layout,
                     current_layout(self.policy))  # fmt: skip
        saved_vocab = (manifest or {}).get("padded_vocab_size")
        if saved_vocab is not None and saved_vocab != self.policy.model.vocab_size:
            raise CheckpointError(
                f"checkpoint {path} holds the vocabulary padded to {saved_vocab} rows, this "
                f"layout pads it to {self.policy.model.vocab_size}: resume with the saved "
                "tensor_model_parallel_size (a new run on this layout can start from the "
                "checkpoint's weights with run.init_from, which loads any padding)"
            )
        init_optimizer_state(self.policy)
        keep_torch_adam_step(self.policy)
        state = json.loads((path / "trainer_state.json").read_text())
        has_reference = bool(state.pop("has_reference", False))
        try:
            loaded = dist_checkpointing.load(
                self._sharded_state(loading=True, reference=has_reference), str(path)
            )
            self.policy.model.load_state_dict(loaded["model"])
            if self.policy.reference is not None and has_reference:
                self.policy.reference.load_state_dict(
                    {k.removeprefix(_REFERENCE): v for k, v in loaded["reference"].items()}
                )
            # Megatron copies into views of parameters that require grad.
            with torch.no_grad():
                self.policy.optimizer.load_state_dict(loaded["optimizer"])
            unshare_adam_steps(self.policy)
        except (Exception, CheckpointException) as e:
            hint = f" (saved with layout {saved_layout})" if resharded else ""
            raise CheckpointError(
                f"checkpoint {path} cannot be loaded{hint}: {_first_line(e)}"
            ) from e
        if self.policy.reference is not None and not has_reference:
            log.warning(
                "%s holds no reference policy (loss.kl_coef was 0): the resumed weights "
                "become the reference",
                path,
            )
            self.policy.reset_reference()
        self.policy.scheduler.load_state_dict(state.pop("scheduler"))
        rng = path / f"rng_rank{self.rank:05d}.pt"
        # A rank of another layout plays another part: its generators start fresh.
        if rng.is_file() and not resharded:
            saved = torch.load(rng, weights_only=True)
            if isinstance(saved, dict):
                set_rng_state(saved)
            else:  # written before every generator was saved: torch's CPU state alone
                torch.set_rng_state(saved)
        dist.barrier()
        return state

    def _remove_debris(self) -> None:
        for p in debris(self.dir):
            if p not in self._remover.busy:
                shutil.rmtree(p, ignore_errors=True)

    def best_step(self) -> int | None:
        """The step last saved with ``best=True`` (kept out of pruning), if any."""
        path = self.dir / BEST
        text = path.read_text().strip() if path.is_file() else ""
        return int(text) if text.isdigit() and (self.dir / _name(int(text))).is_dir() else None

    def _prune(self, newest: int) -> None:
        if self.keep <= 0:
            return
        best = self.best_step()
        steps = sorted(int(p.name[5:]) for p in self.dir.glob("iter_*") if p.name[5:].isdigit())
        steps = [s for s in steps if s != best]
        old = [s for s in steps if s != newest][: max(0, len(steps) - self.keep)]
        self._remover.remove([self.dir / _name(s) for s in old])
