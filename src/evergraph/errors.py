"""Error types shared by every layer.

`InputError` is the one kind of failure a user can fix by editing their input
(a YAML file, a CLI flag, a Python graph): the CLI turns it into one line on
stderr and exit status 2, never a traceback.
"""

from __future__ import annotations


class InputError(Exception):
    """Bad user input. `where` names the place: `file:line:col`, `kind[name].field`."""

    def __init__(self, message: str, where: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.where = where

    def __str__(self) -> str:
        return f"{self.where}: {self.message}" if self.where else self.message


class ResourceError(Exception):
    """A resource failed at run time (check_apply or watch); the engine records it."""
