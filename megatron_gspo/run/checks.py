"""What ``train`` would refuse before its first step, checked alike by ``validate``.

The schema (:mod:`megatron_gspo.config`) checks each section and the rules between sections;
these checks need more than the recipe's text: the reward functions it names (importable,
taking the recipe's kwargs), the tokenizer, the run directory, and the checkpoint a run would
start from (written for the recipe's model). Each check takes the recipe and the run directory
and returns its problems, one line each naming the key, file or value. ``CHECKS`` lists them;
user code of a new kind that a recipe names (an environment, a tool) adds its check there.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from megatron_gspo.config import Recipe
from megatron_gspo.weights.model_check import model_mismatch, recorded_model


@dataclass(frozen=True)
class Problem:
    message: str
    # The recipe is fine, but this machine lacks what it names (a module, a file): validate
    # exits 3 rather than 1 for these.
    here_only: bool = False


def check_data(recipe: Recipe, run_dir: Path) -> list[Problem]:
    if recipe.data is None:
        return [Problem("the recipe has no data section (data.task or data.path)")]
    out = []
    if recipe.rollout.max_new_tokens >= recipe.model.max_seq_length:
        out.append(
            Problem(
                f"rollout.max_new_tokens ({recipe.rollout.max_new_tokens}) leaves no room for a "
                f"prompt within model.max_seq_length ({recipe.model.max_seq_length})"
            )
        )
    try:
        tokenizer = _tokenizer(recipe)
    except (ValueError, OSError) as e:  # the message names the file
        return [*out, Problem(str(e))]
    if tokenizer is not None and tokenizer.vocab_size > recipe.model.vocab_size:
        out.append(
            Problem(
                f"the tokenizer has {tokenizer.vocab_size} ids but model.vocab_size is "
                f"{recipe.model.vocab_size}"
            )
        )
    return out


def _tokenizer(recipe: Recipe):
    """The recipe's tokenizer, None where it or the data file is missing here (reported
    first, as such, by ``validate`` and by ``train`` reading the data)."""
    data = recipe.data
    if data.task is not None:
        from megatron_gspo.data.tasks import SyntheticTask

        return SyntheticTask(data.task, **data.task_options).tokenizer
    if any(f is None or not Path(f).exists() for f in (data.path, data.tokenizer)):
        return None
    from megatron_gspo.data.tokenizer import load_tokenizer

    return load_tokenizer(data.tokenizer)


def check_rewards(recipe: Recipe, run_dir: Path) -> list[Problem]:
    """Every reward function resolves and accepts ``(response, answer, **kwargs)``."""
    from megatron_gspo.rewards.computer import check_reward_function
    from megatron_gspo.rewards.served import ServerDown

    out = []
    for i, f in enumerate(recipe.reward.functions):
        try:
            check_reward_function(f.name, dict(f.kwargs), where=f"reward.functions[{i}]")
        except ServerDown as e:  # the recipe is fine; its reward server is not up here
            out.append(Problem(str(e), here_only=True))
        except ValueError as e:
            out.append(Problem(str(e), here_only=_module_missing(f.name)))
    return out


def check_environment(recipe: Recipe, run_dir: Path) -> list[Problem]:
    """The environment of multi-turn episodes resolves and accepts its ``env_kwargs``."""
    from megatron_gspo.episodes.environment import check_environment as check

    multi = recipe.rollout.multi_turn
    if multi is None:
        return []
    try:
        check(multi.env, dict(multi.env_kwargs))
    except ValueError as e:
        return [Problem(str(e), here_only=_module_missing(multi.env))]
    return _python_tool_problems(recipe)


def python_tool(recipe: Recipe) -> tuple[str, str | None] | None:
    """Where the recipe's python tool runs, and why it cannot here (None: it can); None where
    the recipe has no python tool."""
    from megatron_gspo.toolbox.bwrap import sandbox_problem
    from megatron_gspo.toolbox.python_config import PythonToolConfig

    multi = recipe.rollout.multi_turn
    kwargs = dict(multi.env_kwargs) if multi is not None else {}
    if multi is None or multi.env != "tools" or "python" not in kwargs.get("tools", ["python"]):
        return None
    config = PythonToolConfig.model_validate(kwargs.get("python") or {})
    if config.backend == "http":
        return f"the python tool runs on the service at {config.url}", None
    if config.sandbox == "unsafe_local":
        return "the python tool runs model code on this machine WITHOUT a sandbox", None
    return "the python tool runs model code in a bubblewrap sandbox", sandbox_problem(config)


def _python_tool_problems(recipe: Recipe) -> list[Problem]:
    from pydantic import ValidationError

    try:
        found = python_tool(recipe)
    except ValidationError as e:
        errors = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or 'value'}: {err['msg']}" for err in e.errors()
        )
        return [Problem(f"rollout.multi_turn.env_kwargs.python: {errors}")]
    if found is None or found[1] is None:
        return []
    return [Problem(f"{found[0]}, which cannot run here: {found[1]}", here_only=True)]


def _module_missing(name: str) -> bool:
    """Whether ``package.module:attr`` names a module that is not installed here."""
    if ":" not in name:
        return False
    try:
        return importlib.util.find_spec(name.partition(":")[0]) is None
    except ImportError:
        return True


def check_output_dir(recipe: Recipe, run_dir: Path) -> list[Problem]:
    """The run directory is a directory, or can be created, and can be written."""
    path = run_dir.absolute()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "is" if existing == path else f"cannot be created: {existing} is"
        return [Problem(f"run directory {run_dir} {what} a file, not a directory")]
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "" if existing == path else f" ({existing}, where it would be created)"
        return [Problem(f"run directory {run_dir}{what} is not writable", here_only=True)]
    return []


Check = Callable[[Recipe, Path], list[Problem]]
CHECKS: list[Check] = [check_data, check_rewards, check_environment, check_output_dir]


def find_problems(recipe: Recipe, run_dir: str | Path) -> list[Problem]:
    return [p for check in CHECKS for p in check(recipe, Path(run_dir))]


def refuse_problems(recipe: Recipe, run_dir: str | Path) -> None:
    """Raise naming every problem ``train`` would otherwise meet before its first step."""
    from megatron_gspo.run.recipe import RecipeError

    problems = find_problems(recipe, run_dir)
    if problems:
        raise RecipeError("; ".join(p.message for p in problems))


def _start_checkpoint(recipe: Recipe, run_dir: Path) -> tuple[Path, bool] | None:
    """The checkpoint a run in ``run_dir`` would load first (resuming, else
    ``run.init_from``), and whether its vocabulary rows may differ."""
    ckpts = run_dir / "checkpoints"
    latest = ckpts / "latest"
    if latest.is_file():
        text = latest.read_text(errors="replace").strip()
        if text.isdigit() and (ckpts / f"iter_{int(text):07d}").is_dir():
            return ckpts / f"iter_{int(text):07d}", True
    saved = sorted(p for p in ckpts.glob("iter_*") if p.is_dir()) if ckpts.is_dir() else []
    if saved:
        return saved[-1], True
    init = recipe.run.init_from
    if init and (Path(init) / "metadata.json").is_file():
        return Path(init), True
    return None


def checkpoint_problem(recipe: Recipe, run_dir: str | Path) -> Problem | None:
    """A checkpoint that a run would start from, written for another model (``validate``;
    ``train`` compares at load time with the same :func:`model_mismatch`)."""
    found = _start_checkpoint(recipe, Path(run_dir))
    if found is None:
        return None
    directory, any_vocab_rows = found
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_gspo.weights.dist_ckpt import checkpoint_layout

    expected = {
        e.item.key: tuple(e.item.global_shape)
        for e in checkpoint_layout(recipe.model)
        if isinstance(e.item, ShardedTensor)
    }
    try:
        why = model_mismatch(
            directory,
            expected,
            recipe.model,
            recorded=recorded_model(directory),
            any_vocab_rows=any_vocab_rows,
        )
    except Exception as e:  # noqa: BLE001 - unreadable metadata: say so, as train would fail
        return Problem(f"checkpoint {directory}: cannot read its metadata ({e})")
    return Problem(why) if why else None
