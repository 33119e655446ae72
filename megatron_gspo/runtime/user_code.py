"""User code named in a recipe: a built-in by its name, or ``package.module:attr``.

Rewards, environments and tools are all chosen this way; a name that cannot be resolved, or
keyword arguments the function does not take, are refused at start-up with the recipe key,
before any compute is spent (and by ``megatron-gspo validate``).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping

from megatron_gspo.runtime.errors import InputError

__all__ = ["check_kwargs", "resolve"]


def resolve(name: str, builtins: Mapping[str, Callable | str], *, key: str, what: str) -> Callable:
    """The built-in ``name`` (a callable, or the ``package.module:attr`` of one, imported
    when asked for), or the callable ``package.module:attr`` names."""
    if name in builtins:
        found = builtins[name]
        return found if callable(found) else resolve(found, {}, key=key, what=what)
    if ":" not in name:
        raise InputError(
            f"{key}: unknown {what} {name!r}; use one of {sorted(builtins)} or "
            "'package.module:attr'"
        )
    module, _, attr = name.partition(":")
    try:
        found = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise InputError(f"{key}: cannot import {name!r}: {e}") from None
    if not callable(found):
        raise InputError(f"{key}: {name!r} is not callable")
    return found


def check_kwargs(fn: Callable, name: str, kwargs: dict, *, key: str, args: tuple = ()) -> None:
    """Refuse ``kwargs`` that ``fn(*args, **kwargs)`` would not take (a misspelt keyword
    would otherwise fail every call)."""
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as e:
        raise InputError(f"{key}: {name} cannot take kwargs {sorted(kwargs)}: {e}") from None
    except ValueError:  # no signature to read (a builtin): its calls will tell
        pass
