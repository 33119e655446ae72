"""Tool-using episodes through vLLM: lock-step turns against concurrent episodes.

One CPU vLLM server (this project's extension and key) serves a tiny Qwen3-MoE (turns of
``--new-tokens`` tokens, ended by a stop id, never cut at the limit). 64 episodes,
each of 1 to 5 tool turns (drawn per episode with a fixed seed), call a tool whose latency is
drawn per call from a lognormal (median 100 ms, sigma 1, fixed seed: real tools have long
tails). Both ways use the same server, environment workers, draws and sampling seeds:

- lock-step (:class:`~megatron_gspo.episodes.runner.EpisodeRunner`): turn k of every live
  episode is sampled in one batch, then all their tool calls run in parallel, and only then
  turn k + 1: each turn waits for its slowest call;
- concurrent (:class:`~megatron_gspo.episodes.concurrent.ConcurrentRunner`): each episode
  requests its next turn as soon as its own tool call returns.

Each way runs ``--repeats`` times, alternating; the figure is the median episodes/s. The last
line: ``multi_turn: lockstep <X> episodes/s, concurrent <Y> episodes/s, ratio <Y/X>``.

    python benchmarks/multi_turn.py [--episodes 64] [--repeats 3] [--workers 64]

Needs vllm (``.ci/vllm-setup.sh``).
"""

from __future__ import annotations

import argparse
import atexit
import math
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@dataclass
class _Calls:
    turns: int
    seed: int
    done: int = 0


def latency(seed: int, call: int, median_s: float = 0.1, sigma: float = 1.0) -> float:
    """The tool latency of an episode's ``call``-th call (the same draw in both runs)."""
    return random.Random(f"{seed}:{call}").lognormvariate(math.log(median_s), sigma)


def ideal_seconds(records: list[str], median_s: float) -> tuple[float, float]:
    """The two ways' times with generation taking no time at all (``records``: the episodes'
    ``"calls:seed"``): lock-step waits, at each turn, for the slowest call of the turn;
    concurrent episodes for the slowest episode."""
    pairs = [tuple(int(x) for x in r.split(":")) for r in records]
    draws = [[latency(seed, j, median_s) for j in range(n)] for n, seed in pairs]
    lockstep = sum(
        max(d[j] for d in draws if len(d) > j) for j in range(max(len(d) for d in draws))
    )
    return lockstep, max(sum(d) for d in draws)


class LatencyTool:
    """An environment whose every turn is a tool call taking a lognormal time; the episode's
    number of tool turns and its seed come with its record (``answer: "turns:seed"``)."""

    def __init__(self, median_s: float = 0.1) -> None:
        self.median_s = median_s

    def reset(self, prompt: str, answer: str) -> _Calls:
        turns, seed = answer.split(":")
        return _Calls(int(turns), int(seed))

    def step(self, state: _Calls, action: str):
        from megatron_gspo.episodes.environment import Step

        if state.done == state.turns:
            return Step(done=True)
        seconds = latency(state.seed, state.done, self.median_s)
        time.sleep(seconds)
        after = _Calls(state.turns, state.seed, state.done + 1)
        return Step("result", 0.0, False, after, {"tool_calls": 1.0, "tool_time_s": seconds})


def model_config():
    from megatron_gspo.config import ModelConfig

    return ModelConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=64,
        vocab_size=64,
        max_seq_length=256,
        num_experts=4,
        moe_ffn_hidden_size=64,
        moe_router_topk=2,
        rotary_base=10000,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--median-s", type=float, default=0.1, help="the tool's median latency")
    parser.add_argument("--seed", type=int, default=0, help="of the episodes' draws")
    args = parser.parse_args()

    from megatron_gspo.data.prompts import Prompt
    from megatron_gspo.episodes.concurrent import ConcurrentRunner
    from megatron_gspo.episodes.environment import EnvironmentPool
    from megatron_gspo.episodes.runner import EpisodeRunner, EpisodeSetup
    from megatron_gspo.rollout.protocol import SamplingParams
    from megatron_gspo.rollout.vllm.http_client import VLLMClient
    from megatron_gspo.rollout.vllm.single_node import (
        cpu_serving_args,
        served,
        write_served_model,
    )

    cfg = model_config()
    draws = random.Random(args.seed)
    prompts = [
        Prompt(
            "",
            f"{draws.randint(1, 5)}:{args.seed * 1000 + k}",
            [draws.randrange(2, 60) for _ in range(8)],
        )
        for k in range(args.episodes)
    ]
    # One more model turn than tool turns: the last answers without a call.
    max_turns = 6
    # Every id stops a turn once it has --new-tokens tokens: turns of equal length, none cut
    # at the limit, so every episode makes exactly its drawn number of tool calls.
    params = SamplingParams(
        group_size=1,
        max_new_tokens=args.new_tokens + 1,
        min_new_tokens=args.new_tokens,
        stop_token_ids=tuple(range(cfg.vocab_size)),
        seed=7,
    )
    work = Path(tempfile.mkdtemp(prefix="gspo-multi-turn-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    model_dir = write_served_model(work / "model", cfg)
    extra = cpu_serving_args(cfg.max_seq_length, max_num_seqs=args.episodes)
    envs = EnvironmentPool(
        "benchmarks.multi_turn:LatencyTool",
        {"median_s": args.median_s},
        timeout_s=60,
        workers=args.workers,
    )
    envs.start()
    with served(model_dir, extra) as (url, key):
        client = VLLMClient([url], api_key=key, request_timeout_s=300, max_concurrent_requests=512)
        setup = EpisodeSetup(
            multi_turn=True,
            max_turns=max_turns,
            max_seq_length=cfg.max_seq_length,
            envs=envs,
            render=lambda text: [5, 6, 7],
            decode=lambda ids: "",
        )
        lockstep = EpisodeRunner(client.generate, setup)
        concurrent = ConcurrentRunner(
            client, lambda: {url: None}, setup, max_inflight=args.episodes
        )
        concurrent.run(prompts[:4], params)  # warm the server
        rates: dict[str, list[float]] = {"lockstep": [], "concurrent": []}
        for repeat in range(args.repeats):
            for name, runner in (("lockstep", lockstep), ("concurrent", concurrent)):
                t0 = time.perf_counter()
                groups = runner.run(prompts, params)
                elapsed = time.perf_counter() - t0
                calls = sum(e.info.get("tool_calls", 0) for g in groups for e in g)
                rates[name].append(args.episodes / elapsed)
                most = runner.stats.get("episodes_in_flight_max", args.episodes)
                print(
                    f"repeat {repeat} {name:10s} {elapsed:6.2f} s  {args.episodes / elapsed:6.2f} "
                    f"episodes/s  {calls:.0f} tool calls  in flight max {most:.0f}",
                    flush=True,
                )
    envs.close()
    lock_s, conc_s = ideal_seconds([p.answer for p in prompts], args.median_s)
    print(
        f"these draws with generation taking no time: lockstep {lock_s:.2f} s, concurrent "
        f"{conc_s:.2f} s, ratio {lock_s / conc_s:.2f} (what the two ways could reach at best)"
    )
    x, y = statistics.median(rates["lockstep"]), statistics.median(rates["concurrent"])
    print(
        f"multi_turn: lockstep {x:.2f} episodes/s, concurrent {y:.2f} episodes/s, ratio {y / x:.2f}"
    )


if __name__ == "__main__":
    main()
