"""sysctl: a kernel parameter's runtime value, and its value persisted for boot.

mgmt's `sysctl`: the name is the parameter in dotted form (`net.ipv4.ip_forward`,
its file `/proc/sys/net/ipv4/ip_forward`); `value`; `runtime` sets the running
kernel's value; `persist` writes `path` (default
`/etc/sysctl.d/99-<name>.conf`) holding `<name> = <value>`, read at boot.

Values are compared as the kernel shows them, whitespace-insensitively
(`32768 60999` matches the kernel's `32768<TAB>60999`). A value the kernel
accepts but shows differently (clamped, say) is a failure naming both: it
would otherwise be rewritten for ever.

Watch: /proc/sys raises no inotify events (its files are generated on
read). A few entries say "changed" through poll(2) instead (POLLPRI|POLLERR,
the kernel's `proc_sys_poll`): those with a `ctl_table_poll`, which in the
mainline kernel are exactly `kernel.hostname` and `kernel.domainname`
(kernel/utsname_sysctl.c; sethostname(2), setdomainname(2) and writes to the
file signal it). Those are watched by that event (`_pollpri`), without a
timer. Every other entry gives no event of any kind, so its runtime value is
read every `interval` seconds and an event raised only when it changed. The
persisted file is watched through the shared inotify hub.

`meta.reverse` restores the runtime value found before the first change and
removes a persisted file that did not exist (`unpersist`); a persisted file
that existed with other content is left as written.
"""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import Callable, Iterator
from typing import Annotated

from evergraph._util.atomic import atomic_write
from evergraph.engine.contract import (
    Handle,
    Resource,
    doc,
    parent_dir_keys,
    register,
    seconds_problem,
)
from evergraph.errors import ResourceError
from evergraph.resources._oserror import os_error
from evergraph.resources._pollpri import watch_pri

PROC_SYS = "/proc/sys"
CONF_DIR = "/etc/sysctl.d"
CONF_PREFIX = "99-"
#: the entries whose changes the kernel signals by poll(2) (see the module's doc)
POLLED_BY_KERNEL = frozenset({"kernel.hostname", "kernel.domainname"})


def _norm(value: str) -> str:
    """A value as compared: runs of whitespace as one space."""
    return " ".join(value.split())


