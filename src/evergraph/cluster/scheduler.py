"""The scheduler: which hosts hold a role, decided by one elected leader.

Hosts volunteer for a namespace `NS`; one of them, elected, chooses up to
`max` of the volunteers and publishes the choice. Keys:

    scheduler/NS/volunteers/HOST  JSON options as given by HOST, under HOST's own
                                  lease (`ttl` s, kept alive while HOST volunteers)
    scheduler/NS/withdrawn/HOST   HOST withdrew on purpose (see persist, below)
    scheduler/NS/chosen           JSON: the sorted hosts, the options in force
                                  (strategy, max, persist) and a version
    election/scheduler-NS         the leader (cluster/election.py)

Every volunteer is a candidate of the election `scheduler-NS` (same TTL). The
leader follows `scheduler/NS/` and, after every change, computes the choice
from the volunteers, the choice in force and its OWN options (the leader
decides; a volunteer whose options differ is named in a warning). It writes
the choice only when it differs (hosts or options; the version then goes up
by one), FENCED by its term and conditioned on the revision of the choice it
read: a deposed leader never overwrites its successor, and a choice changed
meanwhile is decided again from the news. A leader decides only while it sees
its own volunteer record.

Strategies (pure: `choose`):

- `rr`, stable round-robin: the hosts already chosen that still volunteer stay
  chosen; free places go to the other volunteers in name order. A host joining
  takes nobody's place; a host leaving is replaced by the next one free.
- `alpha`: the first `max` volunteers in name order (a new host that sorts
  first displaces the last chosen one).

`ttl` is how long a volunteer's record outlives its agent: an agent that dies
(or stops without `withdraw`) stays a volunteer, and chosen, for up to `ttl`
seconds; a restart within the TTL writes the record again under a new lease,
so the role does not move.

`persist`: a chosen host stays chosen when its volunteer record vanishes (its
agent down, restarting, cut off): the role never moves because a host went
away. Such a host leaves the choice only when it withdraws on purpose (a
`withdraw` volunteer leaving writes `withdrawn/HOST`, which the leader
consumes), when a `max` lowered below the number chosen drops it (hosts still
volunteering are kept first), with `alpha` when volunteers that sort before
it fill the places, or when the choice is reset by hand
(`evergraph world del scheduler/NS/chosen`: the next decision starts afresh).

`withdraw`: a volunteer that stops (its resource left the graph, or the agent
stops) deletes its record at once, instead of letting it expire with the TTL.

A namespace nobody volunteers for keeps its last choice (nobody leads to
change it). `chosen(kv, ns)` reads the choice; `watch_chosen(kv, ns)` streams
it (on `watch_one`: resumed and resynced like every World follow).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence

import msgspec

from evergraph._util.clock import SYSTEM, Clock
from evergraph._util.tasks import first_of
from evergraph.cluster.election import Election
from evergraph.world.follow import (
    BACKOFF_FIRST,
    BACKOFF_MAX,
    Follower,
    Tombstone,
    follow,
    watch_one,
)
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

SCHEDULER = "scheduler/"
STRATEGIES = ("rr", "alpha")
DEFAULT_MAX = 1
DEFAULT_TTL = 10

_NAMESPACE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@:+=-]*")


def namespace_problem(ns: str) -> str | None:
    """Why `ns` cannot name a namespace (None: it can)."""
    if not isinstance(ns, str) or not ns:
        return "a namespace must be a non-empty string"
    if len(ns) > 200:
        return f"{ns[:20]!r}...: a namespace is at most 200 characters"
    if not _NAMESPACE.fullmatch(ns):
        return (
            f"{ns!r} is not a namespace: letters, digits and _ . @ : + = - "
            "(not starting with a punctuation mark)"
        )
    return None


def namespace_prefix(ns: str) -> str:
    return f"{SCHEDULER}{ns}/"


def volunteers_prefix(ns: str) -> str:
    return f"{SCHEDULER}{ns}/volunteers/"


def volunteer_key(ns: str, host: str) -> str:
    return f"{volunteers_prefix(ns)}{host}"


def withdrawn_prefix(ns: str) -> str:
    return f"{SCHEDULER}{ns}/withdrawn/"


def withdrawn_key(ns: str, host: str) -> str:
    return f"{withdrawn_prefix(ns)}{host}"


def chosen_key(ns: str) -> str:
    return f"{SCHEDULER}{ns}/chosen"


def election_name(ns: str) -> str:
    return f"scheduler-{ns}"


# -- records ---------------------------------------------------------------------------


class Options(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """A volunteer's options (its record under `volunteers/`)."""

    strategy: str = "rr"
    max: int = DEFAULT_MAX
    ttl: int = DEFAULT_TTL
    persist: bool = False
    withdraw: bool = False

    def problem(self) -> tuple[str, str] | None:
        """(field, why) for the first bad value; None if all are good."""
        if self.strategy not in STRATEGIES:
            return "strategy", f"{self.strategy!r} is not a strategy: {' or '.join(STRATEGIES)}"
        if isinstance(self.max, bool) or self.max < 1:
            return "max", f"must be at least 1 (hosts to choose), not {self.max!r}"
        if isinstance(self.ttl, bool) or self.ttl < 1:
            return "ttl", f"must be at least 1 (seconds), not {self.ttl!r}"
        return None

    def decision(self) -> tuple[str, int, bool]:
        """The options that shape a choice (the others are each volunteer's own)."""
        return (self.strategy, self.max, self.persist)


