"""recall_key, the task where an early turn decides what a later one can earn: the environment's
rules turn by turn, its data, and what sequence-level and turn-level credit make of it."""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.data.tasks import SyntheticTask
from megatron_gspo.episodes.environment import resolve_environment
from megatron_gspo.episodes.task_envs import RecallKey, asked_key, named_key
from megatron_gspo.loss.advantages import group_advantages, returns_to_go, turn_advantages
from megatron_gspo.runtime.errors import InputError


def _play(answer: str, actions: list[str]) -> tuple[list[str], list[float], bool]:
    env = RecallKey()
    state = env.reset(answer.split("|")[0] + "=", answer)
    observations, rewards, done = [], [], False
    for action in actions:
        step = env.step(state, action)
        observations.append(step.observation)
        rewards.append(step.reward)
        state, done = step.state, step.done
    return observations, rewards, done


def test_the_first_turn_decides_what_the_last_can_earn():
    # Cue 7 asks for key 1 ("905"); an odd first digit names key 1, an even one key 0.
    assert asked_key("7") == 1 and asked_key("4") == 0 and asked_key("5") == 1
    assert named_key("3") == 1 and named_key("80") == 0 and named_key("=") is None
    obs, rewards, done = _play("7|42|905", ["1", "905", "905"])
    assert obs == ["905=", "=", ""] and rewards == [0.0, 1.0, 1.0] and done
    # The wrong key: its value is shown and copied (turn 2 earns it), turn 3 cannot know 905.
    obs, rewards, done = _play("7|42|905", ["2", "42", "42"])
    assert obs == ["42=", "=", ""] and rewards == [0.0, 1.0, 0.0] and done
    # The right value in turn 3 is earned whatever turn 1 named (a guess that hits).
    assert _play("7|42|905", ["2", "42", "905"])[1] == [0.0, 1.0, 1.0]
    # No digit names no key: nothing is shown.
    obs, rewards, _ = _play("3|42|905", ["=", "", "42"])
    assert obs[0] == "=" and rewards == [0.0, 0.0, 1.0]
    assert resolve_environment("recall_key") is RecallKey
    with pytest.raises(ValueError, match="cue\\|value0\\|value1"):
        RecallKey().reset("7=", "7|42")


def test_its_data_is_a_pure_function_of_seed_and_index_over_both_keys():
    task = SyntheticTask("recall_key", min_len=1, max_len=3)
    assert task.turns == 3
    examples = [task.example(i, seed=0) for i in range(200)]
    assert examples == [task.example(i, seed=0) for i in range(200)]
    assert examples != [task.example(i, seed=1) for i in range(200)]
    for e in examples:
        cue, v0, v1 = e["answer"].split("|")
        assert e["prompt"] == f"{cue}=" and len(cue) == 1
        assert all(v.isdigit() and 1 <= len(v) <= 3 for v in (v0, v1))
    asked = [asked_key(e["answer"][0]) for e in examples]
    assert 0.3 < sum(asked) / len(asked) < 0.7  # both keys asked about
    assert set(task.tokenizer.encode("7=905")) <= set(range(task.tokenizer.vocab_size))
    with pytest.raises(InputError, match="always has 3 turns"):
        SyntheticTask("recall_key", turns=2)


def test_turn_credit_tells_the_turns_apart_where_sequence_credit_cannot():
    """Two episodes of one prompt with the same total: A named the right key but miscopied in
    turn 2, B named the wrong key and copied well. Sequence-level credit sees equal outcomes
    and gives both nothing; turn-level credit praises A's last turn (it earned its reward) and
    blames B's, and leaves turn 1 (same return-to-go) alone."""
    a = _play("7|42|905", ["1", "0", "905"])[1]
    b = _play("7|42|905", ["2", "42", "42"])[1]
    assert a == [0.0, 0.0, 1.0] and b == [0.0, 1.0, 0.0]
    sequence = group_advantages(torch.tensor([sum(a), sum(b)]), 2)
    assert sequence.tolist() == [0.0, 0.0]
    turns = turn_advantages([returns_to_go(a, 0.0), returns_to_go(b, 0.0)], 2)
    assert turns[0][0] == turns[1][0] == 0.0 and turns[0][1] == turns[1][1] == 0.0
    assert turns[0][2] > 0 > turns[1][2]
    # And where turn 1 made the difference, turn credit gives turn 1 its due.
    c = _play("7|42|905", ["1", "905", "905"])[1]
    d = _play("7|42|905", ["2", "42", "42"])[1]
    turns = turn_advantages([returns_to_go(c, 0.0), returns_to_go(d, 0.0)], 2)
    assert turns[0][0] > 0 > turns[1][0]


def test_its_recipe_builds_and_names_the_task_and_environment():
    from megatron_gspo.run.recipe import load_recipe
    from tests.support.runs import ROOT

    recipe = load_recipe(ROOT / "recipes" / "tiny-recall-key.yaml")
    assert recipe.data.task == "recall_key" and recipe.rollout.multi_turn.env == "recall_key"
    assert recipe.rollout.multi_turn.max_turns == 3 and recipe.loss.advantage_level == "turn"
