"""pkg: a system package installed, removed, up to date, or held at a version.

Backends: PackageKit over D-Bus when a system bus with PackageKit answers
(checked once per agent, within about a second), apt/dpkg otherwise. The
environment variable `EVERGRAPH_PKG_BACKEND` (`apt`, `packagekit` or `auto`,
the default) forces one.

Grouping: packages with the same target state (and `allowuntrusted`) that do
not depend on each other merge into one vertex; its check is one dpkg query
(or one PackageKit Resolve) for all of them and its apply one transaction
(`apt-get install -y a b c`) for all that need it.

The watch is inotify on dpkg's status file (dpkg replaces it by rename after
every change, whichever tool drove it, PackageKit included), debounced so
that one apt run is one event.

Automatic edges: a package provides `path:` keys for the files it installed
(from dpkg's file list, known once it is installed), so an exec whose program
one of them is runs after it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence
from typing import Annotated, Protocol

from evergraph.engine.contract import Resource, doc, register
from evergraph.errors import ResourceError
from evergraph.resources import _dpkg
from evergraph.resources._dpkg import Found

#: states other than a version
KEYWORDS = ("installed", "uninstalled", "newest")
#: environment variable that forces a backend
BACKEND_ENV = "EVERGRAPH_PKG_BACKEND"
#: seconds to wait for PackageKit when choosing a backend automatically
DETECT_TIMEOUT = 1.0
#: seconds to wait for PackageKit when it is forced (covers its bus activation)
FORCED_TIMEOUT = 30.0
#: seconds of quiet on dpkg's status file before a change is reported
DEBOUNCE = 0.15


class Backend(Protocol):
    name: str

    def alive(self) -> bool:
        """False once the backend cannot be used any more (its bus connection broke)."""
        ...

    async def query(self, names: Sequence[str], candidates: bool) -> dict[str, Found]: ...

    async def change(
        self,
        install: Sequence[tuple[str, str | None]],
        remove: Sequence[str],
        allowuntrusted: bool,
    ) -> list[str]:
        """Install (name, version; None = the candidate) and remove; one summary per command."""
        ...


class Apt:
    """dpkg-query for checks, apt-get for changes."""

    name = "apt"

    def __init__(self) -> None:
        #: our own apt-get runs, one at a time (see _dpkg.apt_get)
        self._lock = asyncio.Lock()

    def alive(self) -> bool:
        return True

    async def query(self, names: Sequence[str], candidates: bool) -> dict[str, Found]:
        return await _dpkg.query(names, candidates)

    async def change(
        self,
        install: Sequence[tuple[str, str | None]],
        remove: Sequence[str],
        allowuntrusted: bool,
    ) -> list[str]:
        done = []
        if install:
            specs = [name if v is None else f"{name}={v}" for name, v in install]
            pinned = any(v is not None for _, v in install)
            argv = _dpkg.apt_argv("install", specs, allowuntrusted, downgrades=pinned)
            done.append(await _dpkg.apt_get(argv, self._lock))
        if remove:
            argv = _dpkg.apt_argv("remove", remove, allowuntrusted)
            done.append(await _dpkg.apt_get(argv, self._lock))
        return done


class Packages:
    """A service (`handle.services.get(Packages)`): what the agent's pkg resources
    share: the backend, chosen once, and the group members whose leader watches."""

    def __init__(self) -> None:
        #: ids of group members while their leader watches for them (the engine
        #: subscribes the leader first, then each member)
        self.led: set[int] = set()
        self._chosen: Backend | None = None
        self._choosing = asyncio.Lock()

    async def backend(self) -> Backend:
        """The backend for this agent, chosen once (again if it died)."""
        chosen = self._chosen
        if chosen is not None and chosen.alive():
            return chosen
        async with self._choosing:
            chosen = self._chosen
            if chosen is None or not chosen.alive():  # e.g. the bus daemon restarted
                chosen = self._chosen = await _choose()
        return chosen

    def close(self) -> None:
        """Let go of the backend (PackageKit's bus connection)."""
        close = getattr(self._chosen, "close", None)
        self._chosen = None
        if close is not None:
            close()


async def _choose() -> Backend:
    wanted = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if wanted == "apt":
        return Apt()
    from evergraph.resources import _packagekit  # D-Bus only where it may be used

    if wanted == "packagekit":
        try:
            return await _packagekit.PackageKit.connect(FORCED_TIMEOUT)
        except ResourceError:
            raise
        except Exception as e:
            why = "timed out" if isinstance(e, TimeoutError) else str(e) or type(e).__name__
            raise ResourceError(
                f"{BACKEND_ENV}=packagekit but PackageKit on the system bus does not answer: {why}"
            ) from None
    if wanted != "auto":
        raise ResourceError(f"{BACKEND_ENV}={wanted!r}: expected apt, packagekit or auto")
    if _packagekit.system_bus_present():
        try:
            return await _packagekit.PackageKit.connect(DETECT_TIMEOUT)
        except Exception:
            pass  # no bus daemon, or no PackageKit on it: apt/dpkg it is
    return Apt()


@register("pkg")
class Pkg(Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
    """A system package (name = the package): installed, uninstalled, newest, or a version.

    PackageKit over D-Bus where it answers on the system bus, apt/dpkg otherwise;
    `EVERGRAPH_PKG_BACKEND=apt|packagekit|auto` in the agent's environment forces one.
    Packages with the same state group into one transaction."""

    groupable = True

    state: Annotated[
        str,
        doc(
            "`installed`, `uninstalled` (removed, config files kept), `newest` (upgraded to"
            " the candidate), or an exact version such as `5.02-1+b1`"
        ),
    ] = "installed"
    allowuntrusted: Annotated[
        bool, doc("install even when the package's origin cannot be authenticated")
    ] = False
    # mgmt's PackageKit options: accepted so its graphs load (docs/mgmt-compatibility.md)
    allowdowngrade: Annotated[
        bool, doc("mgmt's; a version named in `state` is installed even when older, always")
    ] = False
    allownonfree: Annotated[
        bool, doc("mgmt's; not honoured: every package the system's sources offer is used")
    ] = False
    allowunsupported: Annotated[
        bool, doc("mgmt's; not honoured: every package the system's sources offer is used")
    ] = False

    def validate(self) -> None:
        why = _dpkg.name_problem(self.name)
        if why is not None:
            raise self.bad("name", why)
        if self.state not in KEYWORDS and not _dpkg.is_version(self.state):
            raise self.bad(
                "state",
                f"{self.state!r} is neither installed, uninstalled, newest nor a version"
                " (a version starts with a digit, e.g. '1.2-3')",
            )

    def group_key(self) -> tuple[object, ...]:
        # versions differ per package but install alike: one group for all of them
        state = self.state if self.state in KEYWORDS else "version"
        return (*super().group_key(), state, self.allowuntrusted)

    def claims(self) -> list[str]:
        return [f"pkg:{self.name}"]

    def autoedge_provides(self) -> list[str]:
        # path: for an exec running one of its programs; pkgfile: for a file
        # resource managing one of its files (a file provides path: itself)
        files = _dpkg.installed_files(self.name)
        return [f"path:{p}" for p in files] + [f"pkgfile:{p}" for p in files]

    # -- watch ---------------------------------------------------------------------
    def subscribe(self) -> Callable[[], None] | None:
        led = self.handle.services.get(Packages).led
        if id(self) in led:
            return None  # a group member: the leader's one watch covers the whole group
        led.update(id(m) for m in self.group_members)
        loop = asyncio.get_running_loop()
        pending: list[asyncio.TimerHandle] = []

        def changed(_mask: int) -> None:
            # dpkg rewrites its status file several times during one apt run:
            # report once, after it has been quiet for DEBOUNCE seconds
            if pending:
                pending.pop().cancel()
            pending.append(loop.call_later(DEBOUNCE, self.handle.event))

        sub = self.handle.watcher.subscribe(_dpkg.STATUS, changed)

        def unsubscribe() -> None:
            sub()
            while pending:
                pending.pop().cancel()
            led.difference_update(id(m) for m in self.group_members)

        return unsubscribe

    # -- check and apply -------------------------------------------------------------
    async def check_apply(self, apply: bool) -> bool:
        return await self._converge([self], apply)

    async def check_apply_group(self, apply: bool) -> bool:
        members = [m for m in self.group_members if isinstance(m, Pkg)]
        return await self._converge([self, *members], apply)

    def _needs(self, found: Found) -> tuple[str, str | None] | None:
        """None when in state; else ("install", version or None) or ("remove", None)."""
        have = found.installed
        if self.state == "installed":
            return None if have is not None else ("install", None)
        if self.state == "uninstalled":
            return None if have is None else ("remove", None)
        if self.state == "newest":
            if have is not None and (found.candidate is None or found.candidate == have):
                return None
            return ("install", None)
        return None if have == self.state else ("install", self.state)

    async def _converge(self, group: list[Pkg], apply: bool) -> bool:
        """One query for the whole group, then one transaction per change and trust level."""
        be = await self.handle.services.get(Packages).backend()
        found = await be.query([r.name for r in group], any(r.state == "newest" for r in group))
        todo: dict[bool, tuple[list[tuple[str, str | None]], list[str], list[str]]] = {}
        for res in group:
            have = found[res.name]
            need = res._needs(have)
            if need is None:
                continue
            # the version installed now, and after (None: not installed)
            field = "version" if len(group) == 1 else f"{res.name} version"
            after = need[1] or have.candidate or "the candidate"
            self.handle.changed(field, have.installed, None if need[0] == "remove" else after)
            install, remove, idents = todo.setdefault(res.allowuntrusted, ([], [], []))
            if need[0] == "install":
                install.append((res.name, need[1]))
            else:
                remove.append(res.name)
            idents.append(res.ident)
        if not todo:
            return True
        if not apply:
            return False
        for allowuntrusted, (install, remove, idents) in todo.items():
            for summary in await be.change(install, remove, allowuntrusted):
                self.handle.logger.info("%s: %s", " ".join(idents), summary)
        return False
