"""Small helpers shared across meshplace."""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TextIO

from meshplace.errors import InputError


def check_output_path(path: str | Path, flag: str) -> Path:
    """Check, before any work starts, that ``path`` can be written as a file.

    ``flag`` names where the path came from (``"--out"``) so the sentence points at it.
    A folder, a device or other non-file, a missing parent folder or one that cannot be
    written is an :class:`InputError`; nothing is left behind (writability is probed by
    creating and removing a temp file, since permission bits say nothing for root or on a
    read-only mount). A full disk can only show at write time, where
    :func:`write_text_atomic` reports it.

    >>> check_output_path("/", "--out")
    Traceback (most recent call last):
    ...
    meshplace.errors.InputError: --out /: is a folder, not a file
    """
    p = Path(path)
    if str(path) == "":
        raise InputError(f"{flag} needs a file name, got an empty string")
    if p.is_dir():
        raise InputError(f"{flag} {p}: is a folder, not a file")
    folder = p.parent if str(p.parent) else Path(".")
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise InputError(f"{flag} {p}: cannot write there, folder {str(folder)!r} {what}")
    if p.exists() and not p.is_file():
        raise InputError(f"{flag} {p}: exists and is not a regular file")
    try:  # a real probe: permission bits say nothing for root or on a read-only mount
        fd, probe = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".probe", dir=folder)
    except OSError as exc:
        raise InputError(f"{flag} {p}: cannot write there ({exc.strerror})") from None
    os.close(fd)
    os.unlink(probe)
    return p


