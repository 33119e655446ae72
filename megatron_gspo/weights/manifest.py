"""A checkpoint's manifest: the layout and model it was saved with and every file's size and
SHA-256, written last; verification names a missing, truncated or changed file.

Kept apart from :mod:`megatron_gspo.run.checkpoint` (which writes and loads) so that a run directory
can be checked before a policy exists, and by tools without Megatron-Core's model code.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_gspo.runtime.errors import UserError

log = logging.getLogger(__name__)


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be written or used; the message names the file."""


MANIFEST = "manifest.json"
# Each rank's hashes of the files it wrote, until the manifest gathers them.
HASHES_FILE = ".sha256_rank{rank:05d}.json"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


# torch_dist names the shard files a rank writes "__<rank>_<n>.distcp"; the rng files are ours.
_OWNED = re.compile(r"^(?:__(\d+)_\d+\.distcp|rng_rank(\d+)\.pt)$")


def owner_of(name: str) -> int:
    """The rank that wrote a checkpoint file (rank 0 writes the common files)."""
    m = _OWNED.match(name)
    return int(m.group(1) or m.group(2)) if m else 0


def hash_files(paths: list[Path], directory: Path) -> dict[str, dict[str, Any]]:
    """``{relative path: {bytes, sha256}}`` of files just written (still in the page cache)."""
    return {
        str(p.relative_to(directory)): {"bytes": p.stat().st_size, "sha256": sha256_of(p)}
        for p in paths
    }


def write_then_hash(write, directory: str, rank: int, buckets, *args) -> None:
    """In the process Megatron forks to write a rank's shards: write them, then hash them from
    the page cache into a file the finalization gathers."""
    write(rank, buckets, *args)
    root = Path(directory)
    hashes = hash_files([Path(b[0]) for b in buckets], root)
    (root / HASHES_FILE.format(rank=rank)).write_text(json.dumps(hashes))


class UnverifiedCheckpointError(CheckpointError):
    """A checkpoint without a manifest: nothing says whether its files are whole."""


TRUST_OPTION = "--trust-unverified-checkpoint"


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """``directory``'s manifest, None where it has none; a manifest that cannot be read is an
    error naming it."""
    path = directory / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
            raise ValueError("no 'files' table")
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"{path}: not a checkpoint manifest ({e}); the checkpoint cannot be verified"
        ) from None
    return manifest


def check_files(
    directory: Path, *, rank: int = 0, world: int = 1
) -> tuple[dict[str, Any] | None, list[str]]:
    """The manifest of ``directory`` and what is wrong with this rank's share of its files."""
    manifest = read_manifest(directory)
    if manifest is None:
        return None, []
    problems = []
    for i, (rel, meta) in enumerate(sorted(manifest["files"].items())):
        if i % world != rank:
            continue
        file = directory / rel
        if not file.is_file():
            problems.append(f"{file}: missing")
        elif file.stat().st_size != meta["bytes"]:
            problems.append(
                f"{file}: {file.stat().st_size} bytes, {meta['bytes']} when written (truncated?)"
            )
        elif sha256_of(file) != meta["sha256"]:
            problems.append(f"{file}: checksum differs from when it was written (corrupt)")
    return manifest, problems


def _raise_problems(directory: Path, problems: list[str]) -> None:
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(f"checkpoint {directory} is damaged: {problems[0]}{more}")


def verify_checkpoint(directory: str | Path) -> dict[str, Any] | None:
    """Verify a checkpoint directory from one process (conversion, tools)."""
    directory = Path(directory)
    manifest, problems = check_files(directory)
    _raise_problems(directory, problems)
    return manifest


def verify(directory: Path, *, trust_unverified: bool = False) -> dict[str, Any] | None:
    """Check every file of a checkpoint against its manifest, each rank a share (collective);
    returns the manifest.

    Raises :class:`CheckpointError` naming the first missing, resized or changed file, and
    :class:`UnverifiedCheckpointError` for a checkpoint without a manifest unless
    ``trust_unverified`` (then it is loaded with a warning).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    # Every rank reads the same manifest: one that cannot be read fails them all alike.
    manifest, problems = check_files(directory, rank=rank, world=world)
    found: list[list[str]] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(found, problems)
    _raise_problems(directory, [p for part in found for p in part])
    if manifest is None:
        if not trust_unverified:
            raise UnverifiedCheckpointError(
                f"checkpoint {directory} has no {MANIFEST}: its files cannot be verified "
                f"(written before manifests, or the manifest was lost); {TRUST_OPTION} "
                "loads it anyway"
            )
        log.warning("%s has no %s: loading it unverified (%s)", directory, MANIFEST, TRUST_OPTION)
    return manifest
