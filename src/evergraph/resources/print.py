"""print (alias msg): logs a message when it runs.

mgmt's msg fields: `body` is its name for `msg`; `priority` is the level of the
log line and the journal's and syslog's priority; `journal` also sends the
message to the systemd journal (its native protocol, with `fields`), `syslog`
to the local syslog socket (/dev/log). Neither is sent under noop. The agent's
environment may name other sockets: EVERGRAPH_JOURNAL_SOCKET,
EVERGRAPH_SYSLOG_SOCKET (a container with the host's journal mounted elsewhere).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import struct
from typing import Annotated, Literal

from evergraph.engine.contract import Handle, Resource, doc, register
from evergraph.resources._oserror import os_error

#: the systemd journal's native socket, and the local syslog socket (and the
#: environment variables that name others)
JOURNAL_SOCKET = "/run/systemd/journal/socket"
SYSLOG_SOCKET = "/dev/log"
JOURNAL_ENV = "EVERGRAPH_JOURNAL_SOCKET"
SYSLOG_ENV = "EVERGRAPH_SYSLOG_SOCKET"
#: mgmt's priority names -> (log level, syslog severity)
PRIORITIES = {
    "Emerg": (logging.CRITICAL, 0),
    "Alert": (logging.CRITICAL, 1),
    "Crit": (logging.CRITICAL, 2),
    "Err": (logging.ERROR, 3),
    "Warning": (logging.WARNING, 4),
    "Notice": (logging.INFO, 5),
    "Info": (logging.INFO, 6),
    "Debug": (logging.DEBUG, 7),
}
#: a journal field name as mgmt accepts it (sent upper-cased, as the journal wants)
_FIELD = re.compile(r"[A-Za-z0-9][A-Za-z0-9_]*")
#: syslog facility "user"
_USER_FACILITY = 1


def _journal_record(fields: dict[str, str]) -> bytes:
    """The journal's native datagram: `NAME=value` lines, or for a value with a
    newline `NAME`, its length (64-bit little endian) and the value."""
    out = bytearray()
    for name, value in fields.items():
        data = value.encode()
        if b"\n" in data:
            out += name.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += name.encode() + b"=" + data + b"\n"
    return bytes(out)


def _send(path: str, data: bytes, what: str) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        try:
            s.sendto(data, path)
        except OSError as e:
            raise os_error(f"{what}: {path}", e) from None


@register("print", "msg")
class Print(Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
    """Logs `msg` when it is new (and on refresh). It changes nothing on the machine, so
    it is always clean: a second run of the same graph reports no change."""

    groupable = True

    msg: Annotated[str, doc("the message to log")] = ""
    refresh_only: Annotated[bool, doc("log only when refreshed by a notify edge")] = False
    body: Annotated[str, doc("mgmt's name for msg (give one of them)")] = ""
    priority: Annotated[
        Literal["Emerg", "Alert", "Crit", "Err", "Warning", "Notice", "Info", "Debug"],
        doc("the log line's level, and the journal's and syslog's priority"),
    ] = "Info"
    fields: Annotated[
        dict[str, str], doc("extra journal fields (letters, digits, `_`; sent upper-cased)")
    ] = {}
    journal: Annotated[bool, doc("also send it to the systemd journal (with fields)")] = False
    syslog: Annotated[bool, doc("also send it to syslog (/dev/log, facility user)")] = False

    def validate(self) -> None:
        if self.msg and self.body and self.msg != self.body:
            raise self.bad("body", "is mgmt's name for msg: give one of them")
        for name in self.fields:
            if not _FIELD.fullmatch(name):
                raise self.bad(
                    "fields", f"{name!r} is not a journal field name (letters, digits, `_`)"
                )

    async def init(self, handle: Handle) -> None:
        await super().init(handle)
        self._shown: str | None = None

    async def check_apply(self, apply: bool) -> bool:
        refreshed = self.handle.refresh()
        if self.refresh_only and not refreshed:
            return True
        text = self.msg or self.body
        if self._shown != text or refreshed:
            level, severity = PRIORITIES[self.priority]
            self.handle.logger.log(level, "%s: %s", self.ident, text)
            if apply and self.journal:
                record = {
                    "MESSAGE": text,
                    "PRIORITY": str(severity),
                    "SYSLOG_IDENTIFIER": "evergraph",
                    **{name.upper(): value for name, value in self.fields.items()},
                }
                path = os.environ.get(JOURNAL_ENV) or JOURNAL_SOCKET
                _send(path, _journal_record(record), "journal")
            if apply and self.syslog:
                line = f"<{_USER_FACILITY * 8 + severity}>evergraph[{os.getpid()}]: {text}"
                _send(os.environ.get(SYSLOG_ENV) or SYSLOG_SOCKET, line.encode(), "syslog")
            self._shown = text
        return True
