"""Training checkpoints: Megatron distributed checkpoints, written atomically.

A checkpoint is ``iter_NNNNNNN/`` holding the model and optimizer as a Megatron-Core
distributed checkpoint (each rank writes its shards), the LR schedule, the data position and
every rank's random generator states (:mod:`megatron_gspo.run.rng`). It is written into
``.iter_NNNNNNN.tmp`` and renamed into place only when every rank has finished; ``latest``
names the newest complete one and is replaced atomically after the rename. A process killed
mid-save therefore leaves the previous checkpoint as ``latest``, and the next save or load
removes the debris.

A ``manifest.json`` (:mod:`megatron_gspo.weights.manifest`) records the layout and model it was
saved with and every file's size and SHA-256; loading verifies them first (all ranks, a share
each) and names a missing, truncated or changed file. Model and optimizer are saved in
Megatron-Core's reshardable forms (the distributed optimizer's ``fully_reshardable``), so a run
resumes on another TP/PP/EP/DP layout. Weights holding NaN or inf are never saved.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from torch.distributed.checkpoint.api import CheckpointException

from megatron_gspo.run.rng import get_rng_state, set_rng_state
from megatron_gspo.trainer.policy import Policy
from megatron_gspo.weights.manifest import (
    MANIFEST,
    CheckpointError,
    checksummed_files,
    sha256_of,
    verify,
)
from megatron_gspo.weights.model_check import check_checkpoint_model

# Reshardable over TP, PP, EP and DP: a run resumes on another layout (fully_reshardable
# gathers the distributed optimizer's states per parameter; benchmarks/checkpoint.py measures
# what that costs against dp_reshardable, which resumes on the same DP size only).
OPTIMIZER_FORMAT = "fully_reshardable"
LATEST = "latest"
BEST = "best"
# Key prefix of the frozen reference policy's tensors (loss.kl_coef) in a checkpoint.
_REFERENCE = "reference."

log = logging.getLogger(__name__)

# megatron-core's name for the non-tensor part of a checkpoint (its COMMON_STATE_FNAME).
COMMON_FILE = "common.pt"


def _name(step: int) -> str:
    return f"iter_{step:07d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _init_optimizer_state(policy: Policy) -> None:
    """Create empty Adam states so Megatron can build the state dict to load into.

    A fresh optimizer has none until its first step, and Megatron's torch-Adam fallback does
    not create them (its Transformer Engine and apex paths do).
    """
    for opt in getattr(policy.optimizer, "chained_optimizers", [policy.optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)


def _keep_torch_adam_step(policy: Policy) -> None:
    """Work around Megatron-Core 0.16 loading ``fully_reshardable`` distributed-optimizer states
    into torch's Adam (its fallback without Transformer Engine or apex): it restores Adam's
    per-parameter ``step`` from the param groups, then copies every state tensor from the
    checkpoint, ``step`` included, which the checkpoint keeps elsewhere (a KeyError). The
    copy of ``step`` onto itself is what the loader means."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(policy.optimizer, "chained_optimizers", [policy.optimizer]):
        if not isinstance(opt, DistributedOptimizer) or getattr(opt, "_gspo_step_kept", False):
            continue
        original = opt._set_main_param_and_optimizer_states

        def set_states(model_param, tensors, opt=opt, original=original):
            group, order = opt.model_param_group_index_map[model_param]
            main = opt.optimizer.param_groups[group]["params"][order]
            step = opt.optimizer.state[main].get("step")
            if step is not None and "step" not in tensors:
                tensors = {**tensors, "step": step}
            original(model_param, tensors)

        opt._set_main_param_and_optimizer_states = set_states
        opt._gspo_step_kept = True


def _unshare_adam_steps(policy: Policy) -> None:
    """Give every parameter its own Adam ``step`` again after a load.

    Megatron-Core 0.16's distributed optimizer restores torch Adam's per-parameter ``step`` as
    one tensor object shared by all parameters; torch increments each parameter's ``step`` in
    place, so the shared one would advance once per parameter per update and skew Adam's bias
    correction from the first step after a resume."""
    for opt in getattr(policy.optimizer, "chained_optimizers", [policy.optimizer]):
        for state in opt.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


_WRITER_MANAGER = None


def _writer_manager_init(parent_pid: int) -> None:
    from megatron_gspo.runtime.procs import die_with_parent

    die_with_parent(parent_pid)


