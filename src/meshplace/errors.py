"""Errors the user can fix.

Every exception that derives from :class:`InputError` is turned by the command line into
one sentence on stderr and exit code 2, never a traceback. Library callers catch it like
any ``ValueError``.
"""

from __future__ import annotations


class InputError(ValueError):
    """Bad input: a malformed file, an unknown name, a model that cannot be captured.

    The message is one sentence that names the offending file, field, op or value and,
    where there is a fixed set, the allowed values.
    """
