"""Prompt datasets: a JSONL file or a synthetic task, served in a resumable order."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from megatron_gspo.config import DataConfig
from megatron_gspo.data.tasks import SyntheticTask
from megatron_gspo.data.tokenizer import Tokenizer, load_tokenizer


@dataclass(frozen=True)
class Prompt:
    text: str
    answer: str
    token_ids: list[int]


class DataError(ValueError):
    """A dataset that cannot be used; the message names the file and line."""


def read_jsonl(path: Path, prompt_key: str, answer_key: str) -> list[dict[str, str]]:
    if not path.is_file():
        raise DataError(f"{path}: dataset file not found")
    records = []
    with path.open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{line_no}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict):
                raise DataError(f"{path}:{line_no}: expected a JSON object")
            for key in (prompt_key, answer_key):
                if not isinstance(record.get(key), str):
                    raise DataError(f"{path}:{line_no}: missing string field {key!r}")
            records.append({"prompt": record[prompt_key], "answer": record[answer_key]})
    if not records:
        raise DataError(f"{path}: no records")
    return records


class PromptStream:
    """Endless prompts; epochs of a file in a seeded shuffle, or a task's seeded stream.

    ``position`` (prompts served so far) is the whole state: a resumed run continues where the
    checkpoint left off.
    """

    def __init__(self, config: DataConfig, *, seed: int) -> None:
        self.seed = seed
        self.position = 0
        self._task: SyntheticTask | None = None
        self._records: list[dict[str, str]] = []
        if config.task is not None:
            self._task = SyntheticTask(config.task, **config.task_options)
            self.tokenizer: Tokenizer = self._task.tokenizer
        else:
            self._records = read_jsonl(Path(config.path), config.prompt_key, config.answer_key)
            self.tokenizer = load_tokenizer(config.tokenizer)
        self.shuffle = config.shuffle

    def _record(self, index: int) -> dict[str, str]:
        if self._task is not None:
            return self._task.example(index, self.seed)
        n = len(self._records)
        epoch, offset = divmod(index, n)
        order = list(range(n))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return self._records[order[offset]]

    def encode_prompt(self, text: str) -> list[int]:
        bos = [self.tokenizer.bos_id] if self.tokenizer.bos_id is not None else []
        return bos + self.tokenizer.encode(text)

    def next_batch(self, n: int) -> list[Prompt]:
        out = []
        for i in range(self.position, self.position + n):
            r = self._record(i)
            out.append(Prompt(r["prompt"], r["answer"], self.encode_prompt(r["prompt"])))
        self.position += n
        return out
