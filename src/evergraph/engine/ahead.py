"""Work run ahead: a run that ends once converged checks its plain resources, and
makes the missing ones, in a forked child while the parent loads the rest.

A one-shot run of a big graph of files spends most of its time on two things
that do not depend on each other: loading (imports, the engine, 10k vertices)
and the files themselves (reading them; on a first apply, writing them). With
two cores they overlap: right after the graph is parsed, `Ahead.start` forks a
child that goes through the graph in an order where every resource comes after
those it depends on, and asks each resource whose kind can tell
(`Resource.ahead_check`: a pure check from its parameters) whether it is in its
state. One that is not, and does not exist at all, the child makes itself
(`Resource.ahead_create`) when everything it depends on, however far up, was
found in its state or made by the child too, and nothing about it is more
than an order: no notify, no value sent or received, no noop, semaphore,
timeout, rate limit, reversal or grouping (`creatable`). The child writes a
record per resource to a pipe as it goes: its place and its verdict, CLEAN,
CREATED (made: a batch of writes is committed, `atomic.commit`, before its
records are sent; a file made where nothing was is renamed with no sync, as
atomic's fsync policy says of `fresh` writes) or OTHER.

The engine does not initialise those vertices when it starts them (swap.py,
`Vertex.ahead`); the one-shot lane (scheduling.py) waits for each one's
verdict while the child runs (`take`, `wake`), then records a CREATED one
changed, with what its kind says making it changed (`Resource.ahead_created`)
and no init nor check; a CLEAN one clean, with no init nor check, unless
something it depends on changed in the run; any other (OTHER, no verdict: a
child that died) is initialised then and checked as usual.

Why that is the same run: a run that ends once converged promises that each
resource was found or put in its state after everything it depends on was.
The child keeps that order among what it makes, and makes nothing below a
resource it did not find or make itself. A verdict read before the run changed
anything upstream of it is as good as one read later, while nothing upstream
changed; once something did, a CLEAN verdict is dropped. A change made
meanwhile by someone else is one the run could as well have missed by checking
a moment earlier.

The child takes no lock and logs nothing; its writes are the file kind's own
(atomic; new, so not synced), its directories are made as the kind makes them. What it
made it says in a journal in the state dir before it makes more (a batch at a
time, as the engine's own committer logs a batch): the engine's line for it
need not be written through, and a run killed before it logged them leaves
them in the journal for the next run to log (`report_made`); a run that ends
removes it (`forget`). The child is killed with its parent
(PR_SET_PDEATHSIG), and on SIGTERM (`stop`: the run ends before it took every
verdict) it drops the writes not yet committed (their temporary files
removed) and tells what it made so far: the parent logs every change the child
made, taken by the lane or not (`stop` returns the rest). Ctrl-C is its
parent's to handle. With two cores and a big graph, two
children share the work (`SPLIT_MIN`), each whole connected parts of it. Below
`MIN_RESOURCES` candidates the fork costs more than it saves and none is made.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import select
import signal
import stat
import struct
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from evergraph._util.crash import crash_point
from evergraph.engine.contract import Resource, runs_inline

if TYPE_CHECKING:
    import asyncio

    from evergraph._util.atomic import Pending
    from evergraph.engine.model import GraphModel

log = logging.getLogger("evergraph.engine")

#: work a child does for the parent (`Ahead.start`): its work, done in steps while
#: the child waits for the go (told to stop between two once the go came: `until`;
#: whether it is all done), what is left of it after the child's making (`until`
#: None); then its writes
Chore = tuple[Callable[[Callable[[], bool] | None], bool], Callable[[], None]]

#: fewer candidate resources than this: no child (a fork and its copy-on-write
#: faults cost about a millisecond; a check about ten microseconds)
MIN_RESOURCES = 256
#: records the child writes at a time, at most (the parent takes them as they come)
CHUNK = 128
#: writes the child commits together: the first batch, and the most (each batch
#: doubles: the first files reach the parent soon, then each journal line's write and
#: each hand-over to the parent pays for many)
BATCH_FIRST = 32
BATCH_MAX = 1024
#: capable resources from which the work is split between two children (with two
#: cores or more): each takes whole parts of the graph (what depends on what stays in
#: one child), and both write to one pipe
SPLIT_MIN = 2048
#: seconds `stop` waits for the children to tell what they made, then kills them
STOP_S = 5.0
#: the journal of what the children made (`report_made`): its name in the state dir,
#: how it is opened, and how much of it a later run reads at most
JOURNAL = "made-ahead"
_JOURNAL_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
JOURNAL_MAX = 64 << 20
#: characters of a journal line logged at most
IDENT_MAX = 4096
#: the verdicts: not (or the kind cannot tell), found in its state, made by the child
OTHER = 0
CLEAN = 1
CREATED = 2
#: not known yet (the child may still answer), and a CREATED one the engine took
PENDING = 255
TAKEN = 254
#: a record: the resource's place (little-endian uint32), its verdict
RECORD = struct.Struct("<IB")


def creatable(res: Resource) -> bool:
    """Whether the child may make `res` (its kind can, `ahead_create`) as the
    engine would run it: inline (`runs_inline`; its edges, the inbox among them,
    are the child's to look at), not grouped, with nothing but its check to do."""
    return (
        type(res).ahead_create is not Resource.ahead_create
        and runs_inline(res)
        and not type(res).groupable
        and not (res.meta.noop or res.meta.hidden)
    )


class Ahead:
    """A child working on `resources` ahead (`start`), and its verdicts so far."""

    def __init__(
        self,
        pids: list[int],
        fd: int,
        go: int,
        resources: list[Resource],
        asked: bytearray,
        journal: Path | None = None,
    ) -> None:
        self.pids = pids
        self._fd = fd
        #: written to (a byte a child) once the engine runs the graph (`go`); closed
        #: unwritten, the children make nothing
        self._go = go
        #: what the children made, said before their next effect (`report_made`)
        self.journal = journal
        #: in the graph's order (a record names its resource by its place here)
        self.resources = resources
        #: per resource: its verdict, PENDING until it comes (TAKEN: a CREATED one
        #: the engine recorded)
        self.verdicts = bytearray([PENDING]) * len(resources)
        for i, nothing in enumerate(asked):
            if nothing:  # (a kind that cannot tell: no verdict will come)
                self.verdicts[i] = OTHER
        self._rest = b""  # a record cut short by a read
        #: if a list: the place of each verdict that comes is appended to it
        self.fresh: list[int] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def start(
        cls,
        model: GraphModel,
        *,
        creates: bool = True,
        at_least: int = MIN_RESOURCES,
        children: int | None = None,
        journal: Path | None = None,
        chore: Chore | None = None,
    ) -> Ahead | None:
        """Fork the children for `model`'s resources; None when fewer than
        `at_least` of their kinds can tell, or no fork succeeds. `creates`: they may
        make missing resources (not under noop, nor with a global semaphore).
        `children`: how many (default: two from SPLIT_MIN capable resources on two
        cores or more, else one). Nothing is made unless `model.auto` says its
        automatic edges (frontends/cache.py finds them with the parse), nor
        without a `journal` (see `report_made`). `chore`: work taken off the
        parent's way to the engine (a parse cache entry: `ParseCache.encode_later`,
        then `write_held`), done by the child that takes it first: once its checks
        are done if it has nothing to make or the go has not come yet (its work, CPU
        alone, while it waits for the go, stopped between two steps when the go
        comes: the making does not wait for it; finished after its making), else
        once its making is done (the first of the two to be done takes it); its
        writes after the go, once its making is done (never without the go: a
        refused run writes nothing; not before the making, which the engine waits
        for); None if the fork failed (the caller does it then)."""
        listed = list(model.resources.values())
        nothing = Resource.ahead_check
        asked = bytearray(type(r).ahead_check is nothing for r in listed)
        capable = len(listed) - sum(asked)
        if capable < max(at_least, 1):
            return None
        if children is None:
            children = 2 if capable >= SPLIT_MIN and (os.cpu_count() or 1) >= 2 else 1
        journal = journal if creates else None
        # the order and each child's part, worked out once here (in each child it
        # costs more: its first writes to the model's pages copy them)
        plan = _planned(model, listed, journal is not None, children)
        read_end, write_end = os.pipe2(os.O_CLOEXEC)
        go = os.pipe2(os.O_CLOEXEC)  # the engine runs the graph: the children may make
        for stream in (sys.stdout, sys.stderr):  # (a child never writes them, nor flushes)
            with contextlib.suppress(Exception):
                stream.flush()
        parent = os.getpid()
        # the chore's token: one byte, for the child that reads it first
        token = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK) if chore is not None else (-1, -1)
        if chore is not None:
            os.write(token[1], b"c")
            os.close(token[1])
        pids: list[int] = []
        for k in range(children):
            try:
                pid = os.fork()
            except OSError:
                break  # (the parts of the children not forked get no verdict)
            if pid == 0:  # pragma: no cover (the child: measured through its verdicts)
                chores = (chore, token[0]) if chore is not None else None
                _child(read_end, write_end, go, journal, chores, plan, listed, parent, k)
            pids.append(pid)
        os.close(write_end)
        os.close(go[0])
        if token[0] >= 0:
            os.close(token[0])
        crash_point("ahead-forked")
        if not pids:
            os.close(read_end)
            os.close(go[1])
            return None
        os.set_blocking(read_end, False)
        log.debug(
            "checking%s ahead: %d resources, %d children (pids %s)",
            " and making" if journal is not None else "",
            capable,
            len(pids),
            " ".join(map(str, pids)),
        )
        return cls(pids, read_end, go[1], listed, asked, journal)

    def go(self) -> None:
        """The engine runs the graph: the children may make what they found missing
        (not before: a run refused for bad input changes nothing)."""
        if self._go >= 0:
            with contextlib.suppress(OSError):
                os.write(self._go, b"g" * len(self.pids))
            self._no_go()

    def _no_go(self) -> None:
        go, self._go = self._go, -1
        if go >= 0:
            os.close(go)

    def poll(self) -> None:
        """Take the verdicts come so far, without waiting."""
        fd = self._fd
        while fd >= 0:
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:
                self._end()  # all said (or the child died: no verdict for the rest)
                return
            self._take_records(chunk)

    def _take_records(self, chunk: bytes) -> None:
        data = self._rest + chunk if self._rest else chunk
        whole = len(data) - len(data) % RECORD.size
        self._rest = data[whole:]
        verdicts = self.verdicts
        n = len(verdicts)
        fresh = self.fresh
        for i, verdict in RECORD.iter_unpack(memoryview(data)[:whole]):
            if i < n and verdicts[i] == PENDING and verdict in (OTHER, CLEAN, CREATED):
                verdicts[i] = verdict
                if fresh is not None:
                    fresh.append(i)

    def take(self, i: int) -> int:
        """`resources[i]`'s verdict: CLEAN, CREATED (taken: the engine records the
        change), OTHER, or PENDING while the child may still answer (see `wake`)."""
        verdict = self.verdicts[i]
        if verdict == PENDING and self._fd < 0:
            return OTHER  # (the child ended without a word on it)
        if verdict == CREATED:
            self.verdicts[i] = TAKEN
        return verdict

    def wake(self, then: Callable[[], None]) -> None:
        """Call `then` once more verdicts came (or the child ended), in this loop."""
        if self._fd < 0:
            then()
            return
        import asyncio  # (loaded by then: we run in its loop)

        loop = asyncio.get_running_loop()
        if self._loop is not None:
            loop.remove_reader(self._fd)
        self._loop = loop

        def readable() -> None:
            self.quiet()
            self.poll()
            then()

        loop.add_reader(self._fd, readable)

    @property
    def ended(self) -> bool:
        """Every child ended (or the verdicts were given up): no more will come."""
        return self._fd < 0

    def quiet(self) -> None:
        """No more `wake`: the call asked for is dropped."""
        if self._loop is not None and self._fd >= 0:
            self._loop.remove_reader(self._fd)
        self._loop = None

    def told(self) -> list[int] | None:
        """Once every verdict came, the places of what the children made that the
        engine did not take (taken now; none wanted any more); None while one may
        still come. The child at the chore finishes it meanwhile: `stop` (at the
        run's end, cli/runner.py) waits for it and reaps them."""
        self.poll()
        if self._fd >= 0 and PENDING in self.verdicts:
            return None
        self.quiet()
        return self._untaken()

    def stop(self) -> list[int]:
        """No more verdicts wanted (or all came): end the child, take what it said
        until then, reap it. The places of what it made that the engine did not
        take (it logs them as changes all the same)."""
        self._no_go()
        fd = self._fd
        if fd >= 0:
            self.quiet()
            for pid in self.pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)  # (ended already, unless the run was quicker)
            # to their end: they tell what they made, then exit; one that does not
            # within STOP_S (stuck in a kind's check) is killed
            deadline = time.monotonic() + STOP_S
            while self._fd >= 0:
                left = deadline - time.monotonic()
                if left > 0 and select.select([fd], [], [], left)[0]:
                    self.poll()
                    continue
                for pid in self.pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                os.set_blocking(fd, True)
                self.poll()  # (to the end: a killed child's end of the pipe is closed)
        return self._untaken()

    def _untaken(self) -> list[int]:
        """The places of what the children made that the engine did not take: taken
        now (the engine logs each as a change)."""
        made = [i for i, verdict in enumerate(self.verdicts) if verdict == CREATED]
        for i in made:
            self.verdicts[i] = TAKEN
        return made

    def forget(self) -> None:
        """The engine logged all the children made (its lines are flushed): their
        journal has nothing left to tell."""
        if self.journal is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.journal)

    def _end(self) -> None:
        self._no_go()
        fd, self._fd = self._fd, -1
        if fd < 0:
            return
        self.quiet()
        os.close(fd)
        for pid in self.pids:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)

    def __deepcopy__(self, memo: dict[int, Any]) -> Ahead:
        return self  # (a copied graph's resources are other objects: none is matched)