class Chosen(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """The choice in force (`chosen`): hosts in name order and what decided them."""

    hosts: list[str] = []
    strategy: str = "rr"
    max: int = DEFAULT_MAX
    persist: bool = False
    #: 1 for the first choice, one more at every change
    version: int = 0
    #: the leader that wrote this version (information only)
    leader: str = ""

    def same_choice(self, other: Chosen) -> bool:
        return (self.hosts, self.strategy, self.max, self.persist) == (
            other.hosts,
            other.strategy,
            other.max,
            other.persist,
        )


_options_decoder = msgspec.json.Decoder(Options)
_chosen_decoder = msgspec.json.Decoder(Chosen)


def encode_options(o: Options) -> bytes:
    return msgspec.json.encode(o)


def decode_options(value: bytes, key: str = "") -> Options:
    """ValueError (naming `key`) for a bad record."""
    try:
        o = _options_decoder.decode(value)
    except msgspec.DecodeError as e:
        raise ValueError(f"{key}: not a volunteer record: {e}") from None
    bad = o.problem()
    if bad is not None:
        raise ValueError(f"{key}: bad {bad[0]}: {bad[1]}")
    return o


def encode_chosen(c: Chosen) -> bytes:
    return msgspec.json.encode(c)


def decode_chosen(value: bytes, key: str = "") -> Chosen:
    """ValueError (naming `key`) for a bad record."""
    try:
        c = _chosen_decoder.decode(value)
    except msgspec.DecodeError as e:
        raise ValueError(f"{key}: not a scheduler choice: {e}") from None
    return c


# -- the strategies (pure) -------------------------------------------------------------


def choose(
    strategy: str,
    max_hosts: int,
    volunteers: Iterable[str],
    previous: Sequence[str] = (),
    persist: bool = False,
    withdrawn: Iterable[str] = (),
) -> list[str]:
    """The hosts to choose, in name order.

    `volunteers`: the hosts volunteering now; `previous`: the choice in force;
    `persist`: a previous host that no longer volunteers stays a candidate
    unless it is in `withdrawn` (a host volunteering again is never withdrawn).
    """
    if max_hosts < 1:
        raise ValueError("max must be at least 1")
    live = set(volunteers)
    gone = set(withdrawn) - live
    candidates = set(live)
    if persist:
        candidates |= {h for h in previous if h not in gone}
    if strategy == "alpha":
        return sorted(candidates)[:max_hosts]
    if strategy != "rr":
        raise ValueError(f"unknown strategy {strategy!r}")
    keep = sorted({h for h in previous if h in candidates})
    if len(keep) > max_hosts:
        # fewer places than before: hosts still volunteering first, then by name
        keep = sorted(keep, key=lambda h: (h not in live, h))[:max_hosts]
    for h in sorted(live):
        if len(keep) >= max_hosts:
            break
        if h not in keep:
            keep.append(h)
    return sorted(keep)


def decide(
    options: Options,
    volunteers: Iterable[str],
    current: Chosen | None,
    withdrawn: Iterable[str] = (),
    leader: str = "",
) -> Chosen | None:
    """The choice to write after `current` under `options`; None if it stands."""
    hosts = choose(
        options.strategy,
        options.max,
        volunteers,
        current.hosts if current is not None else (),
        options.persist,
        withdrawn,
    )
    new = Chosen(
        hosts=hosts,
        strategy=options.strategy,
        max=options.max,
        persist=options.persist,
        version=(current.version if current is not None else 0) + 1,
        leader=leader,
    )
    if current is not None and current.same_choice(new):
        return None
    return new


# -- followers -------------------------------------------------------------------------


def _hosts_of(snap: KeyValue | Tombstone | None, key: str) -> list[str]:
    if not isinstance(snap, KeyValue):
        return []
    try:
        return list(decode_chosen(snap.value, key).hosts)
    except ValueError as e:
        log.warning("world: %s", e)
        return []


async def read_chosen(kv: KV, ns: str) -> Chosen | None:
    """The choice record of `ns` (None: none yet, or a bad one, warned about)."""
    key = chosen_key(ns)
    item = await kv.get(key)
    if item is None:
        return None
    try:
        return decode_chosen(item.value, key)
    except ValueError as e:
        log.warning("world: %s", e)
        return None


async def chosen(kv: KV, ns: str) -> list[str]:
    """The hosts chosen in `ns`, in name order ([] if nothing was chosen yet)."""
    c = await read_chosen(kv, ns)
    return list(c.hosts) if c is not None else []


async def watch_chosen(kv: KV, ns: str) -> AsyncGenerator[list[str], None]:
    """The chosen hosts of `ns`: the current ones first, then one list per change
    of the hosts (a new version that chose the same hosts is no news). Ends when
    `kv` is closed."""
    key = chosen_key(ns)
    last: list[str] | None = None
    async with contextlib.aclosing(watch_one(kv, key)) as snaps:
        async for snap in snaps:
            hosts = _hosts_of(snap, key)
            if hosts != last:
                last = hosts
                yield hosts


# -- volunteering and leading ----------------------------------------------------------


class _Records(Follower[KeyValue]):
    """The raw records of a namespace, by key; `changed` set after each batch."""

    def __init__(self) -> None:
        self.items: dict[str, KeyValue] = {}
        self.changed = asyncio.Event()

    def equals(self, a: KeyValue, b: KeyValue) -> bool:
        return a.mod_revision == b.mod_revision and a.value == b.value

    async def new(self, obj: KeyValue) -> None:
        self.items[obj.key] = obj

    async def updated(self, prev: KeyValue, new: KeyValue) -> None:
        self.items[new.key] = new

    async def deleted(self, prev: KeyValue) -> None:
        self.items.pop(prev.key, None)

    async def batch_done(self) -> None:
        self.changed.set()

    async def synced(self) -> None:
        self.changed.set()


class Volunteer:
    """`host` volunteering for namespace `ns` with `options`, until cancelled.

    `run()` (owned by the caller) keeps `volunteers/<host>` written under our own
    lease (kept alive every ttl/3, granted anew and rewritten if it expired, the
    record rewritten if anyone else changed or deleted it), campaigns in the
    election `scheduler-<ns>` and, while leading, decides the choice. When `run()`
    is cancelled the election lease is revoked (another volunteer leads at once)
    and the record is left to expire; `leave(withdraw=True)` deletes it now.

    `on_change` (if given) is called when our record was found wrong or missing
    and when it was rewritten (a resource reports drift with it)."""

    def __init__(
        self,
        kv: KV,
        ns: str,
        host: str,
        options: Options,
        on_change: Callable[[], None] | None = None,
        clock: Clock = SYSTEM,
    ) -> None:
        why = namespace_problem(ns)
        bad = options.problem()
        if why is None and bad is not None:
            why = f"{bad[0]}: {bad[1]}"
        if why is not None:
            raise ValueError(why)
        self.kv = kv
        self.ns = ns
        self.host = host
        self.options = options
        #: the keep-alive's ticks, the retries' backoff and the election's (a fake one in tests)
        self.clock = clock
        self.key = volunteer_key(ns, host)
        self._value = encode_options(options)
        self._on_change = on_change
        self.lease = 0
        #: the epoch of the World the lease was granted in: in another World (a
        #: replaced one) the same id is not ours, so it is never kept alive there
        self._lease_epoch = kv.epoch
        self._replaced = asyncio.Event()
        self._lease_lock = asyncio.Lock()
        self._put_lock = asyncio.Lock()
        self._closed = False
        #: set once our record was seen in the World (and while it is right)
        self.volunteered = asyncio.Event()
        self.election = Election(kv, election_name(ns), host, float(options.ttl), clock)
        #: decisions made, written and refused while leading (tests)
        self.steps = 0
        self.writes = 0
        self.refused = 0
        #: volunteers whose options differ from ours, as last warned about
        self._differ: list[str] = []

    # -- what callers see ----------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        return self.election.is_leader

    async def record_ok(self) -> bool:
        """Whether our record is in the World as we wrote it, under our lease."""
        if not self.lease:
            return False
        item = await self.kv.get(self.key)
        return self._right(item)

    def _right(self, item: KeyValue | Tombstone | None) -> bool:
        return (
            isinstance(item, KeyValue)
            and self.lease != 0
            and self._lease_epoch == self.kv.epoch
            and item.lease == self.lease
            and item.value == self._value
        )

    async def leave(self, withdraw: bool) -> None:
        """Volunteer no more (call once `run()` ended or is ending): with `withdraw`,
        delete the record at once and say so (`withdrawn/<host>`, which a `persist`
        leader needs); otherwise the record expires with its lease."""
        self._closed = True
        if not withdraw:
            return
        lease, self.lease = self.lease, 0
        try:
            await self.kv.txn([], [Delete(self.key), Put(withdrawn_key(self.ns, self.host), b"")])
        except WorldError as e:
            log.warning("world: scheduler %s: %s cannot withdraw: %s", self.ns, self.host, e)
        if lease:
            with contextlib.suppress(WorldError):
                await self.kv.revoke(lease)  # a write racing with us goes with it

    # -- run -------------------------------------------------------------------------
    async def run(self) -> None:
        unlisten = self.kv.listen_replaced(lambda _why: self._replaced.set())
        try:
            await self._run()
        finally:
            unlisten()

    async def _run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._keepalive(), name=f"scheduler-{self.ns}-keepalive")
            tg.create_task(self.election.run(), name=f"scheduler-{self.ns}-election")
            tg.create_task(
                self.election.lead(self._lead, f"the scheduler of {self.ns}"),
                name=f"scheduler-{self.ns}-leader",
            )
            await self._keep_record()

    async def _ensure_lease(self) -> int:
        async with self._lease_lock:
            delay = BACKOFF_FIRST
            if self.lease and self._lease_epoch != self.kv.epoch:
                self.lease = 0  # granted in a World that was replaced since
            while not self.lease:
                try:
                    epoch = self.kv.epoch
                    self.lease = await self.kv.grant(float(self.options.ttl))
                    self._lease_epoch = epoch
                except WorldError as e:
                    log.warning("world: scheduler %s: cannot grant a lease: %s", self.ns, e)
                    await self.clock.sleep(delay)
                    delay = min(delay * 2, BACKOFF_MAX)
            return self.lease

    async def _put(self) -> None:
        """Write our record under our lease (and drop a withdrawal of ours), retried
        until the World takes it."""
        async with self._put_lock:
            delay = BACKOFF_FIRST
            while not self._closed:
                lease = await self._ensure_lease()
                try:
                    await self.kv.txn(
                        [],
                        [
                            Put(self.key, self._value, lease),
                            Delete(withdrawn_key(self.ns, self.host)),
                        ],
                    )
                    return
                except LeaseExpired:
                    if self.lease == lease:
                        self.lease = 0
                except WorldError as e:
                    log.warning("world: scheduler %s: cannot volunteer: %s", self.ns, e)
                    await self.clock.sleep(delay)
                    delay = min(delay * 2, BACKOFF_MAX)

    async def _keep_record(self) -> None:
        """Level-triggered: whenever our record is not as we wrote it, write it."""
        await self._put()
        async with contextlib.aclosing(watch_one(self.kv, self.key)) as snaps:
            async for snap in snaps:
                if self._right(snap):
                    self.volunteered.set()
                    continue
                if self._closed:
                    continue
                self.volunteered.clear()
                if self._on_change is not None:
                    self._on_change()
                await self._put()

    async def _keepalive(self) -> None:
        while True:
            if not self._replaced.is_set():
                await first_of(self._replaced.wait(), self.clock.sleep(self.options.ttl / 3))
            self._replaced.clear()
            lease = self.lease
            if not lease or self._closed:
                continue
            if self._lease_epoch != self.kv.epoch:
                log.warning(
                    "world: scheduler %s: the World was replaced; volunteering again under "
                    "a fresh lease",
                    self.ns,
                )
                await self._put()
                continue
            try:
                await self.kv.keepalive(lease)
            except LeaseExpired:
                log.warning(
                    "world: scheduler %s: the lease of %s expired; volunteering again",
                    self.ns,
                    self.host,
                )
                if self.lease == lease:
                    self.lease = 0
                await self._put()  # (the watch of our key sees it too: the same write)
            except WorldError as e:
                log.warning("world: scheduler %s: keep-alive failed: %s", self.ns, e)

    async def _lead(self) -> None:
        records = _Records()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(follow(self.kv, namespace_prefix(self.ns), records))
            while True:
                await records.changed.wait()
                records.changed.clear()
                try:
                    await self.step(records.items)
                except WorldError as e:
                    log.warning("world: scheduler %s: deciding failed (%s); retrying", self.ns, e)
                    await self.clock.sleep(0.5)
                    records.changed.set()

    async def step(self, items: dict[str, KeyValue]) -> bool:
        """One decision over a snapshot of the namespace; True if something was
        written. Refused (False) when we no longer lead or the choice changed."""
        self.steps += 1
        vprefix, wprefix = volunteers_prefix(self.ns), withdrawn_prefix(self.ns)
        ckey = chosen_key(self.ns)
        volunteers: dict[str, Options] = {}
        withdrawn: dict[str, int] = {}
        for key, item in items.items():
            if key.startswith(vprefix):
                try:
                    volunteers[key[len(vprefix) :]] = decode_options(item.value, key)
                except ValueError as e:
                    log.warning("world: scheduler %s: %s", self.ns, e)
            elif key.startswith(wprefix):
                withdrawn[key[len(wprefix) :]] = item.mod_revision
        if self.host not in volunteers:
            return False  # our own record is being written: decide once we see it
        mine = self.options.decision()
        differ = sorted(h for h, o in volunteers.items() if o.decision() != mine)
        if differ and differ != self._differ:
            log.warning(
                "world: scheduler %s: the leader %s decides with its own options (strategy"
                " %s, max %d%s); these volunteers give others: %s",
                self.ns,
                self.host,
                self.options.strategy,
                self.options.max,
                ", persist" if self.options.persist else "",
                ", ".join(differ),
            )
        self._differ = differ
        current_item = items.get(ckey)
        current: Chosen | None = None
        if current_item is not None:
            try:
                current = decode_chosen(current_item.value, ckey)
            except ValueError as e:
                log.warning("world: scheduler %s: %s (deciding afresh)", self.ns, e)
        new = decide(self.options, volunteers, current, withdrawn, leader=self.host)
        ops: list[Put | Delete] = []
        compares = [Compare(ckey, current_item.mod_revision if current_item else 0)]
        if new is not None:
            ops.append(Put(ckey, encode_chosen(new)))
        for host, mod in sorted(withdrawn.items()):
            # accounted for in this decision: consumed (unless it changed meanwhile)
            ops.append(Delete(withdrawn_key(self.ns, host)))
            compares.append(Compare(withdrawn_key(self.ns, host), mod))
        if not ops:
            return False
        if not await self.election.fenced(ops, compares):
            self.refused += 1
            return False
        self.writes += 1
        if new is not None:
            log.info(
                "world: scheduler %s: chose %s (version %d)",
                self.ns,
                " ".join(new.hosts) or "nobody",
                new.version,
            )
        return True