def _start_writer_queue_ignoring_sigterm() -> None:
    """Start Megatron's checkpoint-writer results queue in a helper that survives SIGTERM
    and dies with the trainer.

    The first ``dist_checkpointing.save`` starts a multiprocessing ``Manager`` process and keeps
    it. Slurm signals every process of a job (requeue, pre-emption, scancel), so that helper
    would die with the SIGTERM whose point is to let the trainer save, and that save would fail
    on a broken pipe; and after a SIGKILL of the trainer it would live on, orphaned. The
    manager started here ignores SIGTERM and is killed by the kernel when the trainer exits.
    """
    global _WRITER_MANAGER
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if _WRITER_MANAGER is not None or filesystem_async._results_queue is not None:
        return
    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(initializer=_writer_manager_init, initargs=(os.getpid(),))
    _WRITER_MANAGER = manager
    filesystem_async._results_queue = manager.Queue()


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
    ) -> None:
        _start_writer_queue_ignoring_sigterm()
        self.optimizer_metadata = {
            "distrib_optim_sharding_type": optimizer_format,
            "chained_optim_avoid_prefix": True,
        }
        self.dir = Path(directory)
        self.policy = policy
        self.keep = keep
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()

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
            if not bool(torch.isfinite(param).all()):
                bad.fill_(1.0)
                log.error("weight %s holds NaN or inf at step %d", name, step)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if bad.item():
            raise CheckpointError(
                f"the weights hold NaN or inf at step {step}: refusing to checkpoint them "
                f"({self.dir / LATEST} still names the last good checkpoint)"
            )

    def save(self, step: int, trainer_state: dict[str, Any]) -> Path:
        self._check_finite(step)
        final = self.dir / _name(step)
        try:
            return self._save(step, trainer_state, final)
        except (OSError, RuntimeError, CheckpointException) as e:  # a full disk, a quota, ...
            if self.world == 1:  # the partial copy, which would hold the space until next time
                shutil.rmtree(self.dir / f".{_name(step)}.tmp", ignore_errors=True)
            first = _first_line(e)
            free = shutil.disk_usage(self.dir).free if self.dir.is_dir() else None
            space = f"; {free / 2**20:.1f} MiB free there" if free is not None else ""
            raise CheckpointError(
                f"cannot write checkpoint {final}: {first}{space}; {self.dir / LATEST} still "
                "names the last complete one"
            ) from e

    def _save(self, step: int, trainer_state: dict[str, Any], final: Path) -> Path:
        tmp = self.dir / f".{_name(step)}.tmp"
        if self.rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._remove_debris()
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        dist.barrier()
        dist_checkpointing.save(self._sharded_state(loading=False), str(tmp))
        torch.save(get_rng_state(), tmp / f"rng_rank{self.rank:05d}.pt")
        if self.rank == 0:
            state = {
                "step": step,
                "scheduler": self.policy.scheduler.state_dict(),
                "has_reference": self.policy.reference is not None,
                **trainer_state,
            }
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
            _write_common_file(tmp)
        dist.barrier()
        self._write_manifest(tmp, step)
        if self.rank == 0:
            _fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.dir)
            _write_atomic(self.dir / LATEST, f"{step}\n")
            self._prune(step)
        dist.barrier()
        return final

    def _write_manifest(self, directory: Path, step: int) -> None:
        """Every file's size and SHA-256 (hashed by all ranks, a share each) and the layout."""
        files = checksummed_files(directory)
        mine = {
            str(p.relative_to(directory)): {"bytes": p.stat().st_size, "sha256": sha256_of(p)}
            for i, p in enumerate(files)
            if i % self.world == self.rank
        }
        parts: list[dict] = [None] * self.world  # type: ignore[list-item]
        dist.all_gather_object(parts, mine)
        if self.rank == 0:
            manifest = {
                "format": 1,
                "step": step,
                "layout": current_layout(self.policy),
                # Megatron pads the vocabulary for TP; the embedding's rows cannot change on
                # resume.
                "padded_vocab_size": self.policy.model.vocab_size,
                # The model it holds, so that a recipe with another shape is refused by name.
                "model": self.policy.recipe.model.model_dump(mode="json"),
                "files": {k: v for part in parts for k, v in sorted(part.items())},
            }
            (directory / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")

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
        _init_optimizer_state(self.policy)
        _keep_torch_adam_step(self.policy)
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
            _unshare_adam_steps(self.policy)
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
        for p in self.dir.glob(".iter_*.tmp"):
            shutil.rmtree(p, ignore_errors=True)

    def best_step(self) -> int | None:
        """The step ``mark_best`` named last (kept out of pruning), if any."""
        path = self.dir / BEST
        text = path.read_text().strip() if path.is_file() else ""
        return int(text) if text.isdigit() and (self.dir / _name(int(text))).is_dir() else None

    def mark_best(self, step: int) -> None:
        """Name the saved checkpoint of ``step`` as the best; pruning keeps it. Collective."""
        if self.rank == 0:
            if not (self.dir / _name(step)).is_dir():
                raise CheckpointError(f"no checkpoint of step {step} in {self.dir} to mark best")
            _write_atomic(self.dir / BEST, f"{step}\n")
            self._prune(self.latest_step() or step)
        dist.barrier()

    def _prune(self, newest: int) -> None:
        if self.keep <= 0:
            return
        best = self.best_step()
        steps = sorted(int(p.name[5:]) for p in self.dir.glob("iter_*") if p.name[5:].isdigit())
        steps = [s for s in steps if s != best]
        for old in [s for s in steps if s != newest][: max(0, len(steps) - self.keep)]:
            shutil.rmtree(self.dir / _name(old), ignore_errors=True)


def _write_common_file(directory: Path) -> None:
    """Give a checkpoint the ``common.pt`` that megatron-core before 0.19 reads.

    megatron-core 0.19 keeps the non-tensor state (the optimizer's param groups, ...) inside
    the torch_dist files and writes no common.pt; 0.16.1 to 0.18 read that state from
    common.pt alone and fail without it. The same state, copied out, lets a run saved under
    0.19 resume under any version of the range; 0.19 reads common.pt first when it exists.
    """
    if (directory / COMMON_FILE).exists():  # written by megatron-core before 0.19
        return
    from megatron.core.dist_checkpointing.serialization import load_common_state_dict

    torch.save(load_common_state_dict(str(directory)), directory / COMMON_FILE)
