"""Prompt/answer records from a JSONL or parquet file, each bad one named by file, row and key.

A bad record (not JSON, not UTF-8, not an object, a prompt that is not a string, an answer
that is neither a string nor a number, a missing key) is fatal with ``data.bad_records: fail``
(the default) and skipped and counted with ``skip``. Parquet is read with pyarrow (``pip
install 'megatron-gspo[data]'``), only the two columns the recipe names.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from megatron_gspo.runtime.errors import InputError

log = logging.getLogger(__name__)

__all__ = ["DataError", "read_records"]


class DataError(InputError):
    """A dataset that cannot be used; the message names the file and line or row."""


def _fields(record, where: str, prompt_key: str, answer_key: str) -> dict[str, str]:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object")
    prompt, answer = record.get(prompt_key), record.get(answer_key)
    if not isinstance(prompt, str):
        what = "missing" if prompt is None else f"of type {type(prompt).__name__}, not a string"
        raise DataError(f"{where}: key {prompt_key!r} is {what}")
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        what = "missing" if answer is None else f"of type {type(answer).__name__}"
        raise DataError(f"{where}: key {answer_key!r} is {what}, not a string or number")
    return {"prompt": prompt, "answer": str(answer), "where": where}


def _jsonl_rows(path: Path):
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, 1):
            where = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield where, DataError(f"{where}: not valid UTF-8 (byte {e.start} of the line)")
                continue
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                yield where, DataError(f"{where}: not valid JSON ({e.msg})")


def _parquet_rows(path: Path, keys: tuple[str, str]):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"{path}: reading parquet needs pyarrow (pip install 'megatron-gspo[data]')"
        ) from None
    try:
        schema = pq.read_schema(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise DataError(f"{path}: not a readable parquet file ({e})") from None
    missing = [k for k in keys if k not in schema.names]
    if missing:
        raise DataError(
            f"{path}: no column {missing[0]!r} (columns: {', '.join(schema.names)}); set "
            "data.prompt_key / data.answer_key"
        )
    table = pq.read_table(path, columns=list(keys))
    for row, record in enumerate(table.to_pylist()):
        yield f"{path} row {row}", record


def read_records(
    path: Path, prompt_key: str, answer_key: str, *, bad_records: str = "fail"
) -> tuple[list[dict[str, str]], int]:
    """The file's records and the number of bad ones skipped."""
    if not path.is_file():
        raise DataError(f"{path}: dataset file not found")
    if path.suffix == ".parquet":
        rows = _parquet_rows(path, (prompt_key, answer_key))
    else:
        rows = _jsonl_rows(path)
    records, skipped = [], 0
    for where, record in rows:
        try:
            if isinstance(record, DataError):
                raise record
            records.append(_fields(record, where, prompt_key, answer_key))
        except DataError as e:
            if bad_records == "fail":
                raise DataError(f"{e} (data.bad_records: fail; 'skip' to pass over it)") from None
            skipped += 1
            if skipped <= 5:
                log.warning("skipping a bad record: %s", e)
    if skipped:
        log.warning("%s: skipped %d bad record(s) (data.bad_records: skip)", path, skipped)
    if not records:
        raise DataError(f"{path}: no usable records")
    return records, skipped
