"""Errors raised by :mod:`meshplace.hardware`.

All are :class:`~meshplace.errors.InputError` subclasses, so the command line turns each into
one sentence naming the file, the field and the allowed values, and exits with status 2.
"""

from __future__ import annotations

from meshplace.errors import InputError


class ClusterError(InputError):
    """A cluster description is wrong: a bad link, a duplicate name, a disconnected network."""


class UnknownDeviceError(ClusterError):
    """A device kind or a device name that the catalogue or the cluster does not know."""


class UnknownPresetError(ClusterError):
    """A cluster name that is neither a built-in preset nor a readable YAML file."""


def allowed(values: object, limit: int = 12) -> str:
    """``'a', 'b', 'c'`` — a short, comma-separated list for an error message (at most
    ``limit`` items, then a count of the rest)."""
    items = [str(v) for v in values]  # type: ignore[attr-defined]
    if len(items) <= limit:
        return ", ".join(items)
    return ", ".join(items[:limit]) + f" and {len(items) - limit} more"
