"""argparse types shared by every ``meshplace`` command: each turns a bad value into
argparse's one-sentence usage error (``meshplace`` prints it as ``meshplace: error: ...``,
exit 2) before any work starts.

>>> positive_int("3"), non_negative_int("0"), seed("7"), positive_seconds("1.5")
(3, 0, 7, 1.5)
>>> positive_seconds("inf")
Traceback (most recent call last):
...
argparse.ArgumentTypeError: seconds must be finite and positive, got 'inf'
"""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _int_at_least(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    return _int_at_least(text, 0, "an integer >= 0")


def _int_at_least(text: str, low: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def seed(text: str) -> int:
    """A random seed: an integer in [0, 2**32), what numpy and torch accept."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer seed, got {text!r}") from None
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"a seed is between 0 and 2**32 - 1, got {text!r}")
    return value


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0."""
    return _seconds(text, zero_ok=False)


def non_negative_seconds(text: str) -> float:
    """A finite number of seconds >= 0."""
    return _seconds(text, zero_ok=True)


def _seconds(text: str, *, zero_ok: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        allowed = "finite and non-negative" if zero_ok else "finite and positive"
        raise argparse.ArgumentTypeError(f"seconds must be {allowed}, got {text!r}")
    return value