@register("sysctl")
class Sysctl(Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
    """A kernel parameter (the name, dotted: `net.ipv4.ip_forward`): its runtime value
    under /proc/sys, and the value persisted in /etc/sysctl.d for the next boot."""

    eager = True

    value: Annotated[str, doc("the value, as the kernel shows it (whitespace runs match)")] = ""
    runtime: Annotated[bool, doc("set the running kernel's value")] = True
    persist: Annotated[
        bool, doc("write `path` with `<name> = <value>`, applied at boot by systemd-sysctl")
    ] = True
    path: Annotated[
        str, doc("the persisted file (ends in .conf); default /etc/sysctl.d/99-<name>.conf")
    ] = ""
    unpersist: Annotated[
        bool, doc("remove the persisted file `path` (how meta.reverse undoes persist)")
    ] = False
    interval: Annotated[
        float,
        doc(
            "seconds between reads of the runtime value (/proc/sys has no inotify); "
            "unused for kernel.hostname and kernel.domainname, whose changes the kernel "
            "signals (the only entries that do)"
        ),
    ] = 5.0

    def validate(self) -> None:
        name = self.name
        parts = name.split(".")
        if not all(parts) or name != name.strip():
            raise self.bad("name", f"{name!r} is not a dotted name like net.ipv4.ip_forward")
        for bad, why in (("/", "a slash: use the dotted form"), ("=", "an `=`"), ("\0", "NUL")):
            if bad in name:
                raise self.bad("name", f"{name!r} contains {why}")
        if any(c.isspace() for c in name):
            raise self.bad("name", f"{name!r} contains whitespace")
        if not self.value and not (self.unpersist and not self.runtime):
            raise self.bad("value", "is empty: give the value to set")
        if self.value != self.value.strip() or "\n" in self.value or "\0" in self.value:
            raise self.bad("value", f"{self.value!r} has leading/trailing whitespace or a newline")
        if not (self.runtime or self.persist or self.unpersist):
            raise self.bad("runtime", "and persist are both false: nothing to manage")
        if self.unpersist and self.persist:
            raise self.bad("unpersist", "cannot be combined with persist: pick one")
        path = self._conf()
        if not path.startswith("/") or path.endswith("/") or "\0" in path:
            raise self.bad("path", f"{path!r} is not an absolute file path")
        if not path.endswith(".conf"):
            raise self.bad("path", f"{path!r} does not end in .conf (systemd-sysctl reads those)")
        problem = seconds_problem(self.interval)
        if problem:
            raise self.bad("interval", problem)

    def _conf(self) -> str:
        return self.path or f"{CONF_DIR}/{CONF_PREFIX}{self.name}.conf"

    def _proc(self) -> str:
        return f"{PROC_SYS}/{self.name.replace('.', '/')}"

    def _file_text(self, value: str) -> bytes:
        return f"{self.name} = {value}\n".encode()

    def claims(self) -> list[str]:
        keys = [f"sysctl:{self.name}"] if self.runtime else []
        if self.persist or self.unpersist:
            keys.append(f"content:{os.path.normpath(self._conf())}")
        return keys

    def autoedge_wants(self) -> Iterator[Iterator[str]]:
        if self.persist:
            yield parent_dir_keys(os.path.normpath(self._conf()))

    def reversal(self) -> Sysctl | None:
        before = _read(self._proc()) if self.runtime else None
        runtime = before is not None and _norm(before) != _norm(self.value)
        persist = unpersist = False
        if self.persist:
            try:
                with open(self._conf(), "rb") as f:
                    had: bytes | None = f.read()
            except FileNotFoundError:
                had = None
            except OSError:
                had = b""  # unreadable: left alone
            if had is None:
                unpersist = True
            elif before is not None and had == self._file_text(before) and runtime:
                persist = True  # it held the runtime value found: write that back
        if not (runtime or persist or unpersist):
            return None
        return Sysctl(
            name=self.name,
            value=before if before is not None and runtime else self.value,
            runtime=runtime,
            persist=persist,
            unpersist=unpersist,
            path=self.path,
            interval=self.interval,
        )

    async def init(self, handle: Handle) -> None:
        await super().init(handle)
        self._file = self._proc()
        self._path = os.path.normpath(self._conf())
        #: the runtime value last read or written (what the poll compares to)
        self._seen: str | None = None

    async def watch(self) -> None:
        stops: list[Callable[[], None]] = []
        if self.persist or self.unpersist:
            stops.append(self.handle.watcher.subscribe(self._path, self._persisted_changed))
        try:
            signalled = False
            if self.runtime and self.name in POLLED_BY_KERNEL:
                # armed before the first read: a change after it is told
                try:
                    stops.append(watch_pri(self._file, self._signalled))
                    signalled = True
                except OSError as e:  # absent here, say: the reads below, the check tells
                    self.handle.logger.debug("%s: no change events: %s", self.ident, e)
            if self.runtime:
                self._seen = _read(self._file)
            self.handle.ready()
            if signalled or not self.runtime:
                await asyncio.Event().wait()  # the events do it all
            while True:
                # no event for this entry: read it, now and then
                await asyncio.sleep(self.interval)
                now = _read(self._file)
                if now != self._seen:
                    self._seen = now
                    self.handle.event()
        finally:
            for stop in stops:
                stop()

    def _signalled(self) -> None:
        """The kernel says the value changed (in some UTS namespace: the signal is
        shared by all): an event when ours did."""
        try:
            now = _read(self._file)
        except ResourceError:
            now = None
        if now != self._seen or now is None:
            self._seen = now
            self.handle.event()

    def _persisted_changed(self, mask: int) -> None:
        self.handle.event()

    async def check_apply(self, apply: bool) -> bool:
        clean = True
        if self.runtime:
            clean = self._check_runtime(apply)
        if self.persist:
            clean = self._check_persisted(apply) and clean
        elif self.unpersist:
            clean = self._check_unpersisted(apply) and clean
        return clean

    def _check_runtime(self, apply: bool) -> bool:
        now = _read(self._file)
        if now is None:
            raise ResourceError(f"{self._file} does not exist: no such kernel parameter here")
        self._seen = now
        if _norm(now) == _norm(self.value):
            return True
        self.handle.changed("value", now, self.value)
        if not apply:
            return False
        try:
            fd = os.open(self._file, os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(fd, self.value.encode() + b"\n")
            finally:
                os.close(fd)
        except OSError as e:
            if e.errno == errno.EINVAL:
                raise os_error(f"the kernel refused {self.value!r}", e) from None
            raise os_error(self._file, e) from None
        after = _read(self._file)
        self._seen = after
        if after is None or _norm(after) != _norm(self.value):
            raise ResourceError(
                f"the kernel holds {after!r} after {self.value!r} was written: give the value "
                "as the kernel shows it"
            )
        return False

    def _check_persisted(self, apply: bool) -> bool:
        want = self._file_text(self.value)
        try:
            with open(self._path, "rb") as f:
                have: bytes | None = f.read()
        except FileNotFoundError:
            have = None
        except OSError as e:
            raise os_error(self._path, e) from None
        if have == want:
            return True
        self.handle.changed("persisted", have, want, content=True)
        if apply:
            try:
                atomic_write(self._path, want, mode=0o644, dir_mode=0o755)
            except OSError as e:
                raise os_error(self._path, e) from None
        return False

    def _check_unpersisted(self, apply: bool) -> bool:
        if not os.path.lexists(self._path):
            return True
        self.handle.changed("persisted", self._path, None)
        if apply:
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass
            except OSError as e:
                raise os_error(self._path, e) from None
        return False


def _read(path: str) -> str | None:
    """A /proc/sys value without its newline; None: no such parameter."""
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace").rstrip("\n")
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise os_error(path, e) from None
