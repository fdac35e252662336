"""Errors a user can act on.

Every error that reaches the command line is one line that names the file, the field and the fix; the CLI
prints it and exits with code 2. Nothing half-written is left behind (see storage.atomic_write).
"""
from __future__ import annotations


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
        super().__init__(text.replace("\n", " "))
        self.path, self.field, self.fix = path, field, fix


class InfeasiblePlacementError(EmbshardError):
    """No placement satisfies the memory constraint; the message says how much memory is missing."""


class BackendUnavailableError(EmbshardError):
    """A forced benchmark backend or device cannot be used on this machine."""


class ModelNotFoundError(EmbshardError):
    """A registry URI that resolves to nothing; the message says how to train/register one."""