_stopping = False


def _on_term(signum: int, frame: Any) -> None:  # pragma: no cover (the child's)
    global _stopping
    _stopping = True


def _child(  # pragma: no cover (the child: measured through its verdicts)
    read_end: int,
    write_end: int,
    go: tuple[int, int],
    journal: Path | None,
    chore: tuple[Chore, int] | None,
    plan: _Plan,
    resources: list[Resource],
    parent: int,
    k: int,
) -> None:
    """The forked child `k`: a record per resource of its part of the `plan` that
    can tell to `write_end`, then exit at once (no atexit, no flush: the parent's
    buffers are the parent's)."""
    status = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # (the parent's to handle)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _on_term)
        _die_with(parent)
        gc.disable()  # (a collection would touch every object: copies of shared pages)
        os.close(read_end)
        os.close(go[1])  # (the parent's: the go, or its end, comes from there)
        _work(write_end, go[0], journal, chore, plan, resources, k)
    except BaseException:
        status = 1  # (the parent sees a short answer: no verdict for the rest)
    finally:
        os._exit(status)


def _die_with(parent: int) -> None:  # pragma: no cover (the child's)
    """SIGKILL when the parent dies: a kill -9 of the run ends its children too, as
    it would end a run doing the same work in one process (a write cut short leaves
    its temporary file: the next run's init sweeps it)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # (it died before the prctl)
        os._exit(1)


def _work(  # pragma: no cover (the child's)
    out_fd: int,
    go_fd: int,
    journal: Path | None,
    chore: tuple[Chore, int] | None,
    plan: _Plan,
    resources: list[Resource],
    k: int,
) -> None:
    """Check the resources of part `k` of the `plan` in order; then, once the
    engine runs the graph (`Ahead.go`) and with a `journal`, make those found
    missing that may be (in order again). What is made is said in the journal
    before more is made, then to the parent."""
    n = len(resources)
    parents, edged, order = plan.parents, plan.edged, plan.order
    owner = plan.owner
    mine_in_order = [i for i in order if owner[i] == k]
    nothing = Resource.ahead_check
    seen: dict[str, Any] = {}
    #: per resource: found in its state (or to be made, then made) by this child,
    #: and all it depends on too (until the making: as far as the checks tell)
    sound = bytearray(n)
    out = bytearray()
    missing = bytearray(n)  # 1: to be made
    #: `creatable` by kind and meta (a graph's resources share a few metas)
    can: dict[tuple[type[Resource], int], bool] = {}
    try:
        for i in mine_in_order:
            if _stopping:
                break
            res = resources[i]
            cls = type(res)
            if cls.ahead_check is nothing:
                continue
            try:
                told = res.ahead_check(seen)
            except Exception:
                told = None
            ok = parents is None or _all_in(sound, parents[i])
            if told is False and ok and parents is not None and not edged[i]:
                key = (cls, id(res.meta))  # (each resource holds its meta: ids stay)
                may = can.get(key)
                if may is None:
                    may = can[key] = creatable(res)
                if may:
                    sound[i] = missing[i] = 1  # (if made: see _make)
                    continue
            sound[i] = told is True and ok
            out += RECORD.pack(i, CLEAN if told is True else OTHER)
            if len(out) >= CHUNK * RECORD.size:
                _write_all(out_fd, out)
                out.clear()
        _write_all(out_fd, out)
        out.clear()
        making = any(missing) and journal is not None
        # the chore: by the child that takes its token first. Now if this one has
        # nothing to make or the go has not come: its work while the engine gets
        # ready (the go comes once it runs the graph), and no longer: what the go cut
        # short is done after the making. Else after its making: the first child
        # done making does it (not the first done checking, as often as not the
        # slower maker: the run's end waits for the chore). Its writes after the go
        # and the making (the engine waits for the making, not for the chore).
        chored = (
            chore is not None
            and not _stopping
            and (not making or not _readable(go_fd))
            and _took(chore[1])
        )
        worked = False
        if chored:
            assert chore is not None
            try:
                worked = chore[0][0](lambda: _stopping or _readable(go_fd))
            except Exception:
                chored = False
        if (making or chored) and not _stopping and os.read(go_fd, 1):
            if making:
                assert parents is not None
                assert journal is not None
                _make(out_fd, journal, resources, parents, mine_in_order, missing, sound, seen)
                if not chored and chore is not None:  # (stopped or not, as one taken)
                    chored = _took(chore[1])
            if chored:
                assert chore is not None
                with contextlib.suppress(Exception):
                    if not worked:
                        chore[0][0](None)
                    chore[0][1]()
    finally:
        _write_all(out_fd, out)


def _all_in(flags: bytearray, places: list[int]) -> bool:  # pragma: no cover (the child's)
    """Whether every one of `places` is flagged: `all(flags[p] for p in places)`
    without a generator where there is none or one (a file below its directory)."""
    if len(places) <= 1:
        return not places or bool(flags[places[0]])
    return all(flags[p] for p in places)


def _any_in(flags: bytearray, places: list[int]) -> bool:  # pragma: no cover (the child's)
    """`any(flags[p] for p in places)`, as `_all_in`."""
    if len(places) <= 1:
        return bool(places) and bool(flags[places[0]])
    return any(flags[p] for p in places)


def _readable(fd: int) -> bool:  # pragma: no cover (the child's)
    """Whether a read of `fd` would not wait (the go: given, or its pipe closed)."""
    return bool(select.select([fd], [], [], 0)[0])


def _took(token: int) -> bool:  # pragma: no cover (the child's)
    """Whether this child took the chore's token (its one byte)."""
    try:
        return os.read(token, 1) == b"c"
    except OSError:  # (BlockingIOError: another child took it)
        return False


