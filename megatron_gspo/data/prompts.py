"""Prompt datasets: a JSONL or parquet file or a synthetic task, in a resumable order."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from megatron_gspo.config import DataConfig
from megatron_gspo.data.chat import ChatTemplate
from megatron_gspo.data.records import DataError, read_records
from megatron_gspo.data.tasks import SyntheticTask
from megatron_gspo.data.tokenizer import Tokenizer, load_tokenizer
from megatron_gspo.runtime.seeds import shuffle_seed

__all__ = ["DataError", "Prompt", "PromptStream"]

# A prompt longer than (max prompt tokens + 1) x this many characters is first tokenized only
# that far: natural text and code average under 5 characters a token.
_CHARS_PER_TOKEN = 16
_CUT_MARGIN = 8


@dataclass(frozen=True)
class Prompt:
    text: str
    answer: str
    token_ids: list[int]


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
        # Records of the file passed over as bad (data.bad_records: skip).
        self.bad_records = 0
        self.chat: ChatTemplate | None = None
        if config.task is not None:
            self._task = SyntheticTask(config.task, **config.task_options)
            self.tokenizer: Tokenizer = self._task.tokenizer
        else:
            self._records, self.bad_records = read_records(
                Path(config.path),
                config.prompt_key,
                config.answer_key,
                bad_records=config.bad_records,
            )
            self.tokenizer = load_tokenizer(config.tokenizer)
        if config.chat_template:
            self.chat = ChatTemplate(
                config.tokenizer,
                system_prompt=config.system_prompt,
                kwargs=config.chat_template_kwargs,
            )
        self.shuffle = config.shuffle

    def _record(self, index: int) -> dict[str, str]:
        if self._task is not None:
            return self._task.example(index, self.seed)
        n = len(self._records)
        epoch, offset = divmod(index, n)
        order = list(range(n))
        if self.shuffle:
            random.Random(shuffle_seed(self.seed, epoch)).shuffle(order)
        return self._records[order[offset]]

    def encode_prompt(self, text: str) -> list[int]:
        if self.chat is not None:  # the template writes whatever special tokens it wants
            return self.tokenizer.encode(self.chat.render(text))
        bos = [self.tokenizer.bos_id] if self.tokenizer.bos_id is not None else []
        return bos + self.tokenizer.encode(text)

    def _encode_bounded(self, text: str) -> tuple[list[int], str]:
        """The prompt's ids, and how many there are, in words. A text much longer than any
        prompt that fits is tokenized only as far as a prefix that already holds too many
        tokens: a tokenizer holds the whole text's ids (and more) in memory at once, gigabytes
        for one 10 MB line."""
        limit = self.max_prompt_tokens
        cut = (limit + 1) * _CHARS_PER_TOKEN if limit is not None else len(text)
        if len(text) > cut:
            ids = self.encode_prompt(text[:cut])
            # A prefix's last word may split into more tokens than it would whole; the margin
            # keeps such a prompt from being called too long by a token or two.
            if len(ids) > limit + _CUT_MARGIN:
                return (
                    ids,
                    f"more than {len(ids) - _CUT_MARGIN} tokens in its first {cut} characters",
                )
        ids = self.encode_prompt(text)
        return ids, f"{len(ids)} tokens"

    def next_batch(self, n: int) -> list[Prompt]:
        """The next ``n`` prompts that fit (``position`` counts every record consumed)."""
        out: list[Prompt] = []
        run_of_skips = 0
        limit = len(self._records) if self._records else 10_000
        while len(out) < n:
            r = self._record(self.position)
            self.position += 1
            ids, counted = self._encode_bounded(r["prompt"])
            if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
                where = r.get("where") or f"{self._task.name} example {self.position - 1}"
                why = (
                    f"{where}: the prompt has {counted}; at most "
                    f"{self.max_prompt_tokens} tokens fit beside rollout.max_new_tokens within "
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
