"""Read and write Hugging Face safetensors checkpoints one tensor at a time.

Why not ``safetensors.safe_open`` / ``save_file``: ``safe_open`` memory-maps whole files, and
the pages a conversion touches stay resident (and counted in RSS) until the file is closed;
``save_file`` needs every tensor of a shard in memory at once. The format is simple (an 8-byte
little-endian header length, a JSON header with dtype, shape and byte range of each tensor, then
the raw little-endian bytes), so reading a tensor here is one ``seek`` + ``readinto`` into a
fresh tensor, and writing a shard is: plan the tensors, write the header, stream each tensor's
bytes as it is produced. Peak memory is one tensor, whatever the checkpoint size.

Errors name the file: a missing shard referenced by the index, a truncated or corrupt file.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_gspo.runtime.errors import InputError
from megatron_gspo.weights.hf import fused_expert_source

__all__ = [
    "HFCheckpointReader",
    "SafetensorsError",
    "ShardedSafetensorsWriter",
    "INDEX_NAME",
]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
# A header larger than this is a corrupt length field, not a real header.
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsError(InputError):
    """A safetensors checkpoint that cannot be read; the message names the file."""


@dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    # Absolute byte offset of the tensor's data in the file, and its length.
    start: int
    nbytes: int


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def read_header(path: Path) -> dict[str, _Entry]:
    """Parse and validate one file's header; detects truncation by comparing with its size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise SafetensorsError(f"{path}: truncated safetensors file (no header)")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER or 8 + n > size:
                raise SafetensorsError(
                    f"{path}: truncated or corrupt safetensors file (header length {n}, "
                    f"file size {size})"
                )
            header = json.loads(f.read(n))
    except FileNotFoundError as e:
        raise SafetensorsError(f"{path}: file not found") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SafetensorsError(f"{path}: corrupt safetensors header: {e}") from e
    header.pop("__metadata__", None)
    entries: dict[str, _Entry] = {}
    end_max = 0
    for name, info in header.items():
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise SafetensorsError(f"{path}: corrupt header entry for tensor {name!r}") from e
        if end - begin != _numel(shape) * dtype.itemsize:
            raise SafetensorsError(
                f"{path}: tensor {name!r} has {end - begin} bytes for shape {shape} {dtype}"
            )
        entries[name] = _Entry(path, dtype, shape, 8 + n + begin, end - begin)
        end_max = max(end_max, end)
    if 8 + n + end_max > size:
        raise SafetensorsError(
            f"{path}: truncated safetensors file ({size} bytes, the header needs {8 + n + end_max})"
        )
    return entries


class HFCheckpointReader:
    """Tensors of a Hugging Face checkpoint directory, read on demand.

    Accepts a single ``model.safetensors`` or shards listed in ``model.safetensors.index.json``.
    All headers are read and validated up front, so a missing or truncated shard fails before
    any output is written.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        index = self.directory / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise SafetensorsError(f"{index}: not a valid safetensors index: {e}") from e
            files = sorted(set(weight_map.values()))
            for fname in files:
                if not (self.directory / fname).is_file():
                    some = next(k for k, v in weight_map.items() if v == fname)
                    raise SafetensorsError(
                        f"{self.directory / fname}: shard file referenced by {index} "
                        f"(for tensor {some!r}) is missing"
                    )
        elif (self.directory / SINGLE_NAME).is_file():
            files = [SINGLE_NAME]
        else:
            raise SafetensorsError(
                f"{self.directory}: no {SINGLE_NAME} or {INDEX_NAME} (only safetensors "
                "checkpoints are supported)"
            )
        self.entries: dict[str, _Entry] = {}
        for fname in files:
            self.entries.update(read_header(self.directory / fname))

    def __contains__(self, name: str) -> bool:
        return name in self.entries or self._fused(name) is not None

    def _fused(self, name: str) -> tuple[_Entry, int, str] | None:
        src = fused_expert_source(name)
        if src is None or src[0] not in self.entries:
            return None
        return self.entries[src[0]], src[1], src[2]

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.entries:
            return self.entries[name].shape
        fused = self._fused(name)
        if fused is None:
            raise KeyError(name)
        entry, _, part = fused
        if part == "down":
            return entry.shape[1:]
        return (entry.shape[1] // 2, entry.shape[2])

    def dtype(self, name: str) -> torch.dtype:
        if name in self.entries:
            return self.entries[name].dtype
        fused = self._fused(name)
        if fused is None:
            raise KeyError(name)
        return fused[0].dtype

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor into fresh memory (no memory map is left behind)."""
        if name in self.entries:
            e = self.entries[name]
            return _read(e.file, e.start, e.nbytes, e.dtype, e.shape)
        fused = self._fused(name)
        if fused is None:
            raise SafetensorsError(f"{self.directory}: checkpoint has no tensor {name!r}")
        # One expert's block of a fused [E, rows, cols] parameter is contiguous; gate rows come
        # before up rows in gate_up_proj.
        entry, expert, part = fused
        shape = self.shape(name)
        nbytes = _numel(shape) * entry.dtype.itemsize
        per_expert = _numel(entry.shape[1:]) * entry.dtype.itemsize
        start = entry.start + expert * per_expert + (nbytes if part == "up" else 0)
        return _read(entry.file, start, nbytes, entry.dtype, shape)


