"""The run directory: one trainer at a time, and whether to resume, start afresh or refuse.

Every decision about an earlier run in the directory is made here, before the expensive
start-up and before anything in the directory changes:

- a trainer holds a lock on ``RUN_DIR/.lock`` for its lifetime (rank 0 under torchrun); a
  second one is refused, naming the holder. It is a POSIX record lock (``lockf``): the kernel
  drops it when the process dies (``kill -9`` leaves nothing stale) and a child process does
  not inherit it. A filesystem without locks (NFS without lockd, Lustre mounted without
  ``flock``) gets a warning and no protection; Lustre's ``localflock`` locks per node only.
- resume (the default) continues from ``checkpoints/latest``. A ``latest`` that is missing
  while checkpoints exist resumes from the newest, saying so; one that fails verification is
  refused, naming ``--resume-from-last-good`` and the step it would resume from, unless that
  option is given. Without a manifest a checkpoint is refused unless
  ``--trust-unverified-checkpoint``. A run already at or past the steps asked for is said so.
- ``--no-resume`` refuses a directory that holds a run unless ``--overwrite`` deletes it.

Only :func:`begin`, called just before the first step, writes: it drops the metrics of steps
after the checkpoint (and a last line cut short by an interrupted write) and the pre-emption
marker. A run stopped before then (SIGTERM during start-up, an error) has changed nothing.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_gspo.run.checkpoint import LATEST
from megatron_gspo.run.metrics import METRICS_FILE, parse_metrics
from megatron_gspo.run.signals import PREEMPTED_MARKER
from megatron_gspo.runtime.errors import InputError
from megatron_gspo.runtime.rank0 import on_rank0
from megatron_gspo.weights.manifest import CheckpointError, verify

log = logging.getLogger(__name__)

# What a run writes into its directory (and --overwrite removes).
RUN_ARTIFACTS = ("checkpoints", "metrics.jsonl", "tensorboard", "plots", "recipe.yaml")
LOCK_FILE = ".lock"
LAST_GOOD_OPTION = "--resume-from-last-good"


class RunDirError(InputError):
    """A run directory that cannot be used as asked; the message says what is there."""


@dataclass(frozen=True)
class RunOptions:
    resume: bool = True
    # With resume=False: delete the run in the directory instead of refusing.
    overwrite: bool = False
    # Resume from the newest checkpoint that verifies when ``latest`` does not.
    resume_from_last_good: bool = False
    # Load a checkpoint without a manifest (unverified).
    trust_unverified: bool = False


@dataclass(frozen=True)
class Start:
    """Where a run starts: ``step`` 0 afresh, else the checkpoint of ``step``."""

    step: int = 0
    manifest: dict[str, Any] | None = None
    # The run is already at (or past) the steps asked for: nothing to train.
    done: bool = False


# -- one trainer per directory ---------------------------------------------------------------

_held: dict[Path, RunLock] = {}


class RunLock:
    """An exclusive lock on a run directory, held by this process until :meth:`release`."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.path = run_dir / LOCK_FILE
        self._fd: int | None = None

    @classmethod
    def acquire(cls, run_dir: Path) -> RunLock:
        """Lock ``run_dir`` (created if absent) or raise :class:`RunDirError` naming the
        trainer that holds it. A process that holds it already gets its lock back."""
        run_dir.mkdir(parents=True, exist_ok=True)
        key = run_dir.resolve()
        if key in _held:
            return _held[key]
        lock = cls(run_dir)
        fd = os.open(lock.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EAGAIN):
                log.warning(
                    "%s: this filesystem does not lock files (%s): a second trainer started "
                    "on this directory would not be stopped; run one at a time",
                    lock.path,
                    e.strerror,
                )
            else:
                os.close(fd)
                holder = lock.path.read_text().strip() or "a trainer that is starting"
                raise RunDirError(
                    f"{run_dir} is in use by another trainer ({holder}): one run per "
                    "directory; wait for it to end, stop it, or pick another --output-dir"
                ) from None
        started = time.strftime("%Y-%m-%d %H:%M:%S %z")
        holder = f"host {socket.gethostname()}, pid {os.getpid()}, since {started}\n"
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode(), 0)
        lock._fd = fd
        _held[key] = lock
        return lock

    def release(self) -> None:
        # Closing the descriptor drops the lock; the file stays (removing it would race with
        # a trainer that has just opened it).
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            _held.pop(self.run_dir.resolve(), None)


# -- resume, start afresh or refuse ----------------------------------------------------------


def open_run(
    run_dir: Path, options: RunOptions, *, total: int, total_from: str
) -> tuple[RunLock | None, Start]:
    """Lock ``run_dir`` (rank 0) and decide where the run starts. Collective; changes nothing
    in the directory but the lock file (and ``--overwrite``'s deletion)."""
    if options.overwrite and options.resume:
        raise RunDirError(
            "--overwrite deletes the run in the directory to start afresh: it needs --no-resume"
        )
    locks: list[RunLock] = []
    on_rank0(lambda: locks.append(RunLock.acquire(run_dir)))
    lock = locks[0] if locks else None
    if not options.resume:
        on_rank0(start_afresh, run_dir, options.overwrite)
        return lock, Start()
    return lock, choose_start(run_dir, options, total=total, total_from=total_from)


