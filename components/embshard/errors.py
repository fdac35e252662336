"""Errors a user can act on.

Every error that reaches the command line is one line that names the file, the field and the fix; the CLI
prints it and exits with code 2. Nothing half-written is left behind (see storage.atomic_write).
"""
from __future__ import annotations

import re

# Terminal colour codes and other control characters (some libraries' messages carry them): one plain line.
_CONTROL = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|[\x00-\x1f\x7f]")


def first_line(exc: BaseException | str, limit: int = 120) -> str:
    """A library exception's text (or a message) for a one-line error: its first line, cut at a word's end (with
    '…') when longer than `limit`, or the exception type's name when it has no text (a cut mid-word read 'If yo)')."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__ if isinstance(exc, BaseException) else ""
    line = text.splitlines()[0]
    if len(line) <= limit:
        return line
    cut = line[:limit]
    space = cut.rfind(" ")
    return (cut[:space] if space > limit // 2 else cut).rstrip(" ,;:(") + "…"


class EmbshardError(Exception):
    """Bad input or an impossible request: the message says what to change."""

    exit_code = 2

    def __init__(self, message: str, *, path: str | None = None, field: str | None = None,
                 fix: str | None = None):
        parts = []
        if path:
            parts.append(str(path))
        if field:
            parts.append(f"field '{field}'")
        parts.append(message)
        text = ": ".join(parts)
        if fix:
            text += f" (fix: {fix})"
        super().__init__(_CONTROL.sub(lambda m: " " if m.group() in "\n\r\t" else "", text))
        self.message, self.path, self.field, self.fix = message, path, field, fix

    def at(self, path: str) -> EmbshardError:
        """The same error naming `path` (the user's input file) instead of an internal name such as a task id."""
        return type(self)(self.message, path=path, field=self.field, fix=self.fix)


class StoreUnreachableError(EmbshardError):
    """A store that did not answer (a bucket, the MLflow server): the same call may work later, so it exits 75
    (EX_TEMPFAIL), which the cluster's stage pods retry, where bad input's 2 fails at once."""

    exit_code = 75


class DiskError(EmbshardError):
    """The disk failed a write the command was making: no space left, a quota, a file system gone read-only. Not
    the input's fault and not a store to wait for: exit 74 (EX_IOERR). What was published before stays whole."""

    exit_code = 74


# errno values of DiskError, and the words pyarrow's errors carry where they have no errno
DISK_ERRNOS = {28: "no space left on device", 122: "disk quota exceeded", 30: "read-only file system",
               5: "input/output error"}


def disk_error(exc: BaseException) -> DiskError | None:
    """The DiskError an OSError (or an error whose message carries one, as pyarrow's do) is, else None."""
    if not isinstance(exc, OSError):
        return None
    what = DISK_ERRNOS.get(getattr(exc, "errno", None) or -1)
    if what is None:
        text = str(exc).lower()
        what = next((w for w in DISK_ERRNOS.values() if w in text), None)
    if what is None:
        return None
    return DiskError(what, path=getattr(exc, "filename", None) or None,
                     fix="free space or make the folder writable, then run the command again (outputs already "
                         "written are whole; a partial one was not published)")


class InfeasiblePlacementError(EmbshardError):
    """No placement satisfies the memory constraint; the message says how much memory is missing."""


class BackendUnavailableError(EmbshardError):
    """A forced benchmark backend or device cannot be used on this machine."""


class ModelNotFoundError(EmbshardError):
    """A registry URI that resolves to nothing; the message says how to train/register one."""


class ModelFilesMissingError(ModelNotFoundError):
    """A registered version whose files are gone; the message names the version and the missing file."""