def _read(path: Path, start: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]):
    buf = torch.empty(nbytes, dtype=torch.uint8)
    with open(path, "rb") as f:
        f.seek(start)
        got = f.readinto(memoryview(buf.numpy()))
    if got != nbytes:
        raise SafetensorsError(f"{path}: truncated safetensors file (short read)")
    return buf.view(dtype).reshape(shape)


def parse_size(text: str) -> int:
    """``"5GB"``, ``"500MB"``, ``"1GiB"`` or a plain byte count, as bytes."""
    s = text.strip().upper()
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "KB": 10**3, "MB": 10**6,
             "GB": 10**9, "B": 1}  # fmt: skip
    for unit, mult in units.items():
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(s)


class ShardedSafetensorsWriter:
    """Writes a known list of tensors into size-limited shards, streaming one tensor at a time.

    The names, shapes and dtype of every tensor are given up front (they follow from the model
    config), so each shard's header can be written before its data; :meth:`write` must then be
    called in exactly that order. :meth:`close` writes ``model.safetensors.index.json``.
    """

    def __init__(
        self,
        directory: str | Path,
        tensors: list[tuple[str, tuple[int, ...], torch.dtype]],
        max_shard_size: int,
    ) -> None:
        self.directory = Path(directory)
        shards: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
        size = 0
        for t in tensors:
            nbytes = _numel(t[1]) * t[2].itemsize
            if shards[-1] and size + nbytes > max_shard_size:
                shards.append([])
                size = 0
            shards[-1].append(t)
            size += nbytes
        n = len(shards)
        self._plan = [
            (f"model-{i + 1:05d}-of-{n:05d}.safetensors", s) for i, s in enumerate(shards)
        ]
        self._order = [
            (fname, name, shape, dtype) for fname, s in self._plan for name, shape, dtype in s
        ]
        self._pos = 0
        self._file = None
        self._file_name: str | None = None
        self.total_size = sum(_numel(s) * d.itemsize for _, s, d in tensors)

    def _open(self, fname: str) -> None:
        self._close_file()
        shard = dict(self._plan)[fname]
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape, dtype in shard:
            nbytes = _numel(shape) * dtype.itemsize
            header[name] = {
                "dtype": _DTYPE_NAMES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
        self._file = open(self.directory / fname, "wb")  # noqa: SIM115 - closed in _close_file
        self._file.write(struct.pack("<Q", len(raw)))
        self._file.write(raw)
        self._file_name = fname

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._pos >= len(self._order):
            raise ValueError(f"unexpected tensor {name!r}: all planned tensors were written")
        fname, exp_name, shape, dtype = self._order[self._pos]
        if name != exp_name:
            raise ValueError(f"tensor {name!r} written out of order (expected {exp_name!r})")
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(
                f"tensor {name!r}: got shape {tuple(tensor.shape)} {tensor.dtype}, planned "
                f"{shape} {dtype}"
            )
        if fname != self._file_name:
            self._open(fname)
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        self._file.write(memoryview(data.numpy()))
        self._pos += 1

    def close(self) -> None:
        """Finish the last shard and write the index; refuses if tensors are missing."""
        self._close_file()
        if self._pos != len(self._order):
            missing = self._order[self._pos][1]
            raise ValueError(
                f"{len(self._order) - self._pos} tensors not written (next {missing!r})"
            )
        index = {
            "metadata": {"total_size": self.total_size},
            "weight_map": {name: fname for fname, name, _, _ in self._order},
        }
        (self.directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")

    def abort(self) -> None:
        self._close_file()


def fsync_dir(path: Path) -> None:
    """Flush a directory entry (after a rename) where the platform allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
