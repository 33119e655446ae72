"""The checkpoint directory's file operations: a file replaced atomically, a directory entry
flushed, and old checkpoints deleted off the step loop.

Deleting a checkpoint is renaming it out of the way, at once, then removing its files in a
background thread: the files of a large checkpoint take a while to go (0.13 s for 0.4 GB in the
page cache here; far longer for hundreds of GB on a parallel filesystem), and nothing needs
them gone before the next step. A process killed while they go leaves the renamed directory
behind; :func:`debris` finds it, with the partial copies of killed saves, for the next run to
remove.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

# A checkpoint being written (``.iter_NNNNNNN.tmp``) or being deleted (``.iter_NNNNNNN.old``).
WRITING, DELETING = ".tmp", ".old"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def debris(directory: Path) -> list[Path]:
    """What killed saves and deletions left in ``directory``."""
    return sorted(p for s in (WRITING, DELETING) for p in directory.glob(f".iter_*{s}"))


def remove_files(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


class Remover:
    """Deletes directories in the background, one batch at a time."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self.busy: set[Path] = set()

    def remove(self, paths: list[Path]) -> None:
        """Rename each of ``paths`` out of the way now (it is no longer what it was), and remove
        its files in the background."""
        gone = []
        for path in paths:
            renamed = path.with_name(f".{path.name}{DELETING}")
            remove_files(renamed)  # a leftover of a killed run's deletion
            os.replace(path, renamed)
            gone.append(renamed)
        if not gone:
            return
        fsync_dir(gone[0].parent)
        self.join()  # one batch at a time: deletions never pile up behind a slow filesystem
        self.busy = set(gone)
        self._thread = threading.Thread(
            target=self._run, args=(gone,), name="checkpoint-delete", daemon=True
        )
        self._thread.start()

    def _run(self, paths: list[Path]) -> None:
        for path in paths:
            remove_files(path)
        self.busy = set()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