def check_output_paths(
    outputs: Mapping[str, str | Path | None], inputs: Iterable[str] = ()
) -> None:
    """Check every output of a command up front: each writable (:func:`check_output_path`),
    no two the same file, and none the same file as an input (which would destroy it).

    ``outputs`` maps the flag to its path (``None`` = not given); ``inputs`` are paths the
    command reads (names that are not files, such as presets, are ignored).

    >>> check_output_paths({"--out": "a.json", "--result": "a.json"})
    Traceback (most recent call last):
    ...
    meshplace.errors.InputError: --out and --result are the same file (a.json); give each its own
    """
    seen: dict[Path, str] = {}
    for flag, path in outputs.items():
        if path is None:
            continue
        p = check_output_path(path, flag)
        key = p.resolve()
        if key in seen:
            raise InputError(f"{seen[key]} and {flag} are the same file ({p}); give each its own")
        seen[key] = flag
    for source in inputs:
        if not source:
            continue
        # file.py:build reads file.py
        file_part = source.split(":", 1)[0] if ".py:" in source else source
        key = Path(file_part).resolve()
        if key in seen:
            raise InputError(
                f"{seen[key]} {source} is also an input of this command; writing it would "
                "destroy the input, choose another file"
            )


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file in the same folder and a rename, so an
    interrupted run never leaves a half-written file behind. Write errors (read-only
    folder, full disk, a folder in the way) are :class:`InputError` naming the path."""
    p = Path(path)
    folder = p.parent if str(p.parent) else Path(".")
    if not folder.is_dir():
        raise InputError(f"{p}: cannot write there, folder {str(folder)!r} does not exist")
    if p.is_dir():
        raise InputError(f"{p}: is a folder, not a file")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise InputError(f"{p}: cannot write there ({exc.strerror})") from None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        # mkstemp makes the file private (0600); give it the mode a plain open() would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, p)
    except OSError as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise InputError(f"{p}: could not be written ({exc.strerror})") from None
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def short_repr(value: Any) -> str:
    """``repr(value)`` cut to 60 characters (and safe for integers too long to print), for
    error sentences that quote what the user wrote.

    >>> short_repr("x" * 100)[-5:]
    'xx...'
    """
    try:
        text = repr(value)
    except ValueError:  # an int beyond sys.get_int_max_str_digits()
        return "an integer of thousands of digits"
    return text if len(text) <= 60 else text[:57] + "..."


def read_text_file(path: str | Path, what: str, error: type[InputError] = InputError) -> str:
    """The text of the ``what`` file (``"graph"``, ``"plan"``) at ``path``, every problem an
    ``error`` of one sentence naming the file: missing, a folder, unreadable, binary (a NUL
    byte) or not UTF-8. A UTF-8 byte-order mark is dropped.

    >>> read_text_file("/", "graph")
    Traceback (most recent call last):
    ...
    meshplace.errors.InputError: /: is a folder, not a graph file
    """
    p = Path(path)
    if p.is_dir():
        raise error(f"{p}: is a folder, not a {what} file")
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise error(f"{p}: no such {what} file") from None
    except OSError as exc:
        raise error(f"{p}: cannot read the {what} file ({exc.strerror or exc})") from None
    if b"\0" in raw:
        raise error(f"{p}: is a binary file (it holds NUL bytes), not a {what} file")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise error(
            f"{p}: is not a UTF-8 text file (byte {exc.start} is not UTF-8), so not a {what} file"
        ) from None


def parse_json(
    text: str, source: str, what: str = "graph", error: type[InputError] = InputError
) -> Any:
    """Parse JSON ``text`` (from ``source``, a file name) for a ``what`` file, strictly:
    a key twice in one object (``json`` would keep the last silently), nesting deeper than
    Python's recursion limit, and integers longer than Python's int-to-string digit limit
    (4,300) are each one ``error`` sentence, as is text that is not JSON.

    >>> parse_json('{"a": 1, "a": 2}', "p.json", "plan")
    Traceback (most recent call last):
    ...
    meshplace.errors.InputError: p.json: key 'a' appears twice in one JSON object; ...
    """

    def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj: dict[str, Any] = {}
        for key, value in pairs:
            if key in obj:
                raise error(
                    f"{source}: key {short_repr(key)} appears twice in one JSON object; each key "
                    "may appear once"
                )
            obj[key] = value
        return obj

    try:
        return json.loads(text, object_pairs_hook=unique_keys)
    except json.JSONDecodeError as exc:
        # exc.msg may end in "at" ("Unterminated string starting at"): put the place first
        raise error(
            f"{source}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
        ) from None
    except RecursionError:
        raise error(
            f"{source}: JSON nested too deeply to read (arrays or objects more than about "
            f"{_recursion_depth()} levels deep); a {what} file needs only a few"
        ) from None
    except ValueError as exc:  # json reads integers with int(), which limits their digits
        if "digits" not in str(exc):
            raise
        raise error(
            f"{source}: holds an integer with too many digits to read (more than "
            f"{_max_digits()}); no {what} field needs one"
        ) from None


def _recursion_depth() -> int:
    return sys.getrecursionlimit()


def _max_digits() -> str:
    limit = sys.get_int_max_str_digits()
    return f"{limit:,}" if limit else "the limit"


def read_json_file(path: str | Path, what: str, error: type[InputError] = InputError) -> Any:
    """:func:`read_text_file` then :func:`parse_json`: the parsed JSON of the ``what`` file
    at ``path``, every problem one ``error`` sentence naming the file."""
    return parse_json(read_text_file(path, what, error), str(path), what, error)


class JsonOutput:
    """Keep stdout for exactly one JSON document while a ``--json`` command runs.

    Solvers and libraries print to the process's stdout from C (HiGHS's banner) or from
    Python; while active, file descriptor 1 and ``sys.stdout`` both point at stderr, and
    :meth:`emit` writes the document to the real stdout. Used as a context manager by
    the command line; :func:`print_json` is the call every command makes.
    """

    active: JsonOutput | None = None

    def __init__(self) -> None:
        self._saved_fd = -1
        self._stream: TextIO = sys.stdout
        self.emitted = False

    def __enter__(self) -> JsonOutput:
        self._stream = sys.stdout
        try:  # the process's stdout, or a file object on the same file (pytest's capfd)
            fd = sys.stdout.fileno()
            is_process_stdout = fd == 1 or os.path.sameopenfile(fd, 1)
        except (AttributeError, OSError, ValueError):  # a StringIO, pytest's capsys
            is_process_stdout = False
        if is_process_stdout:
            sys.stdout.flush()
            self._saved_fd = os.dup(1)
            os.dup2(2, 1)  # C libraries' chatter (HiGHS's banner) goes to stderr
        sys.stdout = sys.stderr
        JsonOutput.active = self
        return self

    def __exit__(self, *exc: object) -> None:
        sys.stderr.flush()
        sys.stdout = self._stream
        if self._saved_fd >= 0:
            os.dup2(self._saved_fd, 1)
            os.close(self._saved_fd)
            self._saved_fd = -1
        JsonOutput.active = None

    def emit(self, obj: Any) -> None:
        """Write ``obj`` as the one JSON document on the real stdout."""
        if self.emitted:
            raise RuntimeError("a --json command printed two JSON documents")
        self.emitted = True
        text = dumps_strict_json(obj) + "\n"
        if self._saved_fd < 0:
            self._stream.write(text)
            self._stream.flush()
            return
        view = memoryview(text.encode())
        while view:
            view = view[os.write(self._saved_fd, view) :]


def print_json(obj: Any) -> None:
    """Print ``obj`` as the command's JSON document (on the real stdout under
    :class:`JsonOutput`, plain ``print`` otherwise)."""
    if JsonOutput.active is not None:
        JsonOutput.active.emit(obj)
    else:
        print(dumps_strict_json(obj))


def finite_or_none(obj: Any) -> Any:
    """``obj`` with every NaN or infinite float replaced by ``None``: strict JSON (``jq``,
    JavaScript) has no such numbers, and Python's ``json`` would write ``Infinity``.

    >>> finite_or_none({"a": [1.0, float("inf")], "b": float("nan")})
    {'a': [1.0, None], 'b': None}
    """
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite_or_none(v) for v in obj]
    return obj


def dumps_strict_json(obj: Any) -> str:
    """``obj`` as indented, strict JSON (no NaN/Infinity; other objects as strings)."""
    return json.dumps(finite_or_none(obj), indent=2, default=str, allow_nan=False)
