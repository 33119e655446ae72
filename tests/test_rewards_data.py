"""Reward functions, prompt datasets and tokenizers."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import numpy as np
import pytest

from megatron_gspo.config import DataConfig, RewardConfig
from megatron_gspo.data.prompts import DataError, PromptStream
from megatron_gspo.rewards.computer import RewardComputer
from megatron_gspo.rewards.functions import (
    digit_match,
    exact_match,
    extract_answer,
    math_answer,
    resolve_reward,
)
from megatron_gspo.rewards.value import reward_value
from tests.support.data import train_sentencepiece


def test_builtin_rewards():
    assert exact_match(" 42 ", "42") == 1.0 and exact_match("41", "42") == 0.0
    assert digit_match("123", "123") == 1.0
    assert digit_match("124", "123") == pytest.approx(2 / 3)
    assert digit_match("12", "123") == pytest.approx(2 / 3)  # too short
    assert digit_match("12345", "123") == pytest.approx(3 / 5)  # too long
    assert extract_answer(r"so \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert extract_answer("first 3 then 1,024") == "1,024"
    assert math_answer(r"The answer is \boxed{1024}", "1024") == 1.0
    assert math_answer("I think it is 7.", "7") == 1.0
    assert math_answer("I think it is 8.", "7") == 0.0


def raising_reward(response: str, answer: str) -> float:
    if response == "boom":
        raise RuntimeError("user code failed")
    return 1.0


def slow_reward(response: str, answer: str) -> float:
    if response == "slow":
        time.sleep(2.0)
    return 0.5


def test_reward_that_raises_or_times_out_scores_zero_and_is_counted():
    cfg = RewardConfig(
        functions=[
            {"name": "tests.test_rewards_data:raising_reward"},
            {"name": "tests.test_rewards_data:slow_reward", "weight": 2.0},
        ],
        timeout_s=0.3,
    )
    computer = RewardComputer(cfg)
    rewards, stats = computer(["ok", "boom", "slow"], ["a", "b", "c"])
    computer.close()
    # A sample with a failed function has no real score: 0, and marked failed.
    assert rewards == [2.0, 0.0, 0.0]
    assert (stats.errors, stats.timeouts) == (1, 1)
    assert stats.failed == [False, True, True]
    assert "raising_reward on sample 1" in stats.first_failure


def strange_reward(response: str, answer: str) -> float:
    values = {
        "nan": float("nan"),
        "inf": float("inf"),
        "text": "high",
        "string number": "0.5",
        "bool": True,
        "huge": 1e308,
        "numpy": np.float32(0.25),
        "int": 1,
    }
    return values.get(response, 1.0)


def hanging_reward(response: str, answer: str) -> float:
    if response == "hang":
        time.sleep(3600)
    return 1.0


def test_anything_but_a_finite_real_number_is_a_failed_reward():
    computer = RewardComputer(
        RewardConfig(functions=[{"name": "tests.test_rewards_data:strange_reward"}])
    )
    cases = ["nan", "inf", "text", "string number", "bool", "huge", "numpy", "int", "fine"]
    try:
        rewards, stats = computer(cases, ["a"] * len(cases))
    finally:
        computer.close()
    assert rewards == [0.0] * 6 + [0.25, 1.0, 1.0]
    assert stats.failed == [True] * 6 + [False] * 3
    assert (stats.errors, stats.timeouts) == (6, 0)
    assert "'0.5' (str), not a number" in stats.first_failure or "nan" in stats.first_failure


@pytest.mark.parametrize(
    "value, message",
    [("0.5", "'0.5' (str), not a number"), (True, "True (bool)"), (1e308, "not a finite")],
)
def test_reward_value_refuses_what_only_converts_to_a_number(value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        reward_value(value)
    assert reward_value(np.int64(3)) == 3.0


def test_rare_hangs_cost_one_sample_each_not_the_batch():
    # 2 workers, 4 hangs among 40 samples, 1 s deadline per call: exactly the hung samples
    # time out (a deadline for the batch would take every sample queued behind them).
    cfg = RewardConfig(
        functions=[{"name": "tests.test_rewards_data:hanging_reward"}], timeout_s=1.0
    )
    computer = RewardComputer(cfg, max_workers=2)
    responses = ["hang" if i % 10 == 3 else "ok" for i in range(40)]
    try:
        start = time.monotonic()
        rewards, stats = computer(responses, ["a"] * 40)
        elapsed = time.monotonic() - start
        assert stats.timeouts == 4 and stats.errors == 0, stats
        assert rewards == [0.0 if r == "hang" else 1.0 for r in responses]
        # timeout x hangs / workers = 2 s, plus the replacement workers' start.
        assert elapsed < 2 * 1.0 + 30, elapsed
        # The replacements serve the next batch.
        rewards, stats = computer(["ok", "ok"], ["a", "a"])
        assert rewards == [1.0, 1.0] and stats.timeouts == 0
    finally:
        computer.close()


def test_reward_workers_survive_the_sigterm_meant_for_the_trainer():
    # Slurm signals every process of the job; the trainer still needs its rewards to finish the
    # step and save. The workers are ended by the computer (SIGKILL) or by the trainer's exit.
    computer = RewardComputer(RewardConfig(functions=[{"name": "exact_match"}]), max_workers=2)
    try:
        computer.start()
        procs = [w.proc for w in computer.pool._workers]
        for p in procs:
            os.kill(p.pid, signal.SIGTERM)
        time.sleep(0.5)
        assert all(p.is_alive() for p in procs)
        rewards, stats = computer(["a", "b"], ["a", "a"])
        assert rewards == [1.0, 0.0] and (stats.errors, stats.timeouts) == (0, 0)
    finally:
        computer.close()
    assert not any(p.is_alive() for p in procs)


def test_reward_settings_that_would_fail_every_call_are_refused_at_start():
    with pytest.raises(ValueError, match=r"reward.functions\[0\]: digit_match cannot take"):
        RewardComputer(RewardConfig(functions=[{"name": "digit_match", "kwargs": {"x": 1}}]))
    with pytest.raises(ValueError, match="reward.timeout_s must be > 0"):
        RewardConfig(timeout_s=0)
    with pytest.raises(ValueError, match="reward.timeout_s must be > 0"):
        RewardConfig(timeout_s=-1)
    # A keyword the function does take is fine.
    RewardComputer(RewardConfig(functions=[{"name": "format", "kwargs": {"pattern": "x"}}])).close()


def test_unknown_or_unimportable_reward_is_refused_at_start():
    with pytest.raises(ValueError, match="unknown reward 'exactmatch'"):
        resolve_reward("exactmatch")
    with pytest.raises(ValueError, match="cannot import 'no_such_module:fn'"):
        resolve_reward("no_such_module:fn")


def _jsonl(tmp_path, lines: list[str]):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    return train_sentencepiece(tmp_path_factory.mktemp("spm"))


def test_malformed_jsonl_line_is_named(tmp_path, spm_model):
    path = _jsonl(tmp_path, ['{"prompt": "a", "answer": "1"}', "{not json", "{}"])
    with pytest.raises(DataError, match=rf"{path}:2: not valid JSON"):
        PromptStream(DataConfig(path=str(path), tokenizer=str(spm_model)), seed=0)
    path = _jsonl(tmp_path, ['{"prompt": "a", "answer": "1"}', '{"prompt": "b"}'])
    with pytest.raises(DataError, match=rf"{path}:2: key 'answer' is missing"):
        PromptStream(DataConfig(path=str(path), tokenizer=str(spm_model)), seed=0)


def test_missing_dataset_file_is_named(tmp_path, spm_model):
    with pytest.raises(DataError, match="nope.jsonl: dataset file not found"):
        PromptStream(
            DataConfig(path=str(tmp_path / "nope.jsonl"), tokenizer=str(spm_model)), seed=0
        )


def test_jsonl_stream_with_custom_keys_resumes_where_it_stopped(tmp_path, spm_model):
    records = [json.dumps({"q": f"what is {i} plus 1 ?", "a": str(i + 1)}) for i in range(5)]
    cfg = DataConfig(
        path=str(_jsonl(tmp_path, records)),
        tokenizer=str(spm_model),
        prompt_key="q",
        answer_key="a",
    )
    full = PromptStream(cfg, seed=3)
    expected = [p.answer for p in full.next_batch(12)]
    assert sorted(expected[:5]) == sorted(str(i + 1) for i in range(5)), "an epoch is a permutation"
    first = PromptStream(cfg, seed=3)
    got = [p.answer for p in first.next_batch(7)]
    resumed = PromptStream(cfg, seed=3)
    resumed.position = first.position
    got += [p.answer for p in resumed.next_batch(5)]
    assert got == expected
    ids = full.next_batch(1)[0].token_ids
    assert full.tokenizer.decode(ids).startswith("what is")


def test_hf_tokenizer_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    tok = tokenizers.Tokenizer(
        models.WordLevel({"<unk>": 0, "</s>": 1, "hi": 2, "there": 3}, unk_token="<unk>")
    )
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    from megatron_gspo.data.tokenizer import load_tokenizer

    t = load_tokenizer(tmp_path)
    assert t.eos_id == 1 and t.encode("hi there") == [2, 3] and t.vocab_size == 4


MATH_CASES = [
    ("so the answer is \\boxed{\\frac{1}{2}}", "1/2", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("The total is 1,000 dollars.", "1000", 1.0),
    ("The side is \\boxed{12 \\text{ cm}}.", "12", 1.0),
    ("x = 2/3", "\\frac{2}{3}", 1.0),
    ("\\boxed{-\\dfrac{3}{4}}", "-0.75", 1.0),
    ("\\boxed{3}", "4", 0.0),
    ("I am not sure.", "7", 0.0),
    ("first 12, then \\boxed{13}", "12", 0.0),
]


@pytest.mark.parametrize("path", ["math-verify", "built-in"])
@pytest.mark.parametrize("response,answer,expected", MATH_CASES)
def test_math_reward_on_real_looking_answers(monkeypatch, path, response, answer, expected):
    from megatron_gspo.rewards import functions as rewards

    if path == "math-verify":
        pytest.importorskip("math_verify")
    else:
        monkeypatch.setattr(rewards, "_math_verify", lambda: None)
    assert rewards.math_answer(response, answer) == expected
