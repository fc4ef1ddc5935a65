"""svc: a systemd unit running or stopped, enabled or disabled at boot.

Talks to systemd over its D-Bus API (`org.freedesktop.systemd1`), on the
system bus, or with `session` on the bus of the agent user's own systemd
(`DBUS_SESSION_BUS_ADDRESS`, else `/run/user/<uid>/bus`). The resource's name
is the unit; without a known unit type suffix `.service` is added, as
systemctl does (`nginx` is `nginx.service`).

- `state: running` starts the unit (StartUnit, mode `replace`) and waits for
  its job to finish; `stopped` stops it. `active`/`reloading` count as
  running, `inactive`/`failed` as stopped. Empty: not managed.
- `startup: enabled` enables the unit file (EnableUnitFiles, then a daemon
  reload, as `systemctl enable` does); `disabled` disables it. Units that
  enabling cannot change (`static`, `generated`, `transient`) are accepted
  either way; a masked unit cannot be enabled (an error). Empty: not managed.
- A refresh (notify edge) reloads the unit if it can reload, else restarts
  it (ReloadOrRestartUnit) — unless it is to be stopped; with `state` empty
  only a running unit is touched (TryReloadOrRestartUnit).
- The watch follows the unit's PropertiesChanged signals, the manager's
  UnitFilesChanged and Reloading, and systemd's own restarts on the bus.

Where systemd's D-Bus API is not reachable (no bus, or no systemd on it),
the vertex fails at start with one line saying so; the rest of the graph
still runs, and the exit status is 1 (the machine, not the graph, is wrong).

All svc resources of an agent share one connection per bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from typing import Annotated, Literal

from evergraph.engine.contract import Handle, Resource, doc, register
from evergraph.errors import ResourceError
from evergraph.resources._systemd import (
    ENABLED,
    FIXED,
    MASKED,
    PROPERTIES,
    RELOAD_TIMEOUT,
    RUNNING,
    STOPPED,
    SYSTEMD,
    Systemd,
    SystemdBuses,
    unit_name,
)

_UNIT_NAME = re.compile(r"[A-Za-z0-9:_.\\@-]+")


@register("svc")
class Svc(Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
    """A systemd unit (the name; `.service` if no type is given): running, enabled."""

    state: Annotated[
        Literal["running", "stopped", ""], doc("`running` or `stopped`; empty = not managed")
    ] = ""
    startup: Annotated[
        Literal["enabled", "disabled", ""],
        doc("`enabled` or `disabled` at boot; empty = not managed"),
    ] = ""
    session: Annotated[
        bool, doc("the agent user's own systemd (user bus) instead of the system's")
    ] = False

    def validate(self) -> None:
        if len(self.name) > 255 or not _UNIT_NAME.fullmatch(self.name):
            raise self.bad("name", f"{self.name!r} is not a systemd unit name")
        if self.name.startswith(".") or self.name.endswith("."):
            raise self.bad("name", f"{self.name!r} is not a systemd unit name")

    def claims(self) -> list[str]:
        # `nginx` and `nginx.service` are one unit
        return [f"svc:{'session' if self.session else 'system'}:{unit_name(self.name)}"]

    def autoedge_wants(self) -> list[list[str]]:
        unit = unit_name(self.name)
        dirs = (
            ["/etc/systemd/user"]
            if self.session
            else ["/etc/systemd/system", "/usr/lib/systemd/system", "/lib/systemd/system"]
        )
        return [[f"path:{d}/{unit}" for d in dirs]]

    async def init(self, handle: Handle) -> None:
        await super().init(handle)
        self._unit = unit_name(self.name)
        self._sd: Systemd | None = None
        self._sd = await handle.services.get(SystemdBuses).acquire_for(self.session)

    async def _systemd(self) -> Systemd:
        """The shared connection; a new one if the bus went away since."""
        sd = self._sd
        if sd is not None and not sd.dead:
            return sd
        if sd is not None:
            self._sd = None
            sd.release()
        fresh = await self.handle.services.get(SystemdBuses).acquire(self.session)
        if self._sd is not None:  # the watch and a check reconnected at once
            fresh.release()
            return self._sd
        self._sd = fresh
        return fresh

    async def cleanup(self) -> None:
        if getattr(self, "_sd", None) is not None:
            assert self._sd is not None
            self._sd.release()
            self._sd = None

    async def watch(self) -> None:
        sd = await self._systemd()
        path = await sd.unit_path(self._unit)
        rule = (
            f"type='signal',sender='{SYSTEMD}',interface='{PROPERTIES}',"
            f"member='PropertiesChanged',path='{path}'"
        )
        await sd.add_match(rule)
        unsubscribe = sd.on_unit(path, self.handle.event)
        try:
            self.handle.ready()
            # After a lost bus the unit may have changed unseen: look again. (At
            # start-up the vertex is pending anyway, so this costs nothing.)
            self.handle.event()
            with contextlib.suppress(Exception):  # how it ended does not matter
                await asyncio.shield(sd.gone)
            raise ResourceError("lost the connection to systemd's D-Bus API")
        finally:
            unsubscribe()
            sd.remove_match(rule)

    async def check_apply(self, apply: bool) -> bool:
        sd = await self._systemd()
        unit = self._unit
        path = await sd.unit_path(unit)
        load = await sd.unit_property(path, "LoadState")
        clean = True
        if self.startup:
            file_state = await sd.unit_property(path, "UnitFileState")
            want = self.startup == "enabled"
            if want and (load == "not-found" or not file_state):
                raise ResourceError(f"{unit}: no such unit file: cannot enable it")
            if want and file_state in MASKED:
                raise ResourceError(f"{unit} is masked: cannot enable it")
            settled = file_state in FIXED or (not want and file_state in MASKED)
            if not settled and (file_state in ENABLED) != want:
                clean = False
                self.handle.changed("startup", file_state, self.startup)
                if apply:  # (noop goes on: what else would change is reported too)
                    await self._enable(sd, want)
        refresh = self.handle.refresh()
        started = False
        if self.state:
            active = await sd.unit_property(path, "ActiveState")
            want_run = self.state == "running"
            if want_run and load == "not-found":
                raise ResourceError(f"{unit}: no such unit: cannot start it")
            if active not in (RUNNING if want_run else STOPPED):
                clean = False
                self.handle.changed("state", active, self.state)
                if apply:
                    verb = "StartUnit" if want_run else "StopUnit"
                    await self._job(sd, verb, "started" if want_run else "stopped")
                started = want_run
        # A unit started just now runs the new configuration already; with
        # `state` empty only a running unit is reloaded.
        if refresh and not started and await self._refreshable(sd, path):
            self.handle.changed("refresh", None, "reload or restart")
            if apply:
                verb = "ReloadOrRestartUnit" if self.state else "TryReloadOrRestartUnit"
                await self._job(sd, verb, "reloaded or restarted (refresh)")
            clean = False
        return clean

    async def _refreshable(self, sd: Systemd, path: str) -> bool:
        if self.state == "stopped":
            return False
        return self.state == "running" or await sd.unit_property(path, "ActiveState") in RUNNING

    async def _enable(self, sd: Systemd, on: bool) -> None:
        unit = self._unit
        if on:
            await sd.manager("EnableUnitFiles", "asbb", [unit], False, True)
        else:
            await sd.manager("DisableUnitFiles", "asb", [unit], False)
        # as `systemctl enable` does: load the new links (a big system takes a while)
        await sd.manager("Reload", timeout=RELOAD_TIMEOUT)
        self.handle.logger.info("%s: %s %s", self.ident, "enabled" if on else "disabled", unit)

    async def _job(self, sd: Systemd, verb: str, done: str) -> None:
        result = await sd.job(verb, self._unit)
        if result != "done":
            raise ResourceError(
                f"{verb} {self._unit}: job {result} (see `journalctl -u {self._unit}`)"
            )
        self.handle.logger.info("%s: %s %s", self.ident, done, self._unit)
