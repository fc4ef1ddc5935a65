"""cron: a systemd timer, written as a unit file and kept running (mgmt's cron).

The resource's name is the timer: `<name>.timer`, in /etc/systemd/system, or
with `session` in the agent user's own units ($XDG_CONFIG_HOME/systemd/user,
else ~/.config/systemd/user). It triggers `unit` (default `<name>.service`).
With `command` (evergraph's, not mgmt's) the service is written too: a oneshot
running the command with /bin/sh.

- `state: exists` writes the unit file(s) (atomically, 0644), has systemd
  reload them (the manager's Reload, as `systemctl daemon-reload`) when they
  changed or systemd says its copy is stale, and keeps the timer started
  (restarted after a change, so the new schedule applies). `absent` stops the
  timer, disables it, and removes the file(s) this resource writes.
- `startup: enabled` enables the timer (its `[Install] WantedBy=timers.target`);
  `disabled` disables it; empty: not managed.

It talks to systemd over D-Bus, sharing svc's connection (the system bus, or
the user's with `session`); where systemd does not answer the vertex fails with
one line saying so. The watch is the timer unit's D-Bus signals (state, unit
files changed, reloads) and inotify on the unit file(s) (the shared hub).

Reversal: where no timer file was there before, the reversal removes it
(`absent`); an existing one is not ours to restore.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Literal

from evergraph._util.atomic import atomic_write
from evergraph.engine.contract import Handle, Resource, doc, register
from evergraph.errors import ResourceError
from evergraph.resources._oserror import os_error
from evergraph.resources._systemd import (
    ENABLED,
    FIXED,
    MASKED,
    PROPERTIES,
    RELOAD_TIMEOUT,
    RUNNING,
    SYSTEMD,
    UNIT,
    Systemd,
    SystemdBuses,
)

TRIGGERS = (
    "OnCalendar",
    "OnActiveSec",
    "OnBootSec",
    "OnStartupSec",
    "OnUnitActiveSec",
    "OnUnitInactiveSec",
)
_NAME = re.compile(r"[A-Za-z0-9:_.\\@-]+")
_SERVICE = re.compile(r"[A-Za-z0-9:_.\\@-]+\.service")
#: one line of text: no control characters
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
SYSTEM_UNITS = "/etc/systemd/system"


def user_units() -> str:
    """Where the agent user's own unit files go (what systemd --user reads first)."""
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(config, "systemd", "user")


def _exec_line(command: str) -> str:
    """`command` as an ExecStart= value run by /bin/sh (systemd's quoting: `\\` and
    `"` escaped, `%` specifiers and `$` expansion turned off)."""
    quoted = command.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("$", "$$")
    return f'/bin/sh -c "{quoted}"'