def start_afresh(run_dir: Path, overwrite: bool) -> None:
    """Refuse to start over on top of an earlier run, unless asked to delete it."""
    present = [run_dir / name for name in RUN_ARTIFACTS if (run_dir / name).exists()]
    if not present:
        return
    if not overwrite:
        ckpts = sorted((run_dir / "checkpoints").glob("iter_*"))
        metrics = run_dir / METRICS_FILE
        steps = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
        raise RunDirError(
            f"{run_dir} holds a run ({len(ckpts)} checkpoint(s), metrics for {steps} step(s)); "
            "--no-resume would start over on top of it. Pick another --output-dir, resume it, "
            f"or add --overwrite to delete {', '.join(p.name for p in present)}"
        )
    log.warning("--overwrite: deleting %s", ", ".join(str(p) for p in present))
    for path in present:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


def _steps(ckpt_dir: Path) -> list[int]:
    """The steps of the checkpoints in ``ckpt_dir``, newest first."""
    names = (p.name for p in ckpt_dir.glob("iter_*") if p.is_dir())
    return sorted((int(n[5:]) for n in names if n[5:].isdigit()), reverse=True)


def _inspect(ckpt_dir: Path) -> tuple[int | None, str | None, list[int]]:
    """``latest``'s step (if it names a checkpoint), what is wrong with it, and every step."""
    steps = _steps(ckpt_dir)
    path = ckpt_dir / LATEST
    if not path.is_file():
        return None, (f"{path} is missing" if steps else None), steps
    text = path.read_text(errors="replace").strip()
    if text.isdigit() and int(text) in steps:
        return int(text), None, steps
    return None, f"{path} names no checkpoint ({text[:40]!r})", steps


def _name(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / f"iter_{step:07d}"


def choose_start(run_dir: Path, options: RunOptions, *, total: int, total_from: str) -> Start:
    """The checkpoint to resume from (verified, collectively), or a refusal that says why and
    what would resume."""
    ckpt_dir = run_dir / "checkpoints"
    latest, note, steps = on_rank0(_inspect, ckpt_dir)
    if not steps:
        if note:
            raise RunDirError(f"{note}, and {ckpt_dir} holds no checkpoint")
        on_rank0(_check_metrics, run_dir)
        return Start()
    if latest is not None and latest >= total:
        return _done(run_dir, latest, total, total_from)
    # Newest first from `latest` (a newer one would be a save that never completed its
    # `latest`); every checkpoint where `latest` names none.
    candidates = [s for s in steps if latest is None or s <= latest]
    failures: list[str] = []
    good, manifest = None, None
    for step in candidates:
        try:
            manifest = verify(_name(ckpt_dir, step), trust_unverified=options.trust_unverified)
        except CheckpointError as e:
            failures.append(str(e))
            continue
        good = step
        break
    where = f"{note}; " if note else ""
    if good is None:
        raise RunDirError(
            f"{where}{'; '.join(failures[:2])}; no checkpoint in {ckpt_dir} verifies: the run "
            "cannot be resumed (--no-resume --overwrite starts afresh, deleting it)"
        )
    if failures and not options.resume_from_last_good:
        raise RunDirError(
            f"{where}{failures[0]}. The newest checkpoint that verifies is step {good} "
            f"({_name(ckpt_dir, good)}): {LAST_GOOD_OPTION} resumes from it"
        )
    if dist.get_rank() == 0 and failures:
        log.warning(
            "%s: NOT RESUMING FROM THE LATEST CHECKPOINT: %s%s; resuming from step %d (%s), "
            "the newest that verifies; the steps after it are trained again",
            LAST_GOOD_OPTION,
            where,
            failures[0],
            good,
            _name(ckpt_dir, good),
        )
    elif dist.get_rank() == 0 and note:
        log.warning("%s; resuming from step %d (%s), the newest checkpoint, which verifies",
                    note, good, _name(ckpt_dir, good))  # fmt: skip
    if good >= total:
        return _done(run_dir, good, total, total_from)
    on_rank0(_check_metrics, run_dir)
    return Start(step=good, manifest=manifest)


def _done(run_dir: Path, step: int, total: int, total_from: str) -> Start:
    if step > total:
        raise RunDirError(
            f"{run_dir} holds a run at step {step}, past {total_from} {total}: a run does not "
            f"go back; raise {total_from} to continue it, or pick another --output-dir"
        )
    if dist.get_rank() == 0:
        log.warning("%s is at step %d already (%s %d): nothing to train", run_dir, step,
                    total_from, total)  # fmt: skip
    return Start(step=step, done=True)


def _check_metrics(run_dir: Path) -> None:
    """Refuse, before anything changes, metrics that :func:`begin` could not cut at ``step``."""
    path = run_dir / METRICS_FILE
    if path.is_file():
        parse_metrics(path)


def begin(run_dir: Path, start: Start) -> None:
    """Just before the first step (rank 0): forget what the earlier run wrote after the
    checkpoint the run starts from (its metrics, a last line cut short, the pre-emption
    marker); its steps are trained again."""
    (run_dir / PREEMPTED_MARKER).unlink(missing_ok=True)
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return
    records, partial = parse_metrics(path)
    if partial is not None:
        log.warning("%s: dropping a last line cut short by an interrupted write", path)
    kept = [r for r in records if r.get("step", 0) <= start.step]
    if len(kept) < len(records) and start.step == 0:
        log.warning("%s: no checkpoint to resume from; replacing the metrics of %d step(s)",
                    path, len(records))  # fmt: skip
    if len(kept) < len(records) or partial is not None:
        import json

        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, path)
