"""Tool calling (``rollout.multi_turn.env: tools``): the model calls tools, the environment
runs them and answers with their results, until the model answers without a call.

A call is written the way Qwen3's and Hermes-style chat templates teach models to write one:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 7"}}
    </tool_call>

Every call of a turn (up to ``max_calls_per_turn``) runs, and their results, one per line, are
the observation, rendered as a ``tool`` message by the tokenizer's chat template
(``rollout.multi_turn.observation_role: tool``). A malformed call, an unknown tool or a tool
that fails (raises, times out, runs out of memory) gives an ``Error: ...`` line the model
reads, counted in ``tool_errors``; it never ends the episode or the run. A turn without a call
is the model's answer: the episode is done, and ``reward.functions`` score that turn.

``env_kwargs``: ``tools`` (names: ``calculator``, ``python``, or ``package.module:function``;
the model calls a user tool by its function name), ``python`` (the python tool: its sandbox,
``backend: local`` (bubblewrap) or ``http`` (a remote service), and its limits;
:class:`~megatron_gspo.toolbox.python_config.PythonToolConfig`), ``max_calls_per_turn``,
``max_output_chars``.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from typing import Any

from megatron_gspo.episodes.environment import Step
from megatron_gspo.toolbox.tools import ToolError, resolve_tool

__all__ = ["ToolCalling", "parse_tool_calls"]

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> list[tuple[str, dict] | str]:
    """The calls in a model turn, in order: ``(name, arguments)``, or an error message for a
    call that cannot be read."""
    calls: list[tuple[str, dict] | str] = []
    for raw in _CALL.findall(text):
        try:
            call = json.loads(raw)
        except json.JSONDecodeError as e:
            calls.append(f"malformed tool call (not JSON: {e.msg} at {e.pos})")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append('malformed tool call (need {"name": ..., "arguments": {...}})')
            continue
        args = call.get("arguments", {})
        if isinstance(args, str):  # some templates write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            calls.append(f"malformed tool call to {call['name']}: arguments must be an object")
            continue
        calls.append((call["name"], args))
    if text.count("<tool_call>") > len(calls):
        calls.append("malformed tool call (<tool_call> without </tool_call>)")
    return calls


class ToolCalling:
    def __init__(
        self,
        tools: list[str] = ("calculator", "python"),  # noqa: B006 - never mutated
        python: dict | None = None,
        max_calls_per_turn: int = 4,
        max_output_chars: int = 1000,
    ) -> None:
        self.tools: dict[str, Callable[..., Any]] = {
            name.rpartition(":")[2]: resolve_tool(name, python) for name in tools
        }
        self.max_calls, self.max_output_chars = max_calls_per_turn, max_output_chars

    def reset(self, prompt: str, answer: str) -> None:
        return None

    def step(self, state: None, action: str) -> Step:
        calls = parse_tool_calls(action)
        if not calls:
            return Step(done=True)
        start, lines, errors = time.monotonic(), [], 0
        for call in calls[: self.max_calls]:
            result, ok = self._run(call)
            lines.append(result if ok else f"Error: {result}")
            errors += not ok
        if len(calls) > self.max_calls:
            lines.append(f"Error: at most {self.max_calls} tool calls per turn; the rest ignored")
            errors += 1
        info = {
            "tool_calls": float(len(calls)),
            "tool_errors": float(errors),
            "tool_time_s": time.monotonic() - start,
        }
        return Step("\n".join(lines), 0.0, False, state, info)

    def _run(self, call: tuple[str, dict] | str) -> tuple[str, bool]:
        if isinstance(call, str):
            return call, False
        name, args = call
        tool = self.tools.get(name)
        if tool is None:
            return f"unknown tool {name!r}; available: {', '.join(sorted(self.tools))}", False
        try:
            result = tool(**args)
        except ToolError as e:
            return f"{name}: {e}", False
        except Exception as e:  # noqa: BLE001 - the model reads what went wrong
            return f"{name} failed: {type(e).__name__}: {e}", False
        text = result if isinstance(result, str) else json.dumps(result, default=str)
        return self._cut(text), True

    def _cut(self, text: str) -> str:
        limit = self.max_output_chars
        return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} cut]"
