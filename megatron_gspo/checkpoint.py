"""Training checkpoints: Megatron distributed checkpoints, written atomically.

A checkpoint is ``iter_NNNNNNN/`` holding the model and optimizer as a Megatron-Core
distributed checkpoint (each rank writes its shards), the LR schedule, the data position and
every rank's random generator states (:mod:`megatron_gspo.rng`). It is written into
``.iter_NNNNNNN.tmp`` and renamed into place only when every rank has finished; ``latest``
names the newest complete one and is replaced atomically after the rename. A process killed
mid-save therefore leaves the previous checkpoint as ``latest``, and the next save or load
removes the debris.

The optimizer uses Megatron's ``dp_reshardable`` format: fully parallel and resumable with the
same layout or another data-parallel size, not with other TP/PP/EP sizes (convert through the
model weights for that).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from megatron_gspo.policy import Policy
from megatron_gspo.rng import get_rng_state, set_rng_state

_OPTIM_FORMAT = {"distrib_optim_sharding_type": "dp_reshardable"}
LATEST = "latest"


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


def _start_writer_queue_ignoring_sigterm() -> None:
    """Start Megatron's checkpoint-writer results queue with SIGTERM ignored.

    The first ``dist_checkpointing.save`` starts a multiprocessing ``Manager`` process and keeps
    it. Slurm signals every process of a job (requeue, pre-emption, scancel), so that helper
    would die with the SIGTERM whose point is to let the trainer save, and that save then fails
    on a broken pipe. An ignored signal stays ignored across the helper's exec; SIGKILL still
    ends it.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        filesystem_async._get_write_results_queue()
    finally:
        signal.signal(signal.SIGTERM, previous)


class Checkpointer:
    def __init__(self, directory: str | Path, policy: Policy, *, keep: int = 2) -> None:
        _start_writer_queue_ignoring_sigterm()
        self.dir = Path(directory)
        self.policy = policy
        self.keep = keep
        self.rank = dist.get_rank()

    def latest_step(self) -> int | None:
        path = self.dir / LATEST
        if not path.is_file():
            return None
        text = path.read_text().strip()
        if not text.isdigit() or not (self.dir / _name(int(text))).is_dir():
            raise RuntimeError(f"{path}: names no complete checkpoint ({text!r})")
        return int(text)

    def _sharded_state(self, *, loading: bool) -> dict:
        model_sd = self.policy.model.sharded_state_dict()
        return {
            "model": model_sd,
            "optimizer": self.policy.optimizer.sharded_state_dict(
                model_sd, is_loading=loading, metadata=_OPTIM_FORMAT
            ),
        }

    def save(self, step: int, trainer_state: dict[str, Any]) -> Path:
        final = self.dir / _name(step)
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
                **trainer_state,
            }
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
        dist.barrier()
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

    def load(self, step: int) -> dict[str, Any]:
        path = self.dir / _name(step)
        _init_optimizer_state(self.policy)
        loaded = dist_checkpointing.load(self._sharded_state(loading=True), str(path))
        self.policy.model.load_state_dict(loaded["model"])
        # Megatron copies into views of parameters that require grad.
        with torch.no_grad():
            self.policy.optimizer.load_state_dict(loaded["optimizer"])
        state = json.loads((path / "trainer_state.json").read_text())
        self.policy.scheduler.load_state_dict(state.pop("scheduler"))
        rng = path / f"rng_rank{self.rank:05d}.pt"
        if rng.is_file():
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

    def _prune(self, newest: int) -> None:
        if self.keep <= 0:
            return
        steps = sorted(int(p.name[5:]) for p in self.dir.glob("iter_*") if p.name[5:].isdigit())
        for old in [s for s in steps if s != newest][: max(0, len(steps) - self.keep)]:
            shutil.rmtree(self.dir / _name(old), ignore_errors=True)
