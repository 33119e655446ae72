"""``python -m tests.support.kill_points train RECIPE ...``: the CLI, with the trainer killed
(SIGKILL, as an OOM killer or a node failure does) at one named point of the checkpoint of step
``KILL_AT_STEP``; ``KILL_AT`` names the point:

``writing``   the background writer has started and not written the shards
``hashing``   the shards are written, not yet hashed
``publish``   the writers are done; no manifest yet
``renamed``   the directory is renamed into place; ``latest`` still names the one before
``pruning``   ``latest`` is flipped; an older checkpoint, renamed out of the way, is half
              deleted by the background thread that removes its files

A point inside the writer (writing, hashing) kills from the writer process, which then dies
with its trainer; the others kill the trainer from its own thread.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

POINT = os.environ.get("KILL_AT", "")
STEP = int(os.environ.get("KILL_AT_STEP", "0"))


def _kill_trainer() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _install() -> None:
    import megatron_gspo.run.checkpoint as ckpt

    name = f"iter_{STEP:07d}"
    write_then_hash = ckpt.write_then_hash

    def in_writer(write, directory, rank, buckets, *args):
        trainer = os.getppid()
        if name in directory and POINT == "writing":
            os.kill(trainer, signal.SIGKILL)
            os._exit(9)

        def write_and_maybe_die(*a):
            write(*a)
            if name in directory and POINT == "hashing":
                os.kill(trainer, signal.SIGKILL)
                os._exit(9)

        write_then_hash(write_and_maybe_die, directory, rank, buckets, *args)

    ckpt.write_then_hash = in_writer

    publish = ckpt.Checkpointer._publish

    def publish_or_die(self, tmp, final, step, best):
        if step == STEP and POINT == "publish":
            _kill_trainer()
        return publish(self, tmp, final, step, best)

    ckpt.Checkpointer._publish = publish_or_die

    write_atomic = ckpt._write_atomic

    def flip_or_die(path: Path, text: str):
        if path.name == "latest" and text.strip() == str(STEP) and POINT == "renamed":
            _kill_trainer()
        return write_atomic(path, text)

    ckpt._write_atomic = flip_or_die

    import megatron_gspo.run.checkpoint_files as files

    prune, remove_files = ckpt.Checkpointer._prune, files.remove_files
    pruning = []  # the publish of step STEP is pruning

    def prune_and_mark(self, newest):
        if newest == STEP and POINT == "pruning":
            pruning.append(newest)
        return prune(self, newest)

    def remove_or_die(path: Path):
        # In the background deletion of a checkpoint that step STEP's publish pruned.
        if pruning and path.is_dir() and path.name.endswith(files.DELETING):
            doomed = sorted(p for p in path.rglob("*") if p.is_file())
            for f in doomed[: len(doomed) // 2]:
                f.unlink()
            _kill_trainer()
        return remove_files(path)

    ckpt.Checkpointer._prune = prune_and_mark
    files.remove_files = remove_or_die


if __name__ == "__main__":
    _install()
    from megatron_gspo.cli import main

    sys.argv[0] = "megatron-gspo"
    main()
