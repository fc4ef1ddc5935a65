"""The keys this host may use for other hosts: `hostkeys/<host>` records in the
World, each checked by a `HostKeyBook`, so a swapped key in the World is refused,
never used to seal or to verify; the book also defends this host's own record (a
changed or deleted one is put back). Exports (cluster/exports/) seal to and verify
with the keys it trusts.

How a record is checked depends on the World (SPEC 4.7):

- with a cluster CA (a self-forming etcd World, cluster/ca.py): a record is
  accepted only with the CA's certificate that its hostname owns its keys (the
  record's `cert`); nothing is pinned, so a host that starts while another is
  away cannot be fooled by a key an attacker wrote into `hostkeys/` meanwhile;
- without one (sqlite, a hand-built etcd): trust on first use against this
  host's pins (cluster/pins.py).

In both, an explicit pin (`evergraph hosts trust NAME KEY`) wins over the World.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from evergraph.cluster.hostkeys import HostKeys, KeyError_, fingerprint, identity
from evergraph.cluster.pins import IdentityMismatch, Pins, PinsError, fingerprint_of
from evergraph.world.follow import Follower, follow
from evergraph.world.kv import KV, KeyValue, WorldError

if TYPE_CHECKING:  # (cryptography costs start-up time a World without a CA need not pay)
    from evergraph.cluster.ca import ClusterCA

log = logging.getLogger("evergraph.exports")

HOSTKEYS = "hostkeys/"


class HostKeyRecord(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    host: str
    public: str
    verify: str
    #: the cluster CA's certificate (PEM) that `host` owns these keys; "" in a World
    #: without a CA (omitted then: such a record is byte for byte what it was)
    cert: str = ""


_keys_decoder = msgspec.json.Decoder(HostKeyRecord)


def decode_hostkeys(kv: KeyValue) -> HostKeyRecord:
    """The record at `hostkeys/<host>`; ValueError (naming the key) for a bad one."""
    try:
        rec = _keys_decoder.decode(kv.value)
    except msgspec.DecodeError as e:
        raise ValueError(f"{kv.key}: not a host key record: {e}") from None
    if f"{HOSTKEYS}{rec.host}" != kv.key:
        raise ValueError(f"{kv.key}: record names another host {rec.host!r}")
    return rec


class HostKeyBook(Follower[HostKeyRecord]):
    """The keys this host may use for others: `hostkeys/<host>` records as the World
    has them, each checked.

    Without a cluster CA (`ca` None): trust on first use. The first key seen for a
    host is pinned; a different one is refused with one error naming the host and
    both fingerprints (once per change of the record), and the pinned key stays in
    use.

    With a cluster CA: a host's key is trusted only if its record carries a
    certificate of that CA for that hostname and exactly those keys, not revoked
    (`revoked()`: the serials revoked now). Nothing is pinned, and pins made on
    first use (before the World had a CA) are not consulted. A refused record is
    one error naming the host, the key's fingerprint and why (once per change of
    the record); the key trusted before (if any) stays in use until a valid record
    replaces it, unless its own certificate is revoked: then it is dropped at once.
    `recheck()` judges every host again (after the revocation list changed).

    In both, an explicit pin (`hosts trust NAME KEY`) wins over the World: the
    operator's word for that host, whatever its record says.

    `trusted(host)` is the (public, verify) pair to seal for and verify with, or
    None. Listeners are called when a host's trusted key may have changed.

    Given this host's `own` keys, the book also defends `hostkeys/<me>`: a record
    that names another key, is garbage or is deleted (or lost `own_cert`, this
    host's certificate) is put back at once, with one error naming what was found
    (so a host that joins later finds the real key while this one is up)."""

    def __init__(
        self,
        kv: KV,
        pins: Pins,
        me: str,
        own: HostKeys | None = None,
        ca: ClusterCA | None = None,
        own_cert: bytes | None = None,
        revoked: Callable[[], Collection[int]] = lambda: (),
    ) -> None:
        self.kv = kv
        self.pins = pins
        self.me = me
        self.own = own
        self.ca = ca
        self.own_cert = own_cert
        self.revoked = revoked
        #: set when our own record must be written again
        self._restore = asyncio.Event()
        #: how many times our own record was found changed or gone (tests)
        self.alarms = 0
        #: host -> the record the World has now
        self.seen: dict[str, HostKeyRecord] = {}
        self._listeners: list[Callable[[str], None]] = []
        self.ready = asyncio.Event()
        #: records of the batch being reported, pinned at its end
        self._batch: list[HostKeyRecord] = []
        #: with a CA: host -> the certified key trusted now (public, verify, serial)
        self._certified: dict[str, tuple[str, str, int]] = {}
        #: with a CA: host -> the record judged last and why it was refused (None:
        #: accepted), so that a refusal is logged once per change, not per look
        self._judged: dict[str, tuple[HostKeyRecord, str | None]] = {}
        # a pin trusted or forgotten by the operator: verify that host's records again
        pins.listen(self._pins_changed)

    def _pins_changed(self, hosts: frozenset[str], deployers: bool) -> None:
        for host in sorted(hosts):
            if host != self.me:
                self._tell(host)

    def listen(self, fn: Callable[[str], None]) -> Callable[[], None]:
        self._listeners.append(fn)
        return lambda: self._listeners.remove(fn)

    async def run(self) -> None:
        if self.own is None:
            await follow(self.kv, HOSTKEYS, self)
            return
        async with asyncio.TaskGroup() as tg:
            tg.create_task(follow(self.kv, HOSTKEYS, self))
            tg.create_task(self._defend(self.own))

    async def _defend(self, own: HostKeys) -> None:
        delay = 0.05
        while True:
            await self._restore.wait()
            self._restore.clear()
            try:
                await publish_hostkeys(self.kv, own, self.me, alarm=False, cert=self.own_cert)
                delay = 0.05
            except WorldError as e:
                log.warning(
                    "hostkeys/%s: cannot restore (%s); retrying in %.2fs", self.me, e, delay
                )
                self._restore.set()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _is_ours(self, rec: HostKeyRecord) -> bool:
        """Our own record as we wrote it: our keys, and our certificate if we have one."""
        assert self.own is not None
        if (rec.public, rec.verify) != self.own.pair():
            return False
        return self.own_cert is None or rec.cert == self.own_cert.decode()

    def _alarm(self, found: HostKeyRecord | None) -> None:
        assert self.own is not None
        self.alarms += 1
        ours = fingerprint_of(f"{self.own.public}:{self.own.verify}")
        if found is None:
            log.error(
                "ALARM: hostkeys/%s was deleted or replaced by garbage behind this host's "
                "back; restoring this host's key %s",
                self.me,
                ours,
            )
        elif (found.public, found.verify) == self.own.pair():
            log.error(
                "ALARM: hostkeys/%s names this host's key %s but %s: someone else wrote "
                "it; restoring this host's record",
                self.me,
                ours,
                "without its certificate" if not found.cert else "with another certificate",
            )
        else:
            log.error(
                "ALARM: hostkeys/%s names key %s, not this host's %s: someone else wrote it; "
                "restoring this host's key",
                self.me,
                fingerprint_of(f"{found.public}:{found.verify}"),
                ours,
            )
        self._restore.set()

    def trusted(self, host: str) -> tuple[str, str] | None:
        """The (public, verify) of `host` to seal for and verify with, or None: the
        explicit pin if there is one; else with a CA the certified key, without one
        the pinned key (pinning the World's record on first use)."""
        try:
            pin = self.pins.get(host)
            if self.ca is not None:
                if pin is not None and pin.how == "explicit":
                    return pin.public, pin.verify
                if host == self.me and self.own is not None:
                    return self.own.pair()
                got = self._certified.get(host)
                return (got[0], got[1]) if got is not None else None
            if pin is not None:
                return pin.public, pin.verify
            rec = self.seen.get(host)
            if rec is None:
                return None
            pin = self.pins.check(host, rec.public, rec.verify)
            log.info("pinned the key of host %s: %s", host, fingerprint(rec.verify))
            return pin.public, pin.verify
        except PinsError as e:
            log.error("%s", e)
            return None
        except IdentityMismatch:  # a pin appeared meanwhile (another process)
            return self.trusted(host)

    # -- with a cluster CA ------------------------------------------------------------
    def _why_refused(self, rec: HostKeyRecord, revoked: Collection[int]) -> str | None:
        """Why the CA does not vouch for `rec`; None if it does."""
        assert self.ca is not None
        if not rec.cert:
            return "no certificate"
        return self.ca.check_host_cert(rec.cert.encode(), rec.host, rec.public, rec.verify, revoked)

    def _judge(self, rec: HostKeyRecord, revoked: Collection[int]) -> None:
        """Trust `rec`'s key if the CA certifies it; else log why (once per change)."""
        from evergraph.cluster.ca import serial_of  # (imported already: we hold a CA)

        host = rec.host
        why = self._why_refused(rec, revoked)
        before = self._judged.get(host)
        self._judged[host] = (rec, why)
        fp = fingerprint_of(identity(rec.public, rec.verify))
        if why is None:
            cert = (rec.public, rec.verify, serial_of(rec.cert.encode()))
            was = self._certified.get(host)
            if was != cert:
                self._certified[host] = cert
                # (a first sight is debug: a first read of 10,000 hosts is no news)
                log.log(
                    logging.DEBUG if was is None else logging.INFO,
                    "trusting the key of host %s: %s (certified by the cluster CA)",
                    host,
                    fp,
                )
            return
        if before != (rec, why):
            kept = self._certified.get(host)
            log.error(
                "hostkeys/%s: key %s refused: %s (a host key is trusted only with a "
                "certificate of the cluster CA for that hostname)%s",
                host,
                fp,
                why,
                f"; still trusting {fingerprint_of(identity(kept[0], kept[1]))}"
                if kept is not None and kept[2] not in revoked
                else "",
            )
        self._drop_revoked(host, revoked)

    def _drop_revoked(self, host: str, revoked: Collection[int]) -> None:
        cur = self._certified.get(host)
        if cur is not None and cur[2] in revoked:
            del self._certified[host]
            log.error(
                "host %s: the certificate of its key %s is revoked: no longer trusted",
                host,
                fingerprint_of(identity(cur[0], cur[1])),
            )

    def recheck(self) -> None:
        """Judge every host's key again (with a CA; e.g. after the revocation list
        changed): a key whose certificate is revoked is no longer trusted, at once.
        The listeners are told of each host whose trusted key changed."""
        if self.ca is None:
            return
        revoked = frozenset(self.revoked())
        for host in sorted(self.seen.keys() | self._certified.keys()):
            before = self._certified.get(host)
            rec = self.seen.get(host)
            if rec is not None and (host != self.me or self.own is None):
                self._judge(rec, revoked)
            else:
                self._drop_revoked(host, revoked)
            if self._certified.get(host) != before:
                self._tell(host)

    # follower callbacks: a batch's records are pinned (or judged) together (one
    # write of the pins file for a first read of N hosts), then the listeners are told
    def decode(self, kv: KeyValue) -> HostKeyRecord:
        return decode_hostkeys(kv)

    async def new(self, obj: HostKeyRecord) -> None:
        if obj.host == self.me and self.own is not None and not self._is_ours(obj):
            self._alarm(obj)
        self.seen[obj.host] = obj
        self._batch.append(obj)

    async def updated(self, prev: HostKeyRecord, new: HostKeyRecord) -> None:
        await self.new(new)

    async def deleted(self, prev: HostKeyRecord) -> None:
        # (with a CA, the key trusted stays: a down host's exports stay verifiable)
        self.seen.pop(prev.host, None)
        if prev.host == self.me and self.own is not None:
            self._alarm(None)

    async def batch_done(self) -> None:
        batch, self._batch = self._batch, []
        if self.ca is not None:
            revoked = frozenset(self.revoked())
            for rec in batch:
                if rec.host != self.me or self.own is None:
                    self._judge(rec, revoked)
        else:
            others = [(r.host, r.public, r.verify) for r in batch if r.host != self.me]
            try:
                for e in self.pins.check_many(others):
                    log.error("hostkeys/%s: %s", e.host, e)
            except PinsError as e:
                log.error("%s", e)
        for rec in batch:
            self._tell(rec.host)

    async def synced(self) -> None:
        self.ready.set()

    def _tell(self, host: str) -> None:
        for fn in list(self._listeners):
            fn(host)


async def publish_hostkeys(
    kv: KV, keys: HostKeys, host: str, alarm: bool = True, cert: bytes | None = None
) -> None:
    """Write `hostkeys/<host>` (no lease: a down host's exports stay verifiable),
    with `cert`, the cluster CA's certificate of these keys, if given.
    `alarm`: log an error if the World held another key for this host."""
    rec = HostKeyRecord(
        host=host, public=keys.public, verify=keys.verify, cert=cert.decode() if cert else ""
    )
    cur = await kv.get(f"{HOSTKEYS}{host}")
    value = msgspec.json.encode(rec)
    if cur is None or cur.value != value:
        if alarm and cur is not None:
            try:
                found = decode_hostkeys(cur)
                what = fingerprint_of(f"{found.public}:{found.verify}")
                same = (found.public, found.verify) == (keys.public, keys.verify)
            except ValueError:
                what, same = "(not a host key record)", False
            if not same:
                log.error(
                    "ALARM: hostkeys/%s named key %s, not this host's %s: someone else "
                    "wrote it; restoring this host's key",
                    host,
                    what,
                    fingerprint_of(f"{keys.public}:{keys.verify}"),
                )
        await kv.put(f"{HOSTKEYS}{host}", value)


def load_cluster_trust(state_dir: Path) -> tuple[ClusterCA | None, bytes | None]:
    """The cluster CA this state dir holds (None: a World without one, trust on first
    use) and this host's certificate (`host.crt`; None if not issued yet). The CA's
    module (cryptography) is imported only when there is a CA: a start without one
    does not pay for it. KeyError_ (one line naming the file) for a damaged file."""
    # (ca.CLUSTER_DIR and ca.CA_CERT, spelled out: importing them costs the import)
    if not (state_dir / "cluster" / "ca.crt").exists():
        return None, None
    try:
        from evergraph.cluster.ca import HOST_CERT, CAError, ClusterCA, cluster_dir
    except ImportError as e:  # a remote agent's lean bundle has no cryptography
        raise KeyError_(
            f"{state_dir / 'cluster' / 'ca.crt'}: a cluster CA needs the {e.name or 'cryptography'}"
            " package, which this evergraph lacks (a remote agent's bundle leaves it out):"
            " run this host's agent from a full installation (`evergraph remote --install`)"
        ) from None

    directory = cluster_dir(state_dir)
    try:
        ca = ClusterCA.load(directory)
    except CAError as e:
        raise KeyError_(str(e)) from None
    path = directory / HOST_CERT
    try:
        cert: bytes | None = path.read_bytes()
    except FileNotFoundError:
        cert = None
    except OSError as e:
        raise KeyError_(f"{path}: {e.strerror}") from None
    return ca, cert
