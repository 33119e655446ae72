"""Reward functions that misbehave as user code does, for the fault tests."""

from __future__ import annotations

import time


def nan_or_hang(response: str, answer: str) -> float:
    """NaN for responses with a 3, hangs forever for those with a 5, else digit equality."""
    if "3" in response:
        return float("nan")
    if "5" in response:
        time.sleep(3600)
    return float(response.strip() == answer.strip())