def _make(  # pragma: no cover (the child's)
    out_fd: int,
    journal: Path,
    resources: list[Resource],
    parents: list[list[int]],
    order: list[int],
    missing: bytearray,
    sound: bytearray,
    seen: dict[str, Any],
) -> None:
    """Make the `missing` ones (in `order`), each only if all it depends on is in
    its state, found so or made (a making that failed makes what is below it
    unsound: `sound` is worked out again in order): writes in batches
    (`atomic.commit`), each said in the `journal` before the next is made, then to
    the parent; what is not made is told OTHER (the engine checks it). A batch is
    committed when it is full (each batch twice the one before, up to BATCH_MAX),
    or when what comes next depends on one of it. Its writes are new files
    (`ahead_create` makes only where nothing is): renamed with no sync, as atomic's
    fsync policy says of `fresh` writes."""
    from evergraph._util.atomic import OpenDirs, commit, discard

    try:
        told = os.open(journal, _JOURNAL_FLAGS, 0o600)
    except OSError:
        told = -1  # (nothing is made that would not be said)
    out = bytearray()
    batch: list[tuple[int, Pending]] = []
    #: 1 while its write waits in a batch (what depends on it waits for the commit)
    in_batch = bytearray(len(resources))
    dirs = OpenDirs()
    limit = BATCH_FIRST

    def say(made: list[int]) -> None:
        nonlocal told
        if told < 0 or not made:
            return
        try:
            _journal(told, resources, made)
        except OSError:  # (a full disk) told to the parent all the same; no more made
            os.close(told)
            told = -1

    def land() -> None:
        """The batch committed, said in the journal, then told."""
        nonlocal batch, dirs, limit
        if not batch:
            return
        landed, held = batch, dirs
        batch, dirs = [], OpenDirs()
        limit = min(limit * 2, BATCH_MAX)
        try:
            errors = commit([p for _, p in landed])
        finally:
            held.close()
        crash_point("ahead-committed")  # (made; not told yet)
        made = []
        for (i, _), error in zip(landed, errors, strict=True):
            in_batch[i] = 0
            sound[i] = error is None
            if error is None:
                made.append(i)
            out.extend(RECORD.pack(i, CREATED if error is None else OTHER))
        say(made)
        _write_all(out_fd, out)
        out.clear()

    try:
        for i in order:
            if not (missing[i] or sound[i]):
                continue
            ps = parents[i]
            if _any_in(in_batch, ps):
                land()  # (in its state once that batch is committed, not before)
            if not missing[i]:  # (found in its state: sound if all above it still is)
                sound[i] = _all_in(sound, ps)
                continue
            if _stopping or told < 0:
                out += RECORD.pack(i, OTHER)
                continue
            made: Pending | bool = False
            if _all_in(sound, ps):
                try:
                    made = resources[i].ahead_create(seen, dirs)
                except Exception:
                    made = False
            if made is True:
                out += RECORD.pack(i, CREATED)
                say([i])
            elif made is False:
                sound[i] = 0
                out += RECORD.pack(i, OTHER)
            else:
                batch.append((i, made))
                in_batch[i] = 1
                if len(batch) >= limit:
                    land()
        if not _stopping:
            land()
    finally:
        for i, p in batch:  # (stopped: not made; their temporary files removed)
            with contextlib.suppress(OSError):
                discard(p)
            out += RECORD.pack(i, OTHER)
        dirs.close()
        if told >= 0:
            os.close(told)
        _write_all(out_fd, out)


