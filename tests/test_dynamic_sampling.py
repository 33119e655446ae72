"""DAPO dynamic sampling: groups without a signal are replaced by fresh ones, the loss counts
what is trained, and a resumed run continues exactly."""

from __future__ import annotations

import pytest

from megatron_gspo.episodes.dynamic_sampling import fill_with_signal, groups_without_signal
from megatron_gspo.trainer.packing import Sample
from tests.support.runs import comparable, loop_recipe, straight_and_resumed


def _groups(advantages: list[list[float]], tag: int) -> list[Sample]:
    return [
        Sample(prompt_ids=[tag, p], response_ids=[i], advantage=a, prompt_index=p)
        for p, group in enumerate(advantages)
        for i, a in enumerate(group)
    ]


def test_fill_keeps_groups_with_signal_until_the_batch_is_full():
    first = _groups([[0, 0], [1, -1], [0, 0], [0.5, -0.5]], tag=0)  # 2 of 4 with a signal
    calls = []

    def more(round_: int) -> list[Sample]:
        calls.append(round_)
        return _groups([[0, 0], [2, -2], [3, -3], [0, 0]], tag=round_)

    samples, m = fill_with_signal(first, more, want=3, max_rounds=5)
    assert calls == [1]
    assert [s.prompt_ids[0] for s in samples[::2]] == [0, 0, 1]  # two from the first batch
    assert [s.prompt_index for s in samples] == [0, 0, 1, 1, 2, 2]
    assert m == {"filtered_groups_fraction": 0.5, "dynamic_sampling_rounds": 2.0}
    assert groups_without_signal(samples) == 0.0


def test_fill_stops_after_max_rounds_with_what_it_has():
    nothing = _groups([[0, 0], [0, 0]], tag=0)
    samples, m = fill_with_signal(nothing, lambda r: nothing, want=2, max_rounds=3)
    assert samples == [] and m["dynamic_sampling_rounds"] == 3.0
    assert m["filtered_groups_fraction"] == 1.0


@pytest.mark.slow
def test_dynamic_sampling_trains_only_on_signal_and_resumes_exactly(tmp_path):
    common = {
        "run": {"plot_every": 0, "tensorboard": False, "checkpoint_every": 2},
        "rollout": {"dynamic_sampling": {"max_rounds": 4}},
    }
    straight = loop_recipe(tmp_path / "straight", **common)
    split = loop_recipe(tmp_path / "split", **common)
    a, b = straight_and_resumed(straight, split)
    assert [comparable(r) for r in a] == [comparable(r) for r in b]
    assert any(r["filtered_groups_fraction"] > 0 for r in a), "nothing was ever filtered"
    for r in a:
        if r["dynamic_sampling_rounds"] < 4:  # filled: every trained group has a signal
            assert r["train_groups_without_signal"] == 0.0, r
