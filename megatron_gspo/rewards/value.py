"""A reward's value: what every reward, local or served, must come to before it is summed."""

from __future__ import annotations

import math
import numbers

__all__ = ["FLOAT32_MAX", "reward_value"]


# float32 is what advantages are computed in; a larger reward would overflow there.
FLOAT32_MAX = 3.4028234663852886e38


def reward_value(value: object) -> float:
    """A reward function's result as a float; ValueError for anything but a finite real number
    (a string or a bool is not a score, however it converts)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"returned {value!r} ({type(value).__name__}), not a number")
    value = float(value)
    if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
        raise ValueError(f"returned {value}, not a finite float32 number")
    return value
