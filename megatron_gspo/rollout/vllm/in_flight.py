"""Trainer side: generation that survives weight updates in flight (``rollout.in_flight_updates``).

vLLM's token-in/token-out route ``POST /inference/v1/generate`` (servers started with
``--enable-scale-out``, as ``launch`` starts them) reports, for every choice, which weights
version produced which of its tokens (``weight_versions``: spans of output positions, labelled
with what ``/finish_weight_update`` named). Each token of a :class:`Completion` gets that
version (``token_versions``), so a response begun on one version and finished on the next
says so token by token, with each token's log-prob as the weights and cache that produced it
computed it.

How a sync treats the requests in flight is the sync's choice (:mod:`.weight_sync`):

``keep``
    ``/pause?mode=keep&clear_cache=false`` freezes them; after ``/resume`` they go on over the
    KV cache the old weights computed. Nothing changes here but the labels. (With
    ``clear_cache=true``, vLLM 0.32's default, the pause preempts the frozen requests and they
    recompute their prefix on the new weights: resubmit's effect at keep's name.)
``resubmit``
    ``/pause?mode=abort`` ends them with ``finish_reason: abort`` and the tokens they had.
    Each aborted sample waits until the new weights are in (``wait_for_weights``, the
    engine's) and is sent again as prompt + its tokens so far, with the budget left and a
    seed of its own (:func:`~megatron_gspo.runtime.seeds.resubmit_seed`): the new weights
    read the prefix afresh. The parts are joined into one completion.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import numpy as np

from megatron_gspo.rollout.protocol import Completion, SamplingParams
from megatron_gspo.rollout.vllm.errors import VLLMRequestError
from megatron_gspo.rollout.vllm.versions import parse_version
from megatron_gspo.runtime.seeds import resubmit_seed

__all__ = ["complete_versioned", "generate_body", "parse_choice", "sampling_fields"]

ROUTE = "/inference/v1/generate"


def sampling_fields(params: SamplingParams, seed: int) -> dict[str, Any]:
    """vLLM's sampling fields for ``params``, the same on both routes (``/v1/completions``
    and this one), so that a request samples alike whichever it takes."""
    return {
        "n": params.group_size,
        "max_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "seed": seed,
        "stop_token_ids": list(params.stop_token_ids),
        "min_tokens": params.min_new_tokens,
        "ignore_eos": True,
        "logprobs": 0,
    }


def generate_body(
    prompt: list[int],
    params: SamplingParams,
    seed: int,
    model: str | None,
    version: int | None = None,
) -> dict[str, Any]:
    """The request for ``group_size`` samples of ``prompt``, as ``/v1/completions`` would
    sample them (stop ids explicit, end-of-sequence ignored, the sampled tokens' log-probs).

    ``version``, the weights last synced, salts the prefix cache: a keep update leaves the old
    weights' blocks cached, and a later request (an episode's next turn, the next batch's
    prompts) would otherwise read its prefix from them; only the frozen requests keep their
    own old cache."""
    body: dict[str, Any] = {
        "token_ids": list(prompt),
        "sampling_params": sampling_fields(params, seed),
    }
    if version is not None:
        body["cache_salt"] = f"weights-{version}"
    if model is not None:
        body["model"] = model
    return body


def parse_choice(url: str, choice: dict[str, Any]) -> Completion:
    """One choice of the route's answer, its tokens labelled with their versions;
    ``finish_reason`` may be ``abort`` (the caller resubmits or fails); a malformed answer
    raises :class:`VLLMRequestError`."""
    ids = choice.get("token_ids")
    content = (choice.get("logprobs") or {}).get("content")
    if ids is None or content is None or len(content) != len(ids):
        raise VLLMRequestError(f"vLLM server {url} returned no token_ids/logprobs from {ROUTE}")
    spans = choice.get("weight_versions")
    if not spans and ids:
        raise VLLMRequestError(
            f"vLLM server {url} did not say which weights produced its tokens "
            "(weight_versions): rollout.in_flight_updates needs vLLM >= 0.32"
        )
    versions = [-1] * len(ids)
    for span in spans or []:
        label = parse_version(span["version"])
        if isinstance(label, str):
            raise VLLMRequestError(
                f"vLLM server {url} generated tokens {span['start']}-{span['end']} while its "
                f"weights were {label!r} (a half-finished sync)"
            )
        versions[span["start"] : span["end"]] = [-1 if label is None else label] * (
            span["end"] - span["start"]
        )
    reason = choice.get("finish_reason")
    if reason not in ("stop", "length", "abort"):
        raise VLLMRequestError(f"vLLM server {url}: unexpected finish_reason {reason!r}")
    # None is what vLLM writes for a -inf log-prob.
    lps = [float("-inf") if e.get("logprob") is None else float(e["logprob"]) for e in content]
    return Completion(
        token_ids=[int(t) for t in ids],
        logprobs=lps,
        finish_reason=reason,
        token_versions=versions,
    )


def _join(first: Completion, rest: Completion) -> Completion:
    """A sample's tokens before an abort and after its resubmission, as one completion. Each
    token keeps its route from the forward that sampled it: the first part's rows, then the
    rows the resubmission added."""
    routes = first.routes
    if first.routes is not None and rest.routes is not None:
        routes = np.concatenate([first.routes, rest.routes[len(first.routes) :]])
    return Completion(
        token_ids=first.token_ids + rest.token_ids,
        logprobs=first.logprobs + rest.logprobs,
        finish_reason=rest.finish_reason,
        token_versions=(first.token_versions or []) + (rest.token_versions or []),
        routes=routes,
    )


async def complete_versioned(
    client, http, url: str, prompt: list[int], params: SamplingParams, seed: int
) -> list[Completion]:
    """``group_size`` samples of one prompt with per-token versions; aborted samples are
    resubmitted (``client.in_flight == "resubmit"``) or fail."""
    body = generate_body(prompt, params, seed, client.model, client.weights_version())
    answer = await client._post(http, url, ROUTE, body)
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    if len(choices) != params.group_size:
        raise VLLMRequestError(
            f"vLLM server {url} returned {len(choices)} choices, asked for {params.group_size}"
        )
    out = []
    for j, choice in enumerate(choices):
        c = _with_routes(client, url, choice, params)
        part = 0
        while c.finish_reason == "abort":
            if client.in_flight != "resubmit":
                raise VLLMRequestError(
                    f"vLLM server {url} aborted a request in flight (a weight sync that failed, "
                    "or a server shut down)"
                )
            left = params.max_new_tokens - len(c.token_ids)
            if left <= 0:  # aborted on its last token: it ended by length anyway
                c.finish_reason = "length"
                break
            part += 1
            await asyncio.to_thread(client.wait_for_weights)
            rest = replace(
                params,
                group_size=1,
                max_new_tokens=left,
                min_new_tokens=max(0, params.min_new_tokens - len(c.token_ids)),
            )
            again = generate_body(
                prompt + c.token_ids,
                rest,
                resubmit_seed(seed, j, part),
                client.model,
                client.weights_version(),
            )
            more = await client._post(http, url, ROUTE, again)
            c = _join(c, _with_routes(client, url, more["choices"][0], rest))
        out.append(c)
    return out


def _with_routes(client, url: str, choice: dict[str, Any], params: SamplingParams) -> Completion:
    c = parse_choice(url, choice)
    if params.return_routes:
        c.routes = client._routes(url, choice)
    return c
