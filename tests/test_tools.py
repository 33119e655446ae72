"""Tools: the calculator, the Python sandbox, and the tool-calling environment, whose every
failure is an error observation the model reads."""

from __future__ import annotations

import json

import pytest

from megatron_gspo.episodes.environment import EnvironmentPool
from megatron_gspo.episodes.tool_env import ToolCalling, parse_tool_calls
from megatron_gspo.toolbox.bwrap import sandbox_problem
from megatron_gspo.toolbox.python_config import PythonToolConfig
from megatron_gspo.toolbox.sandbox import run_python
from megatron_gspo.toolbox.tools import ToolError, calculator

_WHY = sandbox_problem(PythonToolConfig())
needs_isolation = pytest.mark.skipif(_WHY is not None, reason=f"no sandbox here: {_WHY}")


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.mark.parametrize(
    "expression, value",
    [("(3 + 4) * 2", "14"), ("2 ^ 10", "1024"), ("7 / 2", "3.5"), ("sqrt(16) + pi * 0", "4")],
)
def test_calculator(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    "expression, why",
    [
        ("__import__('os').system('true')", "not arithmetic"),
        ("open('/etc/passwd')", "not arithmetic"),
        ("10 ** 10 ** 10", "exponent too large"),
        ("1 / 0", "ZeroDivisionError"),
        ("(", "cannot parse"),
    ],
)
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression, why):
    with pytest.raises(ToolError, match=why):
        calculator(expression)


@needs_isolation
def test_python_runs_code_with_bounded_resources():
    """The attacks are in tests/test_sandbox.py; here the limits the recipe sets."""
    assert run_python("print(sum(range(10)))").output.strip() == "45"
    hog = run_python("x = bytearray(2 ** 33)", PythonToolConfig(memory_mb=256))
    assert not hog.ok and "MemoryError" in hog.output, hog.output
    spin = run_python("while True: pass", PythonToolConfig(timeout_s=1))
    assert not spin.ok and "timed out after 1 s" in spin.output
    long = run_python("print('a' * 5000)", PythonToolConfig(max_output_chars=100))
    assert long.ok and len(long.output) < 150 and "chars cut" in long.output


def test_tool_calls_are_parsed_from_the_model_turn():
    text = "Let me compute. " + call("calculator", expression="1+1") + " then " + call("python")
    assert parse_tool_calls(text) == [("calculator", {"expression": "1+1"}), ("python", {})]
    assert parse_tool_calls("no call, the answer is 4") == []
    (bad,) = parse_tool_calls("<tool_call>{not json}</tool_call>")
    assert isinstance(bad, str) and "not JSON" in bad
    (unclosed,) = parse_tool_calls('<tool_call>{"name": "calculator"')
    assert "without </tool_call>" in unclosed


def failing_tool(x: int) -> str:
    raise RuntimeError(f"cannot handle {x}")


def echo_tool(words: list) -> dict:
    return {"echo": words}


@needs_isolation
@pytest.mark.parametrize(
    "action, observation, errors",
    [
        (call("calculator", expression="6 * 7"), "42", 0),
        ("<tool_call>{oops}</tool_call>", "Error: malformed tool call", 1),
        (call("search", query="x"), "Error: unknown tool 'search'", 1),
        (call("failing_tool", x=3), "Error: failing_tool failed: RuntimeError: cannot handle 3", 1),
        (call("calculator", expression="6 *"), "Error: calculator: cannot parse", 1),
        (call("python", code="while True: pass"), "Error: python: timed out after 1 s", 1),
        (call("python", code="x = bytearray(2 ** 33)"), "MemoryError", 1),
        (call("echo_tool", words=["a"]), '{"echo": ["a"]}', 0),
        (call("calculator", expression="1") * 3, "Error: at most 2 tool calls per turn", 1),
    ],
    ids=[
        "ok", "malformed", "unknown", "raises", "bad-arguments", "hangs", "memory",
        "user-tool", "too-many",
    ],
)  # fmt: skip
def test_every_failing_call_is_an_error_observation_and_the_episode_goes_on(
    action, observation, errors
):
    env = ToolCalling(
        tools=[
            "calculator",
            "python",
            "tests.test_tools:failing_tool",
            "tests.test_tools:echo_tool",
        ],
        python={"timeout_s": 1, "memory_mb": 256},
        max_calls_per_turn=2,
    )
    step = env.step(env.reset("q", "a"), action)
    assert observation in step.observation and not step.done, step
    assert step.info["tool_errors"] == errors and step.info["tool_calls"] >= 1
    assert env.step(None, "The answer is \\boxed{42}.").done


def test_a_tool_env_in_its_workers_counts_calls_and_names_bad_settings():
    pool = EnvironmentPool("tools", {"tools": ["calculator"]}, timeout_s=30, workers=1)
    try:
        outcome = pool.step(None, call("calculator", expression="2+2")).result()
    finally:
        pool.close()
    assert outcome.ok and outcome.value.observation == "4"
    assert outcome.value.info["tool_calls"] == 1
    with pytest.raises(ValueError, match=r"cannot take kwargs \['tool'\]"):
        EnvironmentPool("tools", {"tool": ["calculator"]}, timeout_s=30)
    with pytest.raises(ValueError, match="unknown tool 'abacus'"):
        ToolCalling(tools=["abacus"])
