"""Real data: parquet and JSONL records with bad ones named (file, row or line, key) and
skipped or fatal, chat formatting through a tokenizer directory's template, GSM8K answers."""

from __future__ import annotations

import json

import pytest

from megatron_gspo.config import DataConfig
from megatron_gspo.data.prompts import DataError, PromptStream
from megatron_gspo.rewards.functions import math_answer
from tests.support.qwen_style import make_gsm8k_parquet, make_tokenizer_dir
from tests.support.ranks import run_distributed
from tests.support.runs import loop_recipe, run_metrics, train_run

pytest.importorskip("pyarrow")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer_dir(tmp_path_factory.mktemp("qwen-style"))


def _gsm8k(path, tokenizer, **options) -> DataConfig:
    return DataConfig(path=str(path), tokenizer=str(tokenizer), prompt_key="question", **options)


def test_parquet_records_with_a_chat_template(tmp_path, tokenizer_dir):
    data = _gsm8k(
        make_gsm8k_parquet(tmp_path / "train.parquet"),
        tokenizer_dir,
        chat_template=True,
        system_prompt="Answer with a number.",
        chat_template_kwargs={"enable_thinking": False},
        shuffle=False,
    )
    stream = PromptStream(data, seed=0)
    prompt = stream.next_batch(1)[0]
    expected = (
        "<|im_start|>system\nAnswer with a number.<|im_end|>\n"
        "<|im_start|>user\nTom has 3 apples and buys 4 more. How many apples does he have?"
        "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert stream.chat.render(prompt.text) == expected
    assert stream.tokenizer.encode(expected) == prompt.token_ids
    # The template's markers are single special tokens, not spelt out in pieces.
    im_start = stream.tokenizer._tok.token_to_id("<|im_start|>")
    assert prompt.token_ids[0] == im_start and prompt.token_ids.count(im_start) == 3
    assert prompt.answer == "3 + 4 = 7\n#### 7"


@pytest.mark.parametrize("suffix", ["parquet", "jsonl"])
def test_a_bad_record_is_named_and_fatal_or_skipped_and_counted(tmp_path, tokenizer_dir, suffix):
    if suffix == "parquet":
        path = make_gsm8k_parquet(tmp_path / "train.parquet", bad_row=True)
        where = rf"{path} row 2: key 'answer' is missing"
    else:
        path = tmp_path / "train.jsonl"
        lines = [
            json.dumps({"question": "one?", "answer": "1"}),
            json.dumps({"question": 2, "answer": "2"}),
            json.dumps({"question": "three?", "answer": 3}),
        ]
        path.write_text("\n".join(lines) + "\n")
        where = rf"{path}:2: key 'question' is of type int, not a string"
    with pytest.raises(DataError, match=where):
        PromptStream(_gsm8k(path, tokenizer_dir), seed=0)
    stream = PromptStream(_gsm8k(path, tokenizer_dir, bad_records="skip"), seed=0)
    assert stream.bad_records == 1 and len(stream._records) == (3 if suffix == "parquet" else 2)


def test_a_missing_column_is_named(tmp_path, tokenizer_dir):
    path = make_gsm8k_parquet(tmp_path / "train.parquet")
    with pytest.raises(DataError, match=r"no column 'prompt' \(columns: question, answer\)"):
        PromptStream(DataConfig(path=str(path), tokenizer=str(tokenizer_dir)), seed=0)


def test_gsm8k_references_are_graded_on_their_final_answer():
    assert math_answer("3 + 4 makes \\boxed{7}", "3 + 4 = 7\n#### 7") == 1.0
    assert math_answer("The answer is 8.", "3 + 4 = 7\n#### 7") == 0.0


def test_the_loop_trains_on_a_parquet_file_in_chat_format(tmp_path, tokenizer_dir):
    path = make_gsm8k_parquet(tmp_path / "train.parquet", bad_row=True)
    data = loop_recipe(
        tmp_path / "run",
        run={"plot_every": 0, "tensorboard": False},
        rollout={"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 8},
        reward={"functions": [{"name": "math"}]},
    )
    data["model"].update(vocab_size=320, max_seq_length=96)
    data["data"] = {
        "path": str(path),
        "tokenizer": str(tokenizer_dir),
        "prompt_key": "question",
        "chat_template": True,
        "bad_records": "skip",
    }
    run_distributed(train_run, 1, data, 2, False)
    records = run_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["bad_records_skipped"] == 1 for r in records)
