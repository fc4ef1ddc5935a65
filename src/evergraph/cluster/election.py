"""Leader election on the World, with fenced writes.

Leadership of `<name>` is the key `election/<name>`, holding the leader's
name, put under the leader's own lease with "the key must not exist"
(`txn([Compare(key, 0)], [Put(key, me, lease)])`): of the candidates that see
the key vanish, exactly one creates it. The key lives as long as the lease:
a leader that dies stops its keep-alives and the key expires within the TTL,
and the others campaign again.

`term` is the key's mod revision while we hold it. A write that must come
from the current leader only goes through `fenced(ops)`, one txn comparing
the key's mod revision with our term: a deposed leader that still believes
it leads (paused, partitioned, its keep-alive late) has a stale term, and the
World refuses its write. `is_leader` is a belief, the fence is the guarantee.

`Election.run()` (owned by the caller's TaskGroup) does all of it until
cancelled:

- keeps the lease alive every ttl/3. A keep-alive answered with LeaseExpired
  steps down at once (is_leader is False before anything else happens), then
  a new lease is granted; a leader that has not renewed its lease for `ttl`
  (the World unreachable) steps down too, and leads again if a late renewal
  shows the key still ours;
- follows the key with `watch_one` (broken streams, compaction and a
  replaced World handled there): who leads (`leader()`), whether it is us,
  and when the key vanishes, a campaign;
- when cancelled, steps down and revokes the lease, so the key vanishes at
  once and another candidate takes over without waiting for the TTL.

`resign()` hands leadership over: it steps down, revokes the lease (the key
goes with it) and sits out campaigns until another candidate leads, or for
`ttl` if none does (a sole candidate then takes it back).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from evergraph._util.clock import SYSTEM, Clock
from evergraph._util.tasks import first_of
from evergraph.world.follow import Tombstone, watch_one
from evergraph.world.kv import (
    KV,
    Compare,
    Delete,
    KeyValue,
    LeaseExpired,
    Put,
    WorldError,
    log,
)

ELECTIONS = "election/"
#: why a candidate steps down when it is cancelled (its agent stops)
STOPPED = "stopped"

#: first and longest wait before retrying a World that failed (seconds)
_RETRY_FIRST, _RETRY_MAX = 0.05, 2.0


def election_key(name: str) -> str:
    return f"{ELECTIONS}{name}"


class Election:
    """One candidate for leadership of `name`, known to the others as `me`.

    Create it inside the running event loop; run `run()` in a task. `me` should
    be unique among the candidates (a host name): leadership is recognised by
    our own lease, `me` is what the others see in `leader()`."""

    def __init__(
        self, kv: KV, name: str, me: str, ttl: float = 10.0, clock: Clock = SYSTEM
    ) -> None:
        if ttl <= 0:
            raise ValueError("an election's ttl must be positive")
        self.kv = kv
        self.name = name
        self.me = me
        self.ttl = ttl
        self.clock = clock
        self.key = election_key(name)
        self._value = me.encode()
        #: our lease (0: none at the moment) and until when (clock.monotonic) we
        #: know it is alive: ttl after the last keep-alive that succeeded was sent
        self._lease = 0
        #: the epoch of the World the lease was granted in (see kv.py)
        self._lease_epoch = kv.epoch
        self._valid_until = 0.0
        self._lease_lock = asyncio.Lock()
        #: the key as last seen (None: not yet read)
        self._snap: KeyValue | Tombstone | None = None
        self._term = 0
        self._term_epoch = 0
        #: after resign(): until when (clock.monotonic) we make no campaign, and
        #: the lease we resigned (its key, still seen, is not "another candidate")
        self._sit_out: tuple[float, int] | None = None
        self._leading = asyncio.Event()
        self._not_leading = asyncio.Event()
        self._not_leading.set()
        self._changed = asyncio.Event()
        self._poke = asyncio.Event()  # look whether to campaign
        self._renewed = asyncio.Event()  # _valid_until moved

    # -- what callers see ---------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        """Whether we believe we lead (see `fenced` for what a belief is worth)."""
        return self._term != 0

    @property
    def term(self) -> int:
        """The mod revision of the leader key while we hold it; 0 otherwise."""
        return self._term

    def leader(self) -> str | None:
        """Who leads, as last seen (None: nobody, or not read yet)."""
        snap = self._snap
        if not isinstance(snap, KeyValue):
            return None
        return snap.value.decode("utf-8", "replace")

    async def wait_leader(self) -> None:
        """Return once we lead (at once if we do)."""
        await self._leading.wait()

    async def wait_lost(self) -> None:
        """Return once we do not lead (at once if we do not)."""
        await self._not_leading.wait()

    async def wait_change(self) -> None:
        """Return at the next news: a new snapshot of the leader key, or a change of
        `is_leader`/`term` (what changed may be nothing the caller looks at: check)."""
        await self._changed.wait()

    async def fenced(self, ops: Sequence[Put | Delete], compares: Sequence[Compare] = ()) -> bool:
        """Apply `ops` in one txn only if we still hold the leader key at our term
        (and every one of `compares` holds too); False (nothing written) if not:
        we do not lead or were deposed, whatever we believed, or a compare failed.
        A WorldError (the World unreachable, an outcome unknown) is raised."""
        term, epoch = self._term, self._term_epoch
        if any(op.key == self.key for op in ops):
            raise ValueError(f"a fenced write may not change the leader key {self.key}")
        if not term or self.kv.epoch != epoch:
            return False  # (another World's revisions say nothing about ours)
        return await self.kv.txn([Compare(self.key, term), *compares], ops) is not None

    async def lead(self, work: Callable[[], Coroutine[Any, Any, None]], what: str) -> None:
        """Run `work()` whenever we lead, cancelling it as soon as we do not; until
        cancelled. An exception from `work` ends `lead` with it."""
        while True:
            await self.wait_leader()
            log.info("world: %s: leading %s (term %d)", self.me, what, self.term)
            await first_of(work(), self.wait_lost())  # an exception from work ends us
            log.info("world: %s: no longer leading %s", self.me, what)

    async def resign(self) -> None:
        """Step down and let another candidate lead: our lease is revoked (the key
        goes with it) and we sit out campaigns until someone else leads, or for
        `ttl` if nobody does. Does nothing if we do not lead."""
        if not self._term:
            return
        lease = self._lease
        self._sit_out = (self.clock.monotonic() + self.ttl, lease)
        self._drop_lease(lease, "resigned")
        with contextlib.suppress(WorldError):
            await self.kv.revoke(lease)  # if it fails, the lease expires within the TTL

    # -- the campaign ---------------------------------------------------------------
    async def run(self) -> None:
        """Campaign and hold leadership until cancelled (or until `kv` is closed)."""
        try:
            await self._ensure_lease()
            async with asyncio.TaskGroup() as tg:
                tasks = [
                    tg.create_task(self._keepalive(), name=f"election-{self.name}-keepalive"),
                    tg.create_task(self._deadline(), name=f"election-{self.name}-deadline"),
                    tg.create_task(self._campaign(), name=f"election-{self.name}-campaign"),
                ]
                await self._follow()  # ends only when the KV is closed
                for t in tasks:
                    t.cancel()
        finally:
            lease = self._lease
            self._drop_lease(lease, STOPPED)
            if lease:
                with contextlib.suppress(WorldError):
                    await self.kv.revoke(lease)  # the others need not wait for the TTL

    async def _follow(self) -> None:
        async with contextlib.aclosing(watch_one(self.kv, self.key)) as snaps:
            async for snap in snaps:
                self._snap = snap
                if (
                    self._sit_out is not None
                    and isinstance(snap, KeyValue)
                    and snap.lease != self._sit_out[1]
                ):
                    self._sit_out = None  # another candidate took over
                self._consider()
                self._notify()
                if self._vacant():
                    self._poke.set()

    def _vacant(self) -> bool:
        """Whether we should campaign: the key was last seen absent, and we do not
        sit out after a resignation."""
        if not isinstance(self._snap, Tombstone):
            return False
        if self._sit_out is not None:
            if self.clock.monotonic() < self._sit_out[0]:
                return False
            self._sit_out = None  # nobody took over: we may lead again
        return True

    async def _campaign(self) -> None:
        retry = _RETRY_FIRST
        while True:
            await self._poke.wait()
            self._poke.clear()
            if not self._vacant():
                continue
            lease = await self._ensure_lease()
            try:
                # a loss needs nothing more: the watch shows the winner's key
                await self.kv.txn([Compare(self.key, 0)], [Put(self.key, self._value, lease)])
            except LeaseExpired:
                self._drop_lease(lease, "its lease expired")
                self._poke.set()  # again, under a new lease
                continue
            except WorldError as e:
                # maybe applied: then the watch shows our key, and it is ours by lease
                log.warning("world: election %s: campaign failed: %s", self.name, e)
                await self.clock.sleep(retry)
                retry = min(retry * 2, _RETRY_MAX)
                self._poke.set()
                continue
            retry = _RETRY_FIRST

    # -- the lease -----------------------------------------------------------------
    async def _ensure_lease(self) -> int:
        """Our lease, granted anew if we have none (retried until the World answers)."""
        async with self._lease_lock:
            retry = _RETRY_FIRST
            while not self._lease:
                sent = self.clock.monotonic()
                epoch = self.kv.epoch
                try:
                    lease = await self.kv.grant(self.ttl)
                except WorldError as e:
                    log.warning("world: election %s: cannot grant a lease: %s", self.name, e)
                    await self.clock.sleep(retry)
                    retry = min(retry * 2, _RETRY_MAX)
                    continue
                self._lease = lease
                self._lease_epoch = epoch
                self._renew(sent)
            return self._lease

    def _drop_lease(self, lease: int, why: str) -> None:
        """Step down (first of all) and forget `lease`, if it is still ours."""
        if lease and lease == self._lease:
            self._set_term(0, why)
            self._lease = 0
            self._valid_until = 0.0
            self._notify()

    def _renew(self, sent: float) -> None:
        self._valid_until = max(self._valid_until, sent + self.ttl)
        self._renewed.set()
        self._consider()

    async def _keepalive(self) -> None:
        while True:
            await self.clock.sleep(self.ttl / 3)
            if self._lease and self.kv.epoch != self._lease_epoch:
                # granted in a World since replaced: the id is someone else's there
                self._drop_lease(self._lease, "the World was replaced")
            lease = await self._ensure_lease()
            sent = self.clock.monotonic()
            try:
                await self.kv.keepalive(lease)
            except LeaseExpired:
                self._drop_lease(lease, "its lease expired")
                await self._ensure_lease()
            except WorldError as e:
                log.warning("world: election %s: keep-alive failed: %s", self.name, e)
            else:
                if lease == self._lease:
                    self._renew(sent)
            if self._vacant():  # a missed change, or a sit-out that ended
                self._poke.set()

    async def _deadline(self) -> None:
        """Step down when the lease was not renewed for `ttl`: it may be gone."""
        while True:
            left = self._valid_until - self.clock.monotonic()
            if left > 0:
                await self.clock.sleep(left)
                continue
            self._renewed.clear()
            self._consider()
            if self._valid_until - self.clock.monotonic() <= 0:
                await self._renewed.wait()

    # -- state ---------------------------------------------------------------------
    def _consider(self) -> None:
        """Whether we lead: the key as last seen is ours (our lease, our name) and
        the lease is known to be alive."""
        snap = self._snap
        ours = (
            isinstance(snap, KeyValue)
            and self._lease != 0
            and snap.lease == self._lease
            and snap.value == self._value
        )
        if not ours:
            self._set_term(
                0,
                "another candidate holds the key"
                if isinstance(snap, KeyValue)
                else "the key vanished",
            )
        elif self.clock.monotonic() >= self._valid_until:
            self._set_term(0, f"its lease was not renewed for {self.ttl:g} s")
        else:
            assert isinstance(snap, KeyValue)
            self._set_term(snap.mod_revision)

    def _set_term(self, term: int, why: str = "") -> None:
        if term == self._term:
            return
        was = self._term
        self._term = term
        self._term_epoch = self.kv.epoch
        if term:
            self._not_leading.clear()
            self._leading.set()
            log.info("world: election %s: %s leads (term %d)", self.name, self.me, term)
        else:
            self._leading.clear()
            self._not_leading.set()
            # a stop we were asked for is news, not trouble
            log.log(
                logging.INFO if why == STOPPED else logging.WARNING,
                "world: election %s: %s steps down after term %d%s",
                self.name,
                self.me,
                was,
                f": {why}" if why else "",
            )
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
