"""Rewards from served models: an LLM judge (``judge``) and a scalar reward model
(``reward_model``), behind HTTP.

``judge`` asks an OpenAI-compatible chat-completions server (vLLM or any other; ``url`` ends in
``/v1``) to grade each response: ``template`` is formatted with ``{prompt}``, ``{response}`` and
``{answer}`` into the user message (``system`` optional), and the last score the reply gives is
the reward (:func:`parse_score`: ``Score: 0.8``, ``**score:** 7/10``, ``Score: 1e-3.``; a
``score_pattern`` of the recipe's, whose first group is the score, replaces the label's).
``reward_model`` asks vLLM's ``/classify`` route (or ``/pooling``, ``route: pooling``, for a
model that scores every token: the last one's) for a scalar reward model's raw score
(``use_activation: false``): the text is ``template`` formatted as above, or, without one, the
prompt and the response as a user and an assistant message, which the server renders with its
model's chat template.

A step's requests are in flight together from one asyncio event loop (``httpx``), at most
``max_concurrency`` at a time; each has ``reward.timeout_s`` as its deadline (time the trainer
spends stopped not counted: :mod:`megatron_gspo.runtime.stops`); connection
errors and 5xx answers are retried with backoff inside that deadline, nothing else is. A
request that fails, is late, or whose reply holds no score fails its sample like any failed
reward (``reward.on_error`` decides). ``url`` may be left out where ``megatron-gspo launch``
started the servers: it hands their URLs over in ``MEGATRON_GSPO_REWARD_URLS`` (requests go
round robin). Requests carry ``Authorization: Bearer`` the key in ``api_key_env`` (default:
the job's key, which launch gives the servers).
"""

from __future__ import annotations

import asyncio
import os
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from megatron_gspo.rewards.value import reward_value
from megatron_gspo.runtime.errors import InputError
from megatron_gspo.runtime.stops import within
from megatron_gspo.runtime.workers import Outcome

__all__ = [
    "REWARD_URLS_ENV",
    "SERVED",
    "JudgeKwargs",
    "RewardModelKwargs",
    "ServedReward",
    "ServerDown",
    "check_served",
    "parse_score",
]

REWARD_URLS_ENV = "MEGATRON_GSPO_REWARD_URLS"
JOB_KEY_ENV = "MEGATRON_GSPO_VLLM_KEY"
RETRIES = 3
BACKOFF_S = 0.25

DEFAULT_JUDGE_TEMPLATE = (
    "Grade the response to the question against the reference answer, from 0 (wrong) to 1 "
    "(right).\n\nQuestion:\n{prompt}\n\nReference answer:\n{answer}\n\nResponse:\n{response}\n\n"
    "End with a line 'Score: <number>'."
)


