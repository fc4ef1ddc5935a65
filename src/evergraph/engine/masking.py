"""Secrets are never shown: the one place that hides them from text.

A sender marks the values that are secrets (`Resource.secret_sends`, e.g.
`password.password`). The engine keeps, per vertex, the secret values it has
received (and those its senders knew of: a command that received a password
may print it), and every text about that vertex goes through `mask`: the
resource's own log lines (its `handle.logger`), the engine's log lines and
recorded errors, the status snapshots observers (CLI, HTTP) see.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

#: what a secret's text is replaced by
MASK = "********"
#: lines of a multi-line secret shorter than this are not masked on their own
#: (a private key's "-----END ...-----" line is no secret; its body lines are)
_LINE_MIN = 8


def mask(text: str, secrets: Collection[str]) -> str:
    """`text` with every occurrence of each secret replaced by `MASK`."""
    if not secrets or not text:
        return text
    for secret in sorted(secrets, key=len, reverse=True):  # a secret inside another
        if not secret:
            continue
        if secret in text:
            text = text.replace(secret, MASK)
        if "\n" in secret:  # an error message may quote a line of it, or join lines
            for line in sorted(secret.splitlines(), key=len, reverse=True):
                line = line.strip()
                if len(line) >= _LINE_MIN and line in text:
                    text = text.replace(line, MASK)
    return text


class MaskingLogger(logging.Logger):
    """A logger whose records are masked before any handler sees them.

    It is not registered with the logging manager: it hands its records to
    `base` (whose level and handlers decide), as a child logger would.
    """

    def __init__(self, base: logging.Logger, masker: Callable[[str], str]) -> None:
        super().__init__(base.name)
        self.parent = base
        self._masker = masker

    def isEnabledFor(self, level: int) -> bool:
        assert self.parent is not None
        return self.parent.isEnabledFor(level)

    def handle(self, record: logging.LogRecord) -> None:
        record.msg = self._masker(record.getMessage())
        record.args = None
        if record.exc_info:
            # formatted now, masked; formatters use exc_text when exc_info is gone
            text = logging.Formatter().formatException(record.exc_info)
            record.exc_text = self._masker(text)
            record.exc_info = None
        elif record.exc_text:
            record.exc_text = self._masker(record.exc_text)
        if record.stack_info:
            record.stack_info = self._masker(record.stack_info)
        super().handle(record)
