"""Reading a recipe file: YAML, ``model.from_hf``, then the schema of
:mod:`megatron_gspo.config`, with errors that name the file and the key.

``model: {from_hf: DIR, ...}`` takes the model's shape from ``DIR/config.json``; the other keys
of the section override it.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

from megatron_gspo.config import Recipe
from megatron_gspo.model.hf_config import HFConfigError, model_config_from_hf
from megatron_gspo.runtime.errors import InputError

__all__ = ["RecipeError", "load_recipe", "missing_inputs"]


class RecipeError(InputError):
    """A recipe file that cannot be used; the message names the file and the key."""


def _format_validation_error(path: Path, err: ValidationError) -> str:
    lines = [f"{path}: invalid recipe"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key")
        else:
            lines.append(f"  {key}: {e['msg']}")
    return "\n".join(lines)


def load_recipe(path: str | Path) -> Recipe:
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"{path}: recipe file not found")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise RecipeError(
            f"{path}: not a text file (byte {e.start} is not UTF-8); a recipe is YAML"
        ) from None
    except OSError as e:
        raise RecipeError(f"{path}: cannot be read: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: expected a mapping of sections at the top level")
    data = _model_from_hf(path, data)
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(_format_validation_error(path, e)) from None


def _model_from_hf(path: Path, data: dict) -> dict:
    if not isinstance(data.get("model"), dict) or "from_hf" not in data["model"]:
        return data
    model = dict(data["model"])
    source = model.pop("from_hf")
    try:
        shape = model_config_from_hf(source).model_dump()
    except (HFConfigError, OSError, ValueError) as e:
        raise RecipeError(f"{path}: model.from_hf: {e}") from None
    return {**data, "model": {**shape, **model}}


def missing_inputs(recipe: Recipe) -> list[str]:
    """The recipe's input files and directories that do not exist (relative to the cwd)."""
    wanted = []
    if recipe.data is not None:
        if recipe.data.path:
            wanted.append(("data.path", recipe.data.path, "file"))
        if recipe.data.tokenizer:
            wanted.append(("data.tokenizer", recipe.data.tokenizer, "any"))
    if recipe.run.init_from:
        wanted.append(("run.init_from", recipe.run.init_from, "dir"))
    problems = []
    for key, value, kind in wanted:
        path = Path(value)
        ok = path.is_file() if kind == "file" else path.is_dir() if kind == "dir" else path.exists()
        if not ok:
            what = {"file": "file", "dir": "directory", "any": "path"}[kind]
            problems.append(f"{key}: {what} {value} not found")
    return problems
