"""The errors a user can act on are one type, :class:`UserError`: the command line reports
them as one line, no traceback, whichever layer raised them; every other exception is a bug and
keeps its traceback. ``MEGATRON_GSPO_DEBUG=1`` adds the traceback to user errors too.
"""

from __future__ import annotations

import os


def debug_enabled() -> bool:
    """``MEGATRON_GSPO_DEBUG`` set to anything but empty or 0: tracebacks and Megatron's
    import-time warnings are shown."""
    return os.environ.get("MEGATRON_GSPO_DEBUG", "") not in ("", "0")


class UserError(Exception):
    """Something the user can act on: a recipe key, a file, a server, a figure a run stopped
    on. The command line prints the message in one line, without a traceback; every other
    exception is a bug of the project's and keeps its traceback."""


class InputError(UserError, ValueError):
    """A value the user gave (a recipe key, a file's content, an argument) that cannot be used;
    the message names it and what was expected."""


def one_line(error: BaseException) -> str:
    """The error's message, first line first; the rest (context lines) kept below it."""
    if isinstance(error, OSError) and error.strerror and error.filename is not None:
        return f"{error.filename}: {error.strerror}"
    return str(error).strip() or type(error).__name__