class _Plan(NamedTuple):
    """What the children work by: each resource's parents by place (None: no
    order is known, they check only, in the graph's order), 1 where an edge other
    than an order touches it, the order they go in, and the child each belongs to."""

    parents: list[list[int]] | None
    edged: bytearray
    order: Sequence[int]
    owner: bytearray


def _planned(model: GraphModel, resources: list[Resource], creates: bool, children: int) -> _Plan:
    n = len(resources)
    parents, edged, order = _plan(model, resources, creates)
    if order is None:
        return _Plan(None, edged, range(n), _owners(None, n, children))
    return _Plan(parents, edged, order, _owners(parents, n, children))


def _plan(
    model: GraphModel,
    resources: list[Resource],
    creates: bool,
) -> tuple[list[list[int]], bytearray, list[int] | None]:
    """(each resource's parents by place, 1 where an edge other than an order
    touches it, an order where parents come first). With `creates` off, or where
    the automatic edges are not known (`GraphModel.auto`: none where they depend
    on the machine, a package's files), no order: nothing is made."""
    n = len(resources)
    parents: list[list[int]] = [[] for _ in range(n)]
    edged = bytearray(n)
    if not creates:
        return parents, edged, None
    auto = model.auto  # (found with the parse: frontends/cache.py)
    if auto is None or not auto.fits(model):
        return parents, edged, None
    # (`resources` are the model's, in its order: its keys are their idents)
    place = dict(zip(model.resources, range(n), strict=True))
    forward = True  # every edge goes forward in the graph's order (a directory first)
    for from_id, to_id, notify, send, recv, _name in (*model.edges, *auto.edges):
        a, b = place[from_id], place[to_id]
        parents[b].append(a)
        if a >= b:
            forward = False
        if notify or send is not None or recv is not None:
            edged[a] = edged[b] = 1
    if forward:  # (then the graph's order is one where parents come first)
        return parents, edged, list(range(n))
    children: list[list[int]] = [[] for _ in range(n)]
    for b, ps in enumerate(parents):
        for a in ps:
            children[a].append(b)
    # Kahn's, taking the ready ones in the graph's order (the lane's, roughly)
    waiting = [len(p) for p in parents]
    order = [i for i in range(n) if not waiting[i]]
    for i in order:  # (grows as it goes)
        for c in children[i]:
            waiting[c] -= 1
            if not waiting[c]:
                order.append(c)
    if len(order) != n:
        return parents, edged, None  # a cycle (the run reports it): make nothing
    return parents, edged, order


