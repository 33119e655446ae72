"""Worker processes for user code (rewards, environments, tools), a deadline for every call.

User code can raise, hang, exhaust memory or kill its own process. It therefore runs in worker
processes of our own, and every call has a deadline of its own, counted from the moment a
worker starts it: a worker still busy when its call's deadline passes is killed and replaced at
once, and the calls not yet started go to the other workers. A hung call costs that call and
one deadline of one worker slot, never the batch it belongs to. Time the trainer spends stopped
(SIGSTOP, a suspended Slurm job) does not count against a deadline.

Each worker takes one call at a time over a pipe of its own, so the pool always knows which
call a worker runs and since when. A dispatcher thread does that bookkeeping, so calls can be
submitted from any thread (the asynchronous rollouts, concurrent episodes) and are answered by
futures. A call's failure is an :class:`Outcome`, never an exception: what it means (a score of
zero, a dropped group, an error observation) is for the caller to decide.

Workers ignore SIGTERM and die with the trainer (:mod:`megatron_gspo.runtime.procs`): Slurm signals
every process of a job, and the trainer still needs its workers to finish the step and save.
"""

from __future__ import annotations

import collections
import logging
import multiprocessing
import os
import pickle
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Literal

from megatron_gspo.runtime.procs import exiting, kill_at_exit
from megatron_gspo.runtime.stops import TICK_S, stopped_for

__all__ = ["Outcome", "WorkerPool", "WorkerPoolError"]

log = logging.getLogger(__name__)

# Workers that die before they are ready, in a row, before the pool gives up on its set-up.
_MAX_FAILED_STARTS = 3
# How long a worker may take to import and build its handler.
_START_TIMEOUT_S = 120.0


class WorkerPoolError(RuntimeError):
    """The pool itself cannot run calls (its workers cannot start, or it was closed)."""


@dataclass(frozen=True)
class Outcome:
    """What one call came to: its value, or why there is none."""

    status: Literal["ok", "error", "timeout"]
    value: Any = None
    # Why it failed: the exception and its message, or the deadline that passed.
    message: str = ""
    # Seconds from the moment a worker started the call to its answer (or to its kill), less
    # any time the trainer was seen stopped.
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _serve(setup: Callable[..., Callable], args: tuple, parent_pid: int, conn: Connection):
    """A worker: build the handler, then answer calls until killed."""
    from megatron_gspo.runtime.procs import die_with_parent

    die_with_parent(parent_pid)
    try:
        handler = setup(*args)
    except BaseException as e:  # noqa: BLE001 - reported to the pool, which gives up
        conn.send(("setup_error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        call = conn.recv()
        try:
            conn.send(("ok", handler(*call)))
        except Exception as e:  # noqa: BLE001 - user code; the caller decides what it means
            where = traceback.extract_tb(e.__traceback__)[-1]
            conn.send(("error", f"{type(e).__name__}: {e} ({where.filename}:{where.lineno})"))


class _Worker:
    def __init__(self, ctx, setup, args) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(setup, args, os.getpid(), child), daemon=True)
        self.proc.start()
        child.close()
        kill_at_exit(self.proc)
        self.ready = False
        self.started = time.monotonic()
        self.job: tuple[Future, tuple, float] | None = None  # future, call, started at

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)
        self.conn.close()