class _Served(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str | None = None
    model: str | None = None
    api_key_env: str | None = None
    max_concurrency: int = Field(64, ge=1)


class JudgeKwargs(_Served):
    template: str = DEFAULT_JUDGE_TEMPLATE
    system: str | None = None
    # None: parse_score's label ("Score:", any case, markdown emphasis around it); a pattern of
    # the recipe's takes its place, its first group the score.
    score_pattern: str | None = None
    max_tokens: int = Field(256, ge=1)
    temperature: float = 0.0


class RewardModelKwargs(_Served):
    template: str | None = None
    # vLLM serves a sequence classifier (most reward models) on /classify, a reward model that
    # scores every token (e.g. Qwen2.5-Math-RM) on /pooling, whose last token is the score.
    route: Literal["classify", "pooling"] = "classify"


SERVED: dict[str, type[_Served]] = {"judge": JudgeKwargs, "reward_model": RewardModelKwargs}


def _kwargs(name: str, kwargs: dict, where: str) -> _Served:
    from pydantic import ValidationError

    try:
        parsed = SERVED[name].model_validate(kwargs)
    except ValidationError as e:
        detail = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
        raise InputError(f"{where}.kwargs: {detail}") from None
    if isinstance(parsed, JudgeKwargs) and parsed.score_pattern is not None:
        try:
            if re.compile(parsed.score_pattern).groups < 1:
                raise InputError(f"{where}.kwargs.score_pattern needs a group: the score")
        except re.error as e:
            raise InputError(f"{where}.kwargs.score_pattern: {e}") from None
    return parsed


def _urls(kwargs: _Served, where: str) -> list[str]:
    """The servers, from the recipe or from launch (their roots: a judge's API is under
    ``/v1``)."""
    if kwargs.url is not None:
        return [kwargs.url.rstrip("/")]
    roots = [u.strip().rstrip("/") for u in os.environ.get(REWARD_URLS_ENV, "").split(",")]
    roots = [u for u in roots if u]
    if not roots:
        raise ServerDown(
            f"{where}.kwargs.url is not set and ${REWARD_URLS_ENV} is empty: name the server, "
            "or let megatron-gspo launch start reward servers (REWARD_NODES)"
        )
    return [f"{u}/v1" for u in roots] if isinstance(kwargs, JudgeKwargs) else roots


def check_served(name: str, kwargs: dict, where: str) -> None:
    """At start-up: the kwargs, and every server answering ``GET /models`` (an OpenAI-compatible
    server's list); raises :class:`InputError` naming the server otherwise."""
    import httpx

    parsed = _kwargs(name, kwargs, where)
    headers = _headers(parsed)
    for url in _urls(parsed, where):
        # The judge's url is an OpenAI base (.../v1); the reward model's a vLLM server's root.
        probe = f"{url}/models" if name == "judge" else f"{url}/health"
        try:
            reply = httpx.get(probe, headers=headers, timeout=10)
        except httpx.HTTPError as e:
            raise ServerDown(
                f"{where} ({name}): the server at {url} does not answer: {e}"
            ) from None
        if reply.status_code >= 400:
            raise ServerDown(
                f"{where} ({name}): the server at {url} answered HTTP {reply.status_code} "
                f"to {probe}"
            )


class ServerDown(InputError):
    """A reward server the recipe names does not answer here (validate: exit 3)."""


def _headers(kwargs: _Served) -> dict[str, str]:
    key = os.environ.get(kwargs.api_key_env or JOB_KEY_ENV, "")
    return {"Authorization": f"Bearer {key}"} if key else {}


@dataclass(frozen=True)
class Item:
    prompt: str
    response: str
    answer: str


class ServedReward:
    """One served reward function of the recipe: scores a step's samples at once."""

    def __init__(self, name: str, kwargs: dict, *, timeout_s: float, where: str) -> None:
        self.name, self.kwargs = name, _kwargs(name, kwargs, where)
        self.timeout_s = timeout_s
        self.urls = _urls(self.kwargs, where)
        self.in_flight_max = 0

    def score(self, items: list[Item]) -> list[Outcome]:
        if not items:
            return []
        return asyncio.run(self._score_all(items))

    async def _score_all(self, items: list[Item]) -> list[Outcome]:
        import httpx

        gate = asyncio.Semaphore(self.kwargs.max_concurrency)
        limits = httpx.Limits(max_connections=self.kwargs.max_concurrency)
        self._in_flight = self.in_flight_max = 0
        async with httpx.AsyncClient(headers=_headers(self.kwargs), limits=limits) as http:
            return list(
                await asyncio.gather(
                    *[
                        self._one(http, gate, self.urls[i % len(self.urls)], it)
                        for i, it in enumerate(items)
                    ]  # fmt: skip
                )
            )

    async def _one(self, http, gate, url: str, item: Item) -> Outcome:
        async with gate:
            self._in_flight += 1
            self.in_flight_max = max(self.in_flight_max, self._in_flight)
            try:
                value = await within(self._request(http, url, item), self.timeout_s)
                return Outcome("ok", value)
            except TimeoutError:
                return Outcome("timeout", message=f"no answer from {url} in {self.timeout_s:g} s")
            except Exception as e:  # noqa: BLE001 - a failed request fails its sample
                return Outcome("error", message=f"{url}: {type(e).__name__}: {e}"[:500])
            finally:
                self._in_flight -= 1

    async def _request(self, http, url: str, item: Item) -> float:
        import httpx

        path, body = self._body(item)
        for attempt in range(RETRIES + 1):
            if attempt:
                await asyncio.sleep(BACKOFF_S * 2 ** (attempt - 1))
            try:
                # The deadline is _one's, which a stop of the trainer does not spend; httpx's
                # own would expire on resume over an answer already in the socket.
                reply = await http.post(url + path, json=body, timeout=None)
            except httpx.TransportError:
                if attempt == RETRIES:
                    raise
                continue
            if reply.status_code >= 500 and attempt < RETRIES:
                continue
            reply.raise_for_status()
            return self._value(reply.json())
        raise AssertionError("unreachable")

    def _text(self, item: Item, template: str) -> str:
        return template.format(prompt=item.prompt, response=item.response, answer=item.answer)

    def _body(self, item: Item) -> tuple[str, dict[str, Any]]:
        k = self.kwargs
        if isinstance(k, JudgeKwargs):
            messages = [{"role": "system", "content": k.system}] if k.system else []
            messages.append({"role": "user", "content": self._text(item, k.template)})
            body = {"messages": messages, "max_tokens": k.max_tokens, "temperature": k.temperature}
            return "/chat/completions", {**body, **({"model": k.model} if k.model else {})}
        body: dict[str, Any] = {"use_activation": False}
        if k.model:
            body["model"] = k.model
        if k.template is not None:
            body["input"] = [self._text(item, k.template)]
        else:
            body["messages"] = [
                {"role": "user", "content": item.prompt},
                {"role": "assistant", "content": item.response},
            ]
        return f"/{k.route}", body

    def _value(self, answer: dict) -> float:
        if isinstance(self.kwargs, JudgeKwargs):
            text = answer["choices"][0]["message"]["content"] or ""
            return reward_value(parse_score(text, self.kwargs.score_pattern))
        if self.kwargs.route == "classify":
            return reward_value(float(answer["data"][0]["probs"][0]))
        out = answer["data"][0]["data"]
        if out and isinstance(out[-1], list):
            out = out[-1]  # per token: the last token's
        if len(out) != 1:
            raise ValueError(f"/pooling gave {len(out)} values, a scalar reward model gives one")
        return reward_value(float(out[0]))


_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
# The label in any case, markdown emphasis around it and its colon ("**Score:** 0.8",
# "score = 1"), then a number, or a fraction of a scale ("7/10").
_SCORE = re.compile(
    rf"\bscore[*_ \t]*[:=][*_ \t]*({_NUMBER}(?:[ \t]*/[ \t]*{_NUMBER})?)", re.IGNORECASE
)
_VALUE = re.compile(rf"({_NUMBER})(?:\s*/\s*({_NUMBER}))?")


def parse_score(text: str, pattern: str | None = None) -> float:
    """The last score a judge's reply gives: ``Score: 0.5.`` is 0.5, ``Score: 1e-3`` 0.001,
    ``Score: 7/10`` 0.7 (a fraction of its scale), ``**Score:** 0.8`` 0.8, ``score: 1`` 1.
    ``pattern`` replaces the label's: its first group (the last match's) is the score, read the
    same way. ValueError for a reply that gives none."""
    if pattern is None:
        found = _SCORE.findall(text)
    else:
        found = [m if isinstance(m, str) else m[0] for m in re.findall(pattern, text)]
    for raw in reversed(found):
        # A pattern of the recipe's may catch trailing punctuation: read the number it starts.
        value = _VALUE.match(raw.strip().strip("*_"))
        if value is None:
            continue
        number = float(value.group(1))
        if value.group(2) is None:
            return number
        scale = float(value.group(2))
        if scale == 0:
            raise ValueError(f"the judge's score {raw!r} is a fraction of 0")
        return number / scale
    raise ValueError(f"no score in the judge's reply: {text[-200:]!r}")