def _journal(  # pragma: no cover (the child's)
    fd: int, resources: list[Resource], made: list[int]
) -> None:
    """Say what was made, in the journal, before anything else is made."""
    _write_all(fd, bytearray("".join(f"{resources[i].ident}\n" for i in made).encode()))


def report_made(journal: Path) -> int:
    """Log as applied what a killed run's children made and that run never logged
    (its journal: `Ahead.forget` removes it once the run's log has all), then remove
    it; how many. A kill -9 leaves every change the children made in the log, or in
    the journal until the next run logs it."""
    try:
        fd = os.open(journal, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return 0
    except OSError as e:
        log.warning("%s: cannot read what an earlier run made: %s", journal, e.strerror)
        return 0
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # (not ours: never read, left there)
            log.warning("%s: not a regular file: not read", journal)
            return 0
        text = f.read(JOURNAL_MAX).decode("utf-8", "replace")
    # (each line an ident; the log escapes what is not printable)
    idents = [line[:IDENT_MAX] for line in text.splitlines() if line]
    for ident in idents:
        log.info(
            "%s: applied (made by an earlier run that was killed before it logged it)",
            ident,
            extra={"effect": True},
        )
    with contextlib.suppress(FileNotFoundError):
        os.unlink(journal)
    return len(idents)


def _owners(parents: list[list[int]] | None, n: int, of: int) -> bytearray:
    """The child (of `of`) that works on each resource. Whole connected parts of
    the graph, so that all a resource depends on is in one child: each part, by its
    first resource, goes to the child with the least so far. With no edges known (a
    check only: verdicts in any order), slices."""
    if of == 1:
        return bytearray(n)
    if parents is None:
        return bytearray(i * of // n for i in range(n))
    root = list(range(n))  # union-find, each part by its first resource
    # (the finds written out: a call each was half the time of 10k files)
    for b, ps in enumerate(parents):
        if not ps:
            continue
        rb = root[b]
        while root[rb] != rb:
            rb = root[rb]
        for a in ps:
            ra = root[a]
            while root[ra] != ra:
                ra = root[ra]
            if ra < rb:
                root[rb] = ra
                rb = ra
            elif rb < ra:
                root[ra] = rb
            root[a] = rb
        root[b] = rb
    roots = root
    for i in range(n):  # (a root is below all it roots: by then each is final)
        r = root[i]
        if root[r] != r:
            root[i] = root[r]
    size: dict[int, int] = {}
    for r in roots:
        size[r] = size.get(r, 0) + 1
    load = [0] * of
    owner: dict[int, int] = {}
    for r, count in size.items():  # (by first resource: dicts keep that order)
        child = load.index(min(load))
        owner[r] = child
        load[child] += count
    return bytearray(owner[r] for r in roots)


#: bytes written to the pipe at once, at most: whole records, and no more than
#: PIPE_BUF, so that the children's writes never interleave within a record
_PIPE_WRITE = 4096 // RECORD.size * RECORD.size


def _write_all(fd: int, data: bytearray) -> None:  # pragma: no cover (the child's)
    view = memoryview(data)
    while view:
        piece = view[:_PIPE_WRITE]
        while piece:
            piece = piece[os.write(fd, piece) :]
        view = view[_PIPE_WRITE:]