class WorkerPool:
    """``workers`` processes, each running ``setup(*args)`` once to get its handler, then
    ``handler(*call)`` for every call submitted, each within ``timeout_s`` seconds.

    ``setup`` and the handler's results must be picklable (module-level functions); workers
    start on the first call.
    """

    def __init__(
        self,
        setup: Callable[..., Callable],
        args: tuple = (),
        *,
        workers: int,
        timeout_s: float,
        name: str = "worker",
    ) -> None:
        if workers < 1 or not timeout_s > 0:
            raise ValueError(f"need workers >= 1 and timeout_s > 0, got {workers}, {timeout_s}")
        self.setup, self.args, self.size = setup, args, workers
        self.timeout_s, self.name = timeout_s, name
        self._ctx = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._pending: collections.deque[tuple[Future, tuple]] = collections.deque()
        self._workers: list[_Worker] = []
        self._wake_r, self._wake_w = self._ctx.Pipe(duplex=False)
        self._thread: threading.Thread | None = None
        self._closed = False
        self._broken: str | None = None
        self._failed_starts = 0
        self._all = False  # start every worker, work or not (start())
        # Workers killed at a deadline or lost to a crash, since the pool started.
        self.replaced = 0

    # -- the caller's side -------------------------------------------------------------------

    def start(self) -> None:
        """Start every worker now and wait until all are ready (or raise why they are not),
        rather than on the first call."""
        with self._lock:
            self._ensure_thread()
            self._all = True
        self._wake_w.send(None)
        deadline = time.monotonic() + _START_TIMEOUT_S + 10
        while time.monotonic() < deadline:
            if self._broken or self._closed:
                raise WorkerPoolError(self._broken or f"the {self.name} pool is closed")
            workers = list(self._workers)
            if len(workers) == self.size and all(w.ready for w in workers):
                return
            time.sleep(0.02)
        raise WorkerPoolError(f"the {self.name} workers did not start in time")

    def submit(self, *call: Any) -> Future:
        """Run ``handler(*call)`` on a worker; the future's result is an :class:`Outcome`."""
        future: Future = Future()
        with self._lock:
            if self._closed or self._broken:
                raise WorkerPoolError(self._broken or f"the {self.name} pool is closed")
            self._pending.append((future, call))
            self._ensure_thread()
        self._wake_w.send(None)
        return future

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._dispatch, name=f"{self.name}-pool", daemon=True
            )
            self._thread.start()

    def map(self, calls: Iterable[tuple]) -> list[Outcome]:
        """Run every call (spread over the workers); outcomes in the order of ``calls``."""
        futures = [self.submit(*call) for call in calls]
        return [f.result() for f in futures]

    def close(self) -> None:
        """Kill the workers; calls not answered yet fail with :class:`WorkerPoolError`."""
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._wake_w.send(None)
            thread.join()
        else:
            self._shutdown()

    # -- the dispatcher thread ---------------------------------------------------------------

    def _dispatch(self) -> None:
        self._round_end = time.monotonic()
        try:
            while not self._closed:
                self._step()
        except BaseException as e:  # noqa: BLE001 - fail every caller rather than hang them
            self._broken = f"the {self.name} pool failed: {type(e).__name__}: {e}"
            log.exception("%s pool dispatcher", self.name)
        finally:
            self._shutdown()

    def _step(self) -> None:
        self._fill()
        self._assign()
        now = time.monotonic()
        deadlines = [
            w.job[2] + self.timeout_s if w.job is not None else w.started + _START_TIMEOUT_S
            for w in self._workers
            if w.job is not None or not w.ready
        ]
        # Bounded to a tick while calls run, so that a stop of the trainer is seen.
        timeout = min(TICK_S, max(0.0, min(deadlines) - now)) if deadlines else None
        waitables: list[Any] = [self._wake_r]
        for w in self._workers:
            waitables += [w.conn, w.proc.sentinel]
        for ready in wait(waitables, timeout):
            if ready is self._wake_r:
                while self._wake_r.poll():
                    self._wake_r.recv()
        # The whole round since the last one's deadline checks, so that a stop outside the
        # wait (while a call was being assigned, say) is seen as well as one inside it.
        stopped = stopped_for(time.monotonic() - self._round_end, timeout or 0.0)
        if timeout is not None and stopped:
            self._not_counting(stopped)
        for w in list(self._workers):
            self._poll(w)
        now = time.monotonic()
        for w in list(self._workers):
            if not w.ready and now >= w.started + _START_TIMEOUT_S:
                self._broken = (
                    f"the {self.name} workers did not start within {_START_TIMEOUT_S:g} s"
                )
                self._replace(w, restart=False)
            elif w.job is not None and now >= w.job[2] + self.timeout_s:
                future, _, started = w.job
                self._replace(w)
                future.set_result(
                    Outcome(
                        "timeout",
                        message=f"no answer within {self.timeout_s:g} s (the worker was killed)",
                        seconds=now - started,
                    )
                )
        self._round_end = time.monotonic()

    def _not_counting(self, seconds: float) -> None:
        """Move every running deadline ``seconds`` later: the round that took them could not
        run, so neither could the workers it waited for (a stopped job stops every process of
        it), and a call stopped half-way is not a hung call. A call gains the stop plus at most
        one round's own work."""
        log.warning("%s pool: the trainer was stopped for %.0f s; deadlines moved by as much",
                    self.name, seconds)  # fmt: skip
        for w in self._workers:
            w.started += seconds
            if w.job is not None:
                future, call, started = w.job
                w.job = (future, call, started + seconds)

    def _fill(self) -> None:
        """Start workers up to the pool's size, while there is work for them."""
        if self._broken:
            self._fail_pending(self._broken)
            return
        while len(self._workers) < self.size and (self._pending or self._all) and not exiting():
            self._workers.append(_Worker(self._ctx, self.setup, self.args))

    def _assign(self) -> None:
        for w in self._workers:
            if w.ready and w.job is None:
                with self._lock:
                    if not self._pending:
                        return
                    future, call = self._pending.popleft()
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    w.conn.send(call)
                except (pickle.PicklingError, TypeError, AttributeError) as e:
                    future.set_result(Outcome("error", message=f"cannot send the call: {e}"))
                    continue
                w.job = (future, call, time.monotonic())

    def _poll(self, w: _Worker) -> None:
        """Take ``w``'s answer if it has one; replace it if it died."""
        try:
            has_message = w.conn.poll()
            message = w.conn.recv() if has_message else None
        except (EOFError, OSError):
            has_message, message = False, None
        if message is not None:
            kind, value = message
            if kind == "ready":
                w.ready, self._failed_starts = True, 0
            elif kind == "setup_error":
                self._broken = f"the {self.name} workers cannot start: {value}"
                self._replace(w, restart=False)
            elif w.job is not None:
                future, _, started = w.job
                w.job = None
                seconds = time.monotonic() - started
                if kind == "ok":
                    future.set_result(Outcome("ok", value, seconds=seconds))
                else:
                    future.set_result(Outcome("error", message=value, seconds=seconds))
            return
        if not w.proc.is_alive():
            w.proc.join()
            code = w.proc.exitcode
            if w.job is not None:
                future, _, started = w.job
                future.set_result(
                    Outcome(
                        "error",
                        message=f"the worker died (exit code {code})",
                        seconds=time.monotonic() - started,
                    )
                )
            elif not w.ready:
                self._failed_starts += 1
                if self._failed_starts >= _MAX_FAILED_STARTS:
                    self._broken = (
                        f"the {self.name} workers die as they start (exit code {code}, "
                        f"{self._failed_starts} times in a row)"
                    )
            self._replace(w, restart=not self._broken)

    def _replace(self, w: _Worker, *, restart: bool = True) -> None:
        w.job = None
        w.kill()
        self._workers.remove(w)
        self.replaced += 1
        # Not at interpreter exit: the helpers being killed then must stay dead.
        if restart and not self._closed and not exiting():
            self._workers.append(_Worker(self._ctx, self.setup, self.args))

    def _fail_pending(self, why: str) -> None:
        with self._lock:
            pending, self._pending = list(self._pending), collections.deque()
        for future, _ in pending:
            if not future.done():
                future.set_exception(WorkerPoolError(why))

    def _shutdown(self) -> None:
        for w in self._workers:
            if w.job is not None and not w.job[0].done():
                w.job[0].set_exception(WorkerPoolError(f"the {self.name} pool was closed"))
            w.kill()
        self._workers = []
        self._fail_pending(self._broken or f"the {self.name} pool was closed")
