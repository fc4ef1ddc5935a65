"""Pinned identities: which keys this host trusts, kept in `STATE/pins.json`.

Trust on first use, as ssh does with known_hosts: the first key seen for a host
(in `hostkeys/<host>`) is pinned, and from then on a record signed by, or to be
sealed for, any other key is refused, whatever the World says. An operator pins
explicitly with `evergraph hosts trust NAME KEY` (before the host is first seen,
or after a deliberate key change) and unpins with `hosts forget NAME`.

The same file holds the trusted deployers (verify keys whose signed deploys an
agent without FILE runs). Written with the one atomic write, mode 0600; a file
that does not parse is an error naming it, never silently replaced (that would
re-open trust on first use to whoever writes the World next).

Pins are live: a running agent watches the file (its inotify hub calls `poll()`),
so `hosts trust`, `hosts forget` and a new deployer reach it within a second.
Whoever depends on them registers with `listen(fn)`: `fn(hosts, deployers)` is
called with the hosts whose pin changed and whether the deployers did.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from evergraph._util.atomic import atomic_write
from evergraph.cluster.hostkeys import check_verify_key, fingerprint, identity, parse_identity

FILE = "pins.json"

log = logging.getLogger("evergraph.pins")

#: a "pins changed" listener: (hosts whose pin changed, did the deployers change)
PinsListener = Callable[[frozenset[str], bool], None]


class PinsError(Exception):
    """The pins file is unreadable or malformed (the message names it)."""


class IdentityMismatch(Exception):
    """A host presents a key other than the pinned one."""

    def __init__(self, host: str, pinned: str, seen: str) -> None:
        self.host = host
        self.pinned = pinned
        self.seen = seen
        super().__init__(
            f"host {host!r} presents key {fingerprint_of(seen)}, but {fingerprint_of(pinned)} "
            f"is pinned: refused (if the change is deliberate: `evergraph hosts forget {host}` "
            "or `evergraph hosts trust NAME KEY`)"
        )


def fingerprint_of(ident: str) -> str:
    """The fingerprint of an identity string (over both of its keys)."""
    return fingerprint(ident.replace(":", ""))


class HostPin:
    """A pinned host key. (A plain class, not a dataclass: a dataclass's generated
    methods are compiled at import, ~1 ms of every start.)"""

    __slots__ = ("host", "how", "public", "verify")

    def __init__(self, host: str, public: str, verify: str, how: str) -> None:
        self.host = host
        self.public = public
        self.verify = verify
        #: "first-use" or "explicit"
        self.how = how

    def _key(self) -> tuple[str, str, str, str]:
        return (self.host, self.public, self.verify, self.how)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HostPin) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (
            f"HostPin(host={self.host!r}, public={self.public!r}, verify={self.verify!r}, "
            f"how={self.how!r})"
        )

    @property
    def identity(self) -> str:
        return identity(self.public, self.verify)


class Pins:
    """The pins of one state dir. Thread-safe (a Python graph reads from a thread);
    every change is written through at once, so another process (`evergraph hosts`)
    sees it and a crash loses nothing."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / FILE
        self._lock = threading.RLock()
        self._listeners: list[PinsListener] = []
        #: changes read from the file (another process's) not yet told to listeners
        self._unsaid_hosts: set[str] = set()
        self._unsaid_deployers = False
        self._mtime: int | None = None
        self.hosts: dict[str, HostPin] = {}
        self.deployers: list[str] = []
        #: how many times this object wrote the file (a first sync of N hosts must
        #: write it once, not N times: benchmarks and tests count)
        self.saves = 0
        self.reload()
        self._unsaid_hosts.clear()  # the first read: nothing changed for anyone
        self._unsaid_deployers = False

    def reload(self) -> None:
        """Read the file again (raises PinsError for a bad one)."""
        with self._lock:
            self._load()

    def listen(self, fn: PinsListener) -> Callable[[], None]:
        """Call `fn(hosts, deployers)` when `poll()` finds the file changed by someone
        else; returns the unsubscribe function."""
        self._listeners.append(fn)
        return lambda: self._listeners.remove(fn)

    def poll(self) -> None:
        """Pick up a change of the file (the agent calls this on every inotify event
        for it) and tell the listeners what changed. A file that no longer parses is
        logged once per change and the pins in memory stay in force."""
        with self._lock:
            try:
                self._refresh()
            except PinsError as e:
                log.error("%s: keeping the pins read before", e)
                with contextlib.suppress(OSError):
                    self._mtime = self.path.stat().st_mtime_ns
            hosts, self._unsaid_hosts = frozenset(self._unsaid_hosts), set()
            deployers, self._unsaid_deployers = self._unsaid_deployers, False
        if not hosts and not deployers:
            return
        log.info(
            "pins changed: %s%s",
            ", ".join(sorted(hosts)) or "no host",
            "; trusted deployers changed" if deployers else "",
        )
        for fn in list(self._listeners):
            fn(hosts, deployers)

    def _load(self) -> None:
        try:
            st = self.path.stat()
            raw = self.path.read_bytes()
        except FileNotFoundError:
            self._note(self.hosts, {}, self.deployers, [])
            self.hosts, self.deployers, self._mtime = {}, [], None
            return
        except OSError as e:
            raise PinsError(f"{self.path}: cannot read: {e.strerror}") from None
        import json  # (with a pins file: most hosts never write one)

        try:
            data = json.loads(raw)
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            hosts: dict[str, HostPin] = {}
            for host, rec in dict(data.get("hosts", {})).items():
                if not isinstance(rec, dict):
                    raise ValueError(f"hosts.{host}: not an object")
                public, verify = parse_identity(f"{rec.get('public', '')}:{rec.get('verify', '')}")
                how = rec.get("how", "explicit")
                hosts[str(host)] = HostPin(str(host), public, verify, str(how))
            deployers = [check_verify_key(str(k)) for k in list(data.get("deployers", []))]
        except (ValueError, TypeError) as e:
            raise PinsError(
                f"{self.path}: not a pins file ({e}); fix or remove it "
                "(removing it re-trusts the next keys seen)"
            ) from None
        self._note(self.hosts, hosts, self.deployers, deployers)
        self.hosts, self.deployers, self._mtime = hosts, deployers, st.st_mtime_ns

    def _note(
        self,
        old: dict[str, HostPin],
        new: dict[str, HostPin],
        old_deployers: list[str],
        new_deployers: list[str],
    ) -> None:
        self._unsaid_hosts |= {h for h in old.keys() | new.keys() if old.get(h) != new.get(h)}
        if old_deployers != new_deployers:
            self._unsaid_deployers = True

    def _refresh(self) -> None:
        """Pick up another process's change (cheap: one stat)."""
        try:
            mtime: int | None = self.path.stat().st_mtime_ns
        except FileNotFoundError:
            mtime = None
        if mtime != self._mtime:
            self._load()

    def _save(self) -> None:
        import json

        data = {
            "hosts": {
                h: {"public": p.public, "verify": p.verify, "how": p.how}
                for h, p in sorted(self.hosts.items())
            },
            "deployers": self.deployers,
        }
        atomic_write(self.path, (json.dumps(data, indent=1) + "\n").encode(), mode=0o600)
        self._mtime = self.path.stat().st_mtime_ns
        self.saves += 1

    # -- hosts ----------------------------------------------------------------------
    def get(self, host: str) -> HostPin | None:
        with self._lock:
            self._refresh()
            return self.hosts.get(host)

    def check(self, host: str, public: str, verify: str) -> HostPin:
        """The pin for `host`, pinning (public, verify) if it has none yet; raises
        IdentityMismatch if another key is pinned."""
        with self._lock:
            self._refresh()
            pin = self.hosts.get(host)
            if pin is None:
                pin = HostPin(host, public, verify, "first-use")
                self.hosts[host] = pin
                self._save()
                return pin
            if (pin.public, pin.verify) != (public, verify):
                raise IdentityMismatch(host, pin.identity, identity(public, verify))
            return pin

    def check_many(self, idents: Iterable[tuple[str, str, str]]) -> list[IdentityMismatch]:
        """`check` for many (host, public, verify) at once, in order, writing the file
        once: what a first read of `hostkeys/` pins (a write per host made pinning N
        hosts cost O(N²): minutes at 10,000). Returns the mismatches, in order."""
        mismatches: list[IdentityMismatch] = []
        with self._lock:
            self._refresh()
            added = False
            for host, public, verify in idents:
                pin = self.hosts.get(host)
                if pin is None:
                    self.hosts[host] = HostPin(host, public, verify, "first-use")
                    added = True
                elif (pin.public, pin.verify) != (public, verify):
                    mismatches.append(
                        IdentityMismatch(host, pin.identity, identity(public, verify))
                    )
            if added:
                self._save()
        return mismatches

    def trust(self, host: str, ident: str) -> HostPin:
        """Pin `ident` (`public:verify`) for `host` explicitly (ValueError if malformed)."""
        public, verify = parse_identity(ident)
        with self._lock:
            self._refresh()
            pin = HostPin(host, public, verify, "explicit")
            self.hosts[host] = pin
            self._save()
            return pin

    def forget(self, host: str) -> bool:
        with self._lock:
            self._refresh()
            if self.hosts.pop(host, None) is None:
                return False
            self._save()
            return True

    # -- deployers -------------------------------------------------------------------
    def trusted_deployers(self) -> list[str]:
        with self._lock:
            self._refresh()
            return list(self.deployers)

    def add_deployer(self, verify_b64: str) -> None:
        key = check_verify_key(verify_b64)
        with self._lock:
            self._refresh()
            if key not in self.deployers:
                self.deployers.append(key)
                self._save()

    def remove_deployer(self, verify_b64: str) -> bool:
        """Stop trusting a deployer; False if it was not trusted."""
        key = check_verify_key(verify_b64)
        with self._lock:
            self._refresh()
            if key not in self.deployers:
                return False
            self.deployers.remove(key)
            self._save()
            return True