@register("cron")
class Cron(Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
    """A systemd timer `<name>.timer` (its unit file written), started and enabled."""

    state: Annotated[
        Literal["exists", "absent"],
        doc("`exists`: the timer's unit file written and the timer started; `absent`: gone"),
    ] = "exists"
    startup: Annotated[
        Literal["enabled", "disabled", ""],
        doc("the timer `enabled` or `disabled` at boot (timers.target); empty = not managed"),
    ] = ""
    session: Annotated[bool, doc("the agent user's own systemd (user units) instead")] = False
    trigger: Annotated[
        str, doc("OnCalendar, OnActiveSec, OnBootSec, OnStartupSec, OnUnitActiveSec or ...")
    ] = ""
    time: Annotated[
        str, doc("the trigger's value: a calendar event (OnCalendar) or a time span")
    ] = ""
    unit: Annotated[str, doc("the service the timer starts; default `<name>.service`")] = ""
    command: Annotated[
        str,
        doc("write that service too: a oneshot running this with /bin/sh (absent: remove it)"),
    ] = ""
    accuracysec: Annotated[str, doc("AccuracySec= (systemd's default: 1min)")] = ""
    randomizeddelaysec: Annotated[str, doc("RandomizedDelaySec=")] = ""
    persistent: Annotated[bool, doc("Persistent=: catch up on runs missed while off")] = False
    wakesystem: Annotated[bool, doc("WakeSystem=: resume from suspend to run")] = False
    remainafterelapse: Annotated[bool, doc("RemainAfterElapse=: an elapsed timer stays loaded")] = (
        True
    )

    # -- contract -----------------------------------------------------------------
    def validate(self) -> None:
        if len(self.name) > 249 or not _NAME.fullmatch(self.name) or self.name[0] == ".":
            raise self.bad("name", f"{self.name!r} cannot name a timer unit")
        if self.unit and not _SERVICE.fullmatch(self.unit):
            raise self.bad("unit", f"{self.unit!r} is not a service unit name (`x.service`)")
        for field in ("time", "accuracysec", "randomizeddelaysec", "command"):
            if _CONTROL.search(getattr(self, field)):
                raise self.bad(field, "must be one line, without control characters")
        if self.state == "absent":
            return
        if self.trigger not in TRIGGERS:
            why = "needs a trigger" if not self.trigger else f"{self.trigger!r} is not a trigger"
            raise self.bad("trigger", f"{why}: one of {', '.join(TRIGGERS)}")
        if not self.time.strip():
            raise self.bad("time", f"needs the value of {self.trigger} (`daily`, `5min`, ...)")

    def _service(self) -> str:
        return self.unit or f"{self.name}.service"

    def _dir(self) -> str:
        return user_units() if self.session else SYSTEM_UNITS

    def _files(self) -> dict[str, str]:
        """The unit files this resource writes: path -> content."""
        where = self._dir()
        files = {f"{where}/{self.name}.timer": self._timer_text()}
        if self.command:
            files[f"{where}/{self._service()}"] = self._service_text()
        return files

    def _timer_text(self) -> str:
        lines = [
            "[Unit]",
            f"Description=timer {self.name} (evergraph cron[{self.name}])",
            "",
            "[Timer]",
            f"{self.trigger}={self.time}",
        ]
        if self.accuracysec:
            lines.append(f"AccuracySec={self.accuracysec}")
        if self.randomizeddelaysec:
            lines.append(f"RandomizedDelaySec={self.randomizeddelaysec}")
        if self.unit:
            lines.append(f"Unit={self.unit}")
        if self.persistent:
            lines.append("Persistent=true")
        if self.wakesystem:
            lines.append("WakeSystem=true")
        if not self.remainafterelapse:
            lines.append("RemainAfterElapse=false")
        lines += ["", "[Install]", "WantedBy=timers.target"]
        return "\n".join(lines) + "\n"

    def _service_text(self) -> str:
        return (
            f"[Unit]\nDescription=run by timer {self.name} (evergraph cron[{self.name}])\n\n"
            f"[Service]\nType=oneshot\nExecStart={_exec_line(self.command)}\n"
        )

    def claims(self) -> list[str]:
        bus = "session" if self.session else "system"
        keys = [f"svc:{bus}:{self.name}.timer", f"file:{self._dir()}/{self.name}.timer"]
        if self.command:
            keys += [f"svc:{bus}:{self._service()}", f"file:{self._dir()}/{self._service()}"]
        return keys

    def reversal(self) -> Cron | None:
        if os.path.exists(f"{self._dir()}/{self.name}.timer"):
            return None
        # with `command`, absent removes the service file too: only if we make it
        made_service = self.command and not os.path.exists(f"{self._dir()}/{self._service()}")
        return Cron(
            name=self.name,
            state="absent",
            session=self.session,
            unit=self.unit,
            command=self.command if made_service else "",
        )

    # -- life cycle -----------------------------------------------------------------
    async def init(self, handle: Handle) -> None:
        await super().init(handle)
        self._timer = f"{self.name}.timer"
        self._sd: Systemd | None = None
        self._sd = await handle.services.get(SystemdBuses).acquire_for(self.session)

    async def cleanup(self) -> None:
        if getattr(self, "_sd", None) is not None:
            assert self._sd is not None
            self._sd.release()
            self._sd = None

    async def _systemd(self) -> Systemd:
        sd = self._sd
        if sd is not None and not sd.dead:
            return sd
        if sd is not None:
            self._sd = None
            sd.release()
        self._sd = await self.handle.services.get(SystemdBuses).acquire(self.session)
        return self._sd

    async def watch(self) -> None:
        sd = await self._systemd()
        path = await sd.unit_path(self._timer)
        rule = (
            f"type='signal',sender='{SYSTEMD}',interface='{PROPERTIES}',"
            f"member='PropertiesChanged',path='{path}'"
        )
        await sd.add_match(rule)
        unsubscribe = sd.on_unit(path, self.handle.event)
        files: list[Callable[[], None]] = [
            self.handle.watcher.subscribe(f, lambda _mask: self.handle.event())
            for f in self._files()
        ]
        try:
            self.handle.ready()
            self.handle.event()  # (after a lost bus: look again)
            with contextlib.suppress(Exception):
                await asyncio.shield(sd.gone)
            raise ResourceError("lost the connection to systemd's D-Bus API")
        finally:
            for f in files:
                f()
            unsubscribe()
            sd.remove_match(rule)

    async def check_apply(self, apply: bool) -> bool:
        sd = await self._systemd()
        if self.state == "absent":
            return await self._absent(sd, apply)
        clean = True
        changed = self._write_files(apply)
        if changed:
            clean = False
        path = await sd.unit_path(self._timer)
        stale = await self._stale(sd, path)
        if stale and not changed:
            clean = False
            self.handle.changed("daemon-reload", None, "units loaded again")
        if (changed or stale) and apply:
            await sd.manager("Reload", timeout=RELOAD_TIMEOUT)
            self.handle.logger.info("%s: systemd reloaded its units", self.ident)
            path = await sd.unit_path(self._timer)
        load = await sd.unit_property(path, "LoadState")
        if load != "loaded" and (apply or not (changed or stale)):
            hint = ""
            if load == "bad-setting":
                hint = f" (does systemd take {self.trigger}={self.time}? `systemd-analyze verify`)"
            raise ResourceError(f"{self._timer}: systemd's load state is {load!r}{hint}")
        if self.startup:
            clean = await self._startup(sd, path, apply) and clean
        active = await sd.unit_property(path, "ActiveState")
        if active not in RUNNING:
            clean = False
            self.handle.changed("state", active, "active")
            if apply:
                await self._job(sd, "StartUnit", "started")
        elif changed:
            self.handle.changed("state", active, "restarted (new schedule)")
            if apply:
                await self._job(sd, "RestartUnit", "restarted")
        return clean

    def _write_files(self, apply: bool) -> bool:
        """Write the unit files that differ; True if some did."""
        changed = False
        for path, text in self._files().items():
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    now: str | None = f.read()
            except FileNotFoundError:
                now = None
            if now == text:
                continue
            changed = True
            self.handle.changed(os.path.basename(path), now, text, content=True)
            if apply:
                try:
                    atomic_write(path, text.encode(), mode=0o644, dir_mode=0o755)
                except OSError as e:
                    raise os_error(f"cannot write {path}", e) from None
                self.handle.logger.info("%s: wrote %s", self.ident, path)
        return changed

    async def _stale(self, sd: Systemd, path: str) -> bool:
        """systemd's copy of our units is older than their files (NeedDaemonReload)."""
        for unit in [self._timer, *([self._service()] if self.command else [])]:
            upath = path if unit == self._timer else await sd.unit_path(unit)
            reply = await sd.call(SYSTEMD, upath, PROPERTIES, "Get", "ss", UNIT, "NeedDaemonReload")
            if reply.body[0].value:
                return True
        return False

    async def _startup(self, sd: Systemd, path: str, apply: bool) -> bool:
        state = await sd.unit_property(path, "UnitFileState")
        want = self.startup == "enabled"
        if want and state in MASKED:
            raise ResourceError(f"{self._timer} is masked: cannot enable it")
        if state in FIXED or (not want and state in MASKED):
            return True
        if (state in ENABLED) == want:
            return True
        self.handle.changed("startup", state or None, self.startup)
        if apply:
            await self._enable(sd, want)
        return False

    async def _enable(self, sd: Systemd, on: bool) -> None:
        if on:
            await sd.manager("EnableUnitFiles", "asbb", [self._timer], False, True)
        else:
            await sd.manager("DisableUnitFiles", "asb", [self._timer], False)
        await sd.manager("Reload", timeout=RELOAD_TIMEOUT)
        self.handle.logger.info(
            "%s: %s %s", self.ident, "enabled" if on else "disabled", self._timer
        )

    async def _job(self, sd: Systemd, verb: str, done: str) -> None:
        result = await sd.job(verb, self._timer)
        if result != "done":
            raise ResourceError(f"{verb} {self._timer}: job {result}")
        self.handle.logger.info("%s: %s %s", self.ident, done, self._timer)

    async def _absent(self, sd: Systemd, apply: bool) -> bool:
        clean = True
        path = await sd.unit_path(self._timer)
        if await sd.unit_property(path, "ActiveState") in RUNNING:
            clean = False
            self.handle.changed("state", "active", "stopped")
            if apply:
                await self._job(sd, "StopUnit", "stopped")
        if await sd.unit_property(path, "UnitFileState") in ENABLED:
            clean = False
            self.handle.changed("startup", "enabled", "disabled")
            if apply:
                await self._enable(sd, False)
        files = [f"{self._dir()}/{self._timer}"]
        if self.command:
            files.append(f"{self._dir()}/{self._service()}")
        gone = [f for f in files if os.path.lexists(f)]
        for f in gone:
            clean = False
            self.handle.changed(os.path.basename(f), Path(f).read_text(errors="replace"), None)
            if apply:
                try:
                    os.unlink(f)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    raise os_error(f"cannot remove {f}", e) from None
                self.handle.logger.info("%s: removed %s", self.ident, f)
        if gone and apply:
            await sd.manager("Reload", timeout=RELOAD_TIMEOUT)
        return clean
