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
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{path}:{line_no}: not valid UTF-8 (byte {e.start} of the line)"
                ) from None
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
            records.append(
                {
                    "prompt": record[prompt_key],
                    "answer": record[answer_key],
                    "where": f"{path}:{line_no}",
                }
            )
    if not records:
        raise DataError(f"{path}: no records")
    return records


class PromptStream:
    """Endless prompts; epochs of a file in a seeded shuffle, or a task's seeded stream.

    ``position`` (prompts served so far) is the whole state: a resumed run continues where the
    checkpoint left off.
    """

    def __init__(
        self, config: DataConfig, *, seed: int, max_prompt_tokens: int | None = None
    ) -> None:
        self.seed = seed
        self.position = 0
        self.max_prompt_tokens = max_prompt_tokens
        self.overlong = config.overlong_prompts
        # Records passed over because their prompt is too long (since the start of this run).
        self.skipped = 0
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
        """The next ``n`` prompts that fit (``position`` counts every record consumed)."""
        out: list[Prompt] = []
        run_of_skips = 0
        limit = len(self._records) if self._records else 10_000
        while len(out) < n:
            r = self._record(self.position)
            self.position += 1
            ids = self.encode_prompt(r["prompt"])
            if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
                where = r.get("where") or f"{self._task.name} example {self.position - 1}"
                why = (
                    f"{where}: the prompt has {len(ids)} tokens; at most "
                    f"{self.max_prompt_tokens} fit beside rollout.max_new_tokens within "
                    "model.max_seq_length"
                )
                if self.overlong == "fail":
                    raise DataError(f"{why} (data.overlong_prompts: fail)")
                self.skipped += 1
                run_of_skips += 1
                if run_of_skips > limit:
                    raise DataError(f"no prompt fits: {why}")
                continue
            run_of_skips = 0
            out.append(Prompt(r["prompt"], r["answer"], ids))
        return out
