"""The engine: runs a graph of vertices in parallel, in dependency order, forever.

Scheduling rule (SPEC §2.1). A vertex runs check_apply only when it is
*pending* (startup, watch event, refresh, retry), its watch reported ready,
and every parent is *clean* (its last check_apply succeeded and it has no run
pending or in flight). A parent that finishes successfully pokes its
children; a child with nothing pending ignores the poke — its cached clean
state answers without a call to check_apply. A failed parent therefore holds
every descendant back until it succeeds. Events during a run only set
`pending`, so any number of them cause exactly one more run.

Runnable vertices go to a ready queue that is drained a batch per loop turn.
Kinds whose check_apply is local syscalls declare `eager`: they run inline,
without a task of their own, unless they suspend after all.

Ownership: every task (watches, applies, retry timers, the inotify hub, the
graph-update follower) lives in one TaskGroup; cancellation is the only stop
signal. Resource code is never trusted: every call into it is wrapped, and
an exception becomes a recorded failure of `kind[name]`, never an engine crash.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator, Iterator
from typing import TYPE_CHECKING, Any

import msgspec

from evergraph._util.atomic import atomic_write
from evergraph._util.clock import SYSTEM, Clock
from evergraph._util.crash import crash_point
from evergraph._util.gc import gc_paused
from evergraph.engine import changes
from evergraph.engine.build import build
from evergraph.engine.contract import Registry, Resource, default_registry, semaphores
from evergraph.engine.converger import Converger
from evergraph.engine.model import Edge, GraphModel
from evergraph.engine.recap import Recaps
from evergraph.engine.recap import took as _took
from evergraph.engine.settings import Settings
from evergraph.engine.status import Observer, State, VertexStatus, masked_params
from evergraph.engine.store import Owed, VertexStore
from evergraph.engine.vertex import Vertex
from evergraph.errors import InputError, ResourceError
from evergraph.graph import diff_keys

log = logging.getLogger("evergraph.engine")

#: runs started per event-loop turn before other work (signals, events) gets a turn
DRAIN_BATCH = 1000
#: vertices built or started between yields to the loop during a swap: a graph of
#: 1M vertices takes seconds to build and start, and the World lease's keep-alive,
#: signals and the HTTP server must get their turn meanwhile (a lease expired
#: during a 1M-vertex swap)
YIELD_EVERY = 1000
#: exit status of a noop run that exits once converged (`--noop --converged-exit`, or
#: `--no-watch`) when something would change; 0: nothing would, 1: a resource failed
EXIT_WOULD_CHANGE = 3
#: a vertex that failed for good is tried again by timer after this many seconds
#: (or its meta.delay if longer), doubling each time it fails again, up to
#: `Settings.repair_backoff_max`
REPAIR_FIRST = 1.0


if TYPE_CHECKING:
    from evergraph.cluster.hostkeys import HostKeys
    from evergraph.engine.contract import PathWatcher
    from evergraph.world.kv import KV


class Engine:
    def __init__(
        self,
        settings: Settings,
        observer: Observer | None = None,
        registry: Registry | None = None,
        *,
        watcher: PathWatcher | None = None,
        world: KV | None = None,
        keys: Callable[[], HostKeys] | None = None,
        clock: Clock = SYSTEM,
    ) -> None:
        """Everything the resources may use is handed in by the owner (the agent):
        `watcher` (the running inotify hub; None: file watches are refused),
        `world`, `keys` (called on first use: loading keys costs start-up time)."""
        self.settings = settings
        self.hostname = settings.host()
        self.observer = observer
        #: watch events received (`handle.event()` calls of current vertices)
        self.events = 0
        self.vertices: dict[str, Vertex] = {}
        self.watcher = watcher
        self.world = world
        self._keys = keys
        self.clock = clock
        self._tg: asyncio.TaskGroup | None = None
        self._running = 0
        self._retrying = 0
        self._unready = 0
        self._stop = asyncio.Event()
        self._hard_stop = asyncio.Event()
        self._stopping = False
        #: the exit status a resource asked for (`request_exit`), if any
        self._exit_code: int | None = None
        #: --max-runtime stopped the run before it converged
        self._cut_short = False
        self._global_sema = asyncio.Semaphore(settings.sema) if settings.sema > 0 else None
        self._semas: dict[str, asyncio.Semaphore] = {}
        self._timers: set[asyncio.Task[None]] = set()
        #: the repair timer of each vertex failed for good (see _revive)
        self._repairs: dict[Vertex, asyncio.Task[None]] = {}
        #: vertices whose run waits for a token or a semaphore: it changed nothing yet
        self._waiting: set[Vertex] = set()
        #: woken whenever a run ends or the engine may have turned idle (see _check_idle)
        self._progress: list[asyncio.Future[None]] = []
        #: vertices poked and waiting for the next drain (see _poke)
        self._ready: collections.deque[Vertex] = collections.deque()
        self._queued = 0
        self._drain_scheduled = False
        self.store = VertexStore(settings.state_dir)
        self._owed_loaded = False
        self._edges: list[Edge] = []
        self.registry = registry or default_registry
        self._swap_lock = asyncio.Lock()
        converged_timeout = settings.converged_timeout
        if converged_timeout is None and not settings.watch:
            converged_timeout = 0.0  # --no-watch: nothing can change once converged
        self.converger = Converger(
            converged_timeout, settings.converged_status_file, self._on_converged
        )
        #: the run ends the moment it is idle (`--converged-exit` with a
        #: converged-timeout of 0, the default): passive watches (`subscribe()`, e.g.
        #: a file's inotify subscription) and poll timers are not set up, they would
        #: only be thrown away (10k files: 10k subscriptions). Those never gate a
        #: vertex's readiness, so nothing waits for them. Kinds with a watch task
        #: (`watch()`: kv, schedule, exec's watchcmd...) keep it: it may be what makes
        #: them ready, or what they act through. Given up: a change to an
        #: already-checked file *during* the run (e.g. by another resource without an
        #: edge between them) no longer re-runs it, like the same change a moment
        #: after the exit. With a converged-timeout > 0 every watch stays, so drift in
        #: that window is repaired.
        self.one_shot = settings.watch and settings.converged_exit and converged_timeout == 0
        #: passive subscriptions and poll timers set up, for tests and benchmarks
        self.subscriptions = 0
        self.started = clock.monotonic()
        self.graph_name = ""
        self.recaps = Recaps()

    # -- public -------------------------------------------------------------
    async def run(self, model: GraphModel, updates: AsyncIterator[GraphModel] | None = None) -> int:
        """Run `model` (then each graph `updates` yields) until stopped; returns the exit status."""
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                aux: list[asyncio.Task[Any]] = []
                if self.settings.max_runtime is not None:
                    # counted from the engine's creation (the wait for a first graph too)
                    aux.append(tg.create_task(self._max_runtime(self.settings.max_runtime)))
                await self.swap(model)
                if updates is not None:
                    aux.append(tg.create_task(self._follow(updates)))
                self._check_idle()
                await self._stop.wait()
                await self._shutdown(aux)
                self._recap_at_exit()
        finally:
            self.converger.close()
            self._tg = None
        return self.exit_status()

    def keys(self) -> HostKeys:
        """The host's key pairs (ResourceError if the owner gave none)."""
        if self._keys is None:
            raise ResourceError("this run has no host keys")
        return self._keys()

    def status(self) -> tuple[VertexStatus, ...]:
        """A snapshot of every vertex, for observers."""
        return tuple(v.status() for v in self.vertices.values())

    def running(self) -> tuple[VertexStatus, ...]:
        """A snapshot of each vertex running now (cheap to poll: only those are built)."""
        return tuple(v.status() for v in self.vertices.values() if v.running)

    # read-only views for observers (HTTP, metrics): tuples and plain values
    def edges(self) -> tuple[Edge, ...]:
        return tuple(self._edges)

    def state_counts(self) -> collections.Counter[str]:
        return collections.Counter(v.state for v in self.vertices.values())

    def busy(self) -> bool:
        """A run is in flight, queued or due (retry), or a watch is not ready yet."""
        return bool(self._running or self._retrying or self._unready or self._queued)

    def params(self, ident: str) -> dict[str, object] | None:
        """`ident`'s parameters with its secrets masked (None: no such vertex)."""
        v = self.vertices.get(ident)
        return None if v is None else masked_params(v.res, v.secret_fields, v.mask)

    def _observe(self, v: Vertex, state: State) -> None:
        now = self.clock.monotonic()
        if v.state == "running" and state != "running":
            v.duration = now - v.since
            if log.isEnabledFor(logging.DEBUG):  # -v: each check and its duration
                outcome = "failed" if state == "retrying" else state
                log.debug("%s: %s in %s", v.ident, outcome, _took(v.duration))
        v.state, v.since = state, now
        if self.observer is not None:
            self.observer(v.status())

    def request_stop(self) -> None:
        """First call: graceful (finish in-flight applies, for at most
        `settings.stop_grace` seconds; runs still waiting for a semaphore or a token
        end at once). Second: cancel them too (a command gets SIGTERM, then SIGKILL)."""
        if self._stop.is_set():
            log.warning("second stop request: cancelling in-flight applies")
            self._hard_stop.set()
        else:
            log.info("stopping: finishing in-flight applies (again to cancel them)")
            self._stop.set()

    def request_exit(self, code: int, by: str) -> None:
        """A resource (`exit`) ends the run with status `code`: stopped as on a first
        SIGTERM; the first code asked for is the exit status."""
        if self._exit_code is None:
            self._exit_code = code
            log.info("%s: asks to exit with status %d: stopping", by, code)
        self._stop.set()

    def exit_status(self) -> int:
        """0 all clean, 1 a resource failed; a noop run that exits once converged:
        `EXIT_WOULD_CHANGE` if any resource would change; the status a resource asked
        for (`request_exit`) before all of these."""
        if self._exit_code is not None:
            return self._exit_code
        if self._cut_short:
            return 1
        vertices = self.vertices.values()
        if not all(v.ok and not v.failed for v in vertices):
            return 1
        s = self.settings
        # something would change, or may (a check that could not tell: unknown)
        if (
            s.noop
            and (s.converged_exit or not s.watch)
            and any(v.changed_count or v.state == "unknown" for v in vertices)
        ):
            return EXIT_WOULD_CHANGE
        return 0

    # -- graph swap -----------------------------------------------------------
    async def swap(self, model: GraphModel) -> None:
        """Replace the running graph by `model`, keeping unchanged vertices as they are."""
        async with self._swap_lock:
            with gc_paused():
                await self._swap(model)

    async def _swap(self, model: GraphModel) -> None:
        # A swap is activity: the converged status drops and rises again.
        self.converger.busy()
        old = self.vertices
        resources = model.resources
        removed: list[str]
        added: list[str]
        if old.keys() == resources.keys():  # the common live edit: the same vertices
            removed, added, common = [], [], list(resources)
        else:
            removed, added, common = diff_keys(old, resources)
        replaced: dict[str, Vertex] = {}
        rewatch: list[Vertex] = []
        receiving: set[tuple[str, str]] | None = None
        for ident in common:
            prev = old[ident]
            if prev.received:
                # Pre-fill values received at run time, so that a receiver
                # whose declared parameters did not change is kept.
                if receiving is None:
                    receiving = {(e.to_id, e.recv) for e in model.edges if e.recv is not None}
                carried = {k: val for k, val in prev.received.items() if (ident, k) in receiving}
                prev.received = carried
                if carried:
                    resources[ident] = _with_values(resources[ident], carried)
            if not prev.res.cmp(resources[ident]):
                removed.append(ident)
                added.append(ident)
                replaced[ident] = prev
            elif prev.failed and prev.res.meta.rewatch:
                rewatch.append(prev)
        if any(old[ident].res.meta.realize for ident in removed):
            removed = _parents_first(removed, old)  # a parent realizes before its children
        for ident in removed:
            gone = old.pop(ident)
            leaving = ident not in replaced
            await self._stop_vertex(gone, leaving=leaving)
            if leaving:
                self._observe(gone, "removed")  # its last status: watchers drop it
        new_vs: list[Vertex] = []
        for ident in added:
            v = Vertex(self, model.resources[ident])
            v.watch_ready = False  # held back until started (see below)
            self._unready += 1
            before = replaced.get(ident)
            if before is not None:
                if not v.res.meta.reset:
                    # The retry budget is the resource's, not the vertex's: a
                    # parameter change does not buy a fresh one (unless meta.reset).
                    v.retries_left = _carry_retries(before, v)
                # values received before still hold until the sender sends again
                v.inbox = dict(before.received)
                v.secret_fields, v.secrets = before.secret_fields, before.secrets
            old[ident] = v
            new_vs.append(v)
            if len(new_vs) % YIELD_EVERY == 0:
                await asyncio.sleep(0)  # see YIELD_EVERY
        for v in rewatch:
            log.info("%s: failed before; restarting it (meta.rewatch)", v.ident)
            await self._stop_vertex(v, leaving=False)
            fresh = Vertex(self, v.res)
            fresh.watch_ready = False
            self._unready += 1
            fresh.secret_fields, fresh.secrets = v.secret_fields, v.secrets
            old[v.ident] = fresh
            new_vs.append(fresh)
            replaced[v.ident] = v
        rewired = not (
            model.edges == self._edges
            and all(
                gone.res.meta.hidden == old[ident].res.meta.hidden
                for ident, gone in replaced.items()
            )
        )
        if not rewired:
            # Same edges (the common live edit): hand each replaced vertex's
            # place to its successor instead of rewiring the whole graph.
            for ident, gone in replaced.items():
                _take_place(gone, old[ident])
        else:
            # every vertex new (a first graph): all are held back, so wiring may
            # yield too; with kept vertices it must not (one could run half-wired)
            await self._rewire(model, may_yield=len(new_vs) == len(old))
        self._edges = list(model.edges)
        if self.settings.graphviz is not None:
            self._write_graphviz(model)
        self._log_swap(model, len(new_vs), len(removed))
        owed = self.store.load() if not self._owed_loaded else Owed()
        self._owed_loaded = True
        for ident, record in owed.reversals.items():
            if ident not in old:
                await self._reverse(ident, record)  # left the graph while we were down
            elif not old[ident].res.meta.reverse:
                self.store.reversal_done(old[ident].res.kind, old[ident].res.name)
        for i, v in enumerate(new_vs, 1):
            if v.ident in owed.refresh:
                v.refresh_flag = True
            # New vertices were held back (not ready) so that nothing runs one
            # before its init, while this loop yields: a kept parent that succeeds
            # meanwhile pokes its children. Each is released as it starts.
            v.watch_ready = True
            self._unready -= 1
            await self._start_vertex(v)
            if i % YIELD_EVERY == 0:
                await asyncio.sleep(0)
        # New vertices start; after a rewire, kept ones that were held back by a
        # parent that is now gone may run too. With the same edges no kept vertex
        # lost a parent (a replaced parent's successor is pending, not clean), so
        # only the new ones are poked: not a pass over all 10k on a 1 % edit.
        for i, v in enumerate(old.values() if rewired else new_vs, 1):
            if v.pending:
                self._poke(v)
            if i % YIELD_EVERY == 0:
                await asyncio.sleep(0)
        self._check_idle()

    async def _rewire(self, model: GraphModel, may_yield: bool) -> None:
        """Wire every edge of `model` from scratch (yielding to the loop now and then
        if `may_yield`: no vertex may run before the wiring is done)."""
        old = self.vertices
        for v in old.values():
            v.parents.clear()
            v.children.clear()
            v.notify_children = ()
            v.send_edges = ()
        seen: set[tuple[str, str, bool]] = set()
        for i, e in enumerate(model.edges, 1):
            if may_yield and i % (10 * YIELD_EVERY) == 0:
                await asyncio.sleep(0)
            a, b = old[e.from_id], old[e.to_id]
            if (e.from_id, e.to_id, False) not in seen:
                seen.add((e.from_id, e.to_id, False))
                a.children.append(b)
                b.parents.append(a)
            if e.send is not None and e.recv is not None:
                if a.send_edges:
                    a.send_edges.append((e.send, b, e.recv))
                else:
                    a.send_edges = [(e.send, b, e.recv)]
            if e.notify and (e.from_id, e.to_id, True) not in seen and not b.res.meta.hidden:
                # a hidden vertex is never applied: no refresh is ever owed to it
                seen.add((e.from_id, e.to_id, True))
                if a.notify_children:
                    a.notify_children.append(b)
                else:
                    a.notify_children = [b]

    def _log_swap(self, model: GraphModel, started: int, stopped: int) -> None:
        first = not self.graph_name
        self.graph_name = model.name or "(unnamed)"
        if first:
            log.info("graph %s loaded: %d vertices", self.graph_name, len(self.vertices))
        else:
            log.info(
                "graph %s swapped: %d vertices, %d started, %d stopped",
                self.graph_name,
                len(self.vertices),
                started,
                stopped,
            )

    async def _receive(self, v: Vertex) -> Resource:
        """Apply received values: a new resource with them, validated, re-initialised."""
        values, v.inbox = v.inbox, {}
        new = _with_values(v.res, _as_declared(v.res, values))
        new.meta.check(new.ident)
        new.validate()  # an InputError here is this vertex's failure
        self._unsubscribe(v)
        if v.watch_task is not None:
            v.watch_task.cancel()
            await _ended(v.watch_task)
            v.watch_task = None
            if not v.watch_ready:
                v.watch_ready = True
                self._unready -= 1
        await self._call_cleanup(v)
        v.res = new
        v.received.update(values)
        await self._start_vertex(v)
        log.info(
            "%s: received %s",
            v.ident,
            v.mask(
                ", ".join(
                    f"{k}={'<secret>' if k in v.secret_fields else _short(val)}"
                    for k, val in values.items()
                )
            ),
        )
        return new

    def _send(self, v: Vertex) -> None:
        values = v.res.sent()
        if not values:
            return
        secret = v.res.secret_sent()
        for send, c, recv in v.send_edges:
            if send not in values:
                continue
            value = values[send]
            # Secrets are marked before the receiver sees the value: a value its
            # sender marks, or one that is a secret the sender received; and what
            # the sender knew is masked for the receiver too (a command that got a
            # password may print it).
            if v.secrets:
                c.secrets |= v.secrets
            if send in secret or (isinstance(value, str) and value in v.secrets):
                c.secret_fields |= {recv}
                if isinstance(value, str) and value:
                    c.secrets |= {value}
            current = c.inbox.get(recv, c.received.get(recv, getattr(c.res, recv, None)))
            if current != value:
                c.inbox[recv] = value
                c.pending = True

    def _write_graphviz(self, model: GraphModel) -> None:
        from evergraph.engine.render import to_dot

        path = self.settings.graphviz
        assert path is not None
        try:  # maybe in /tmp: never through a symlink planted at a temporary name
            atomic_write(path, to_dot(model).encode(), mode=0o644, dir_mode=0o755)
        except OSError as e:
            log.error("cannot write the graphviz file %s: %s", path, e)

    async def _start_vertex(self, v: Vertex) -> None:
        res = v.res
        try:
            await res.init(v)
            for member in _members(res):
                await member.init(v)
        except Exception as e:
            self._fail_permanently(v, f"init failed: {e}", revive=False)
            return
        if res.meta.hidden:
            return
        poll = res.meta.poll
        if not self.settings.watch or poll < 0:
            return
        if self.one_shot and (poll > 0 or not res.watches()):
            return  # see `one_shot`: ready at once, as under --no-watch
        if poll == 0:
            try:
                v.unsubscribe = res.subscribe()
                if v.unsubscribe is not None and _members(res):
                    # members of a group watch passively too; one unsubscribe for all
                    subs = [v.unsubscribe, *(m.subscribe() for m in _members(res))]

                    def unsubscribe_all() -> None:
                        for u in subs:
                            if u is not None:
                                u()

                    v.unsubscribe = unsubscribe_all
            except Exception as e:
                self._fail_permanently(v, f"watch failed: {e}", revive=False)
                return
            if v.unsubscribe is not None:
                self.subscriptions += 1
                return
        if poll > 0:
            self.subscriptions += 1
        if poll > 0 or res.watches():
            v.watch_ready = False
            self._unready += 1
            assert self._tg is not None
            v.watch_task = self._tg.create_task(self._watch(v))

    async def _stop_vertex(self, v: Vertex, leaving: bool = True) -> None:
        """Stop a vertex; `leaving`: its resource leaves the graph (not merely replaced)."""
        self._unsubscribe(v)
        repair = self._repairs.pop(v, None)
        if repair is not None:
            repair.cancel()
        if v.watch_task is not None:
            v.watch_task.cancel()
            await _ended(v.watch_task)
        if v.apply_task is not None:
            # The old graph's work in flight is allowed to finish.
            await _ended(v.apply_task)
        if not v.watch_ready:
            v.watch_ready = True
            self._unready -= 1
        if leaving and v.res.meta.realize and not v.ever_ok and not v.failed:
            await self._realize(v)
        await self._call_cleanup(v)
        if leaving and v.res.meta.reverse:
            record = self.store.load_reversal(v.res.kind, v.res.name)
            if record is not None:
                await self._reverse(v.ident, record)

    def _capture_reversal(self, v: Vertex) -> None:
        """Before the first apply: record how to restore the state found now."""
        res = v.res
        v.reversal_saved = True
        if self.store.has_reversal(res.kind, res.name):
            return  # captured by an earlier run: that is the state before us
        rev = res.reversal()
        if rev is None:
            return
        record: dict[str, Any] = {"kind": rev.kind, "params": msgspec.to_builtins(rev)}
        try:
            if v.secrets:
                # what it restores may be the previous secret: sealed with the host key
                record["secret_fields"] = sorted(v.secret_fields)
                self.store.save_reversal(res.kind, res.name, record, seal=self.keys().seal_local)
            else:
                self.store.save_reversal(res.kind, res.name, record)
        except (OSError, ResourceError) as e:
            log.error("%s: cannot persist its reversal: %s", v.ident, v.mask(str(e)))

    async def _reverse(self, ident: str, record: dict[str, Any]) -> None:
        """Apply a persisted reversal once; on success forget it."""
        if self.store.is_sealed(record):
            try:
                record = self.store.open_reversal(record, self.keys().open_local)
            except Exception as e:
                log.error("%s: sealed reversal does not open here (kept): %s", ident, e)
                return
        kind_name = str(record.get("kind"))
        if self.registry.get(kind_name) is None:
            log.error("%s: reversal of unknown kind %r kept for later", ident, kind_name)
            return
        try:
            rev = build(self.registry, kind_name, dict(record["params"]), f"reversal of {ident}")
        except (InputError, TypeError, KeyError, ValueError) as e:
            log.error("%s: invalid reversal record dropped: %s", ident, e)
            kind, _, rest = ident.partition("[")
            self.store.reversal_done(kind, rest[:-1])
            return
        if self.settings.noop:
            log.info("%s: would reverse (noop)", ident)
            return
        scratch = Vertex(self, rev)
        params, fields = record.get("params"), record.get("secret_fields")
        if isinstance(params, dict) and isinstance(fields, list):
            for f in fields:
                value = params.get(f) if isinstance(f, str) else None
                if isinstance(value, str) and value:
                    scratch.secret_fields |= {f}
                    scratch.secrets |= {value}
        try:
            await rev.init(scratch)
            await rev.check_apply(True)
            await rev.cleanup()
        except Exception as e:
            log.error(
                "%s: reversal failed (kept, retried at next start): %s", ident, scratch.mask(str(e))
            )
            return
        kind, _, rest = ident.partition("[")
        self.store.reversal_done(kind, rest[:-1])
        log.info("%s: left the graph: reversed", ident)

    async def _realize(self, v: Vertex) -> None:
        """meta.realize: one successful apply before the resource may leave. Like any
        run, it waits for its parents to succeed, and in noop it only checks."""
        stuck = await self._parents_settled(v)
        if stuck is not None:
            log.error(
                "%s: left the graph unrealized: its parent %s has not succeeded",
                v.ident,
                stuck.ident,
            )
            return
        apply = not (self.settings.noop or v.res.meta.noop)
        log.info(
            "%s: leaving the graph before it was ever applied: %s once",
            v.ident,
            "applying" if apply else "checking (noop)",
        )
        try:
            clean = await self._guarded_check_apply(v, v.res, apply)
            v.reported = None
            v.ok = v.ever_ok = True
            v.pending = False
            if not clean:
                log.info("%s: %s", v.ident, "applied" if apply else "would change (noop)")
        except Exception as e:
            log.error("%s: could not be realized before removal: %s", v.ident, v.mask(str(e)))

    async def _parents_settled(self, v: Vertex) -> Vertex | None:
        """Wait until every parent of `v` is clean: None then. Else the ancestor that
        will not succeed by itself (failed, retrying, or gone from the graph)."""
        while not all(p.clean for p in v.parents):
            stuck = self._stuck_ancestor(v)
            if stuck is not None:
                return stuck
            waiter = asyncio.get_running_loop().create_future()
            self._progress.append(waiter)
            await waiter
        return None

    def _stuck_ancestor(self, v: Vertex) -> Vertex | None:
        """An ancestor holding `v` back that will not succeed by itself; None while each
        one that is not clean is running or due to run."""
        seen: set[int] = set()
        todo = [p for p in v.parents if not p.clean]
        while todo:
            p = todo.pop()
            if id(p) in seen or p.clean:
                continue
            seen.add(id(p))
            if (
                p.failed
                or p.retry_wait
                or not (p.pending or p.running)
                or self.vertices.get(p.ident) is not p
            ):
                return p
            if not p.running:
                todo.extend(q for q in p.parents if not q.clean)  # held back by these
        return None

    def _unsubscribe(self, v: Vertex) -> None:
        if v.unsubscribe is not None:
            unsubscribe, v.unsubscribe = v.unsubscribe, None
            try:
                unsubscribe()
            except Exception as e:
                log.error("%s: unsubscribing its watch failed: %s", v.ident, e)

    async def _call_cleanup(self, v: Vertex) -> None:
        for res in (v.res, *_members(v.res)):
            try:
                await res.cleanup()
            except Exception as e:
                log.error("%s: cleanup failed: %s", res.ident, v.mask(str(e)))

    async def _follow(self, updates: AsyncIterator[GraphModel]) -> None:
        async for model in updates:
            await self.swap(model)

    # -- watches ----------------------------------------------------------------
    async def _watch(self, v: Vertex) -> None:
        poll = v.res.meta.poll
        if poll > 0:
            v.ready()
            while True:
                await asyncio.sleep(poll)
                v.event()
        retries = v.res.meta.retry
        while True:
            try:
                await v.res.watch()
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if retries == 0:
                    self._fail_permanently(v, f"watch failed: {e}", revive=False)
                    if not v.watch_ready:
                        v.watch_ready = True
                        self._unready -= 1
                    self._check_idle()
                    return
                if retries > 0:
                    retries -= 1
                log.warning("%s: watch failed (%s); restarting it", v.ident, v.mask(str(e)))
                await asyncio.sleep(v.res.meta.delay / 1000)

    def vertex_ready(self, v: Vertex) -> None:
        if v.watch_ready:
            return
        v.watch_ready = True
        self._unready -= 1
        self._poke(v)
        self._check_idle()

    def vertex_event(self, v: Vertex) -> None:
        if v.failed or v.res.meta.hidden or self.vertices.get(v.ident) is not v:
            # a late event of a vertex already swapped out is dropped; one of a
            # vertex failed for good tries it again (drift is repaired, always)
            if v.failed and v.repair_delay >= 0 and self.vertices.get(v.ident) is v:
                self._revive(v, "an event")
            return
        self.events += 1
        if not v.pending:
            v.pending = True
            self.converger.busy()
            if v.state == "clean" or v.state == "changed":
                self._observe(v, "pending")  # observers time a repair from here
        self._poke(v)

    # -- scheduling ---------------------------------------------------------------
    def _poke(self, v: Vertex) -> None:
        """Queue `v` for a run if it may run now (see the module docstring)."""
        if v.queued or not self._runnable(v):
            return
        if v.res.meta.hidden:
            self._settle_hidden(v)
            return
        v.queued = True
        self._queued += 1
        self._ready.append(v)
        self.converger.busy()
        if not self._drain_scheduled:
            self._drain_scheduled = True
            asyncio.get_running_loop().call_soon(self._drain)

    def _settle_hidden(self, v: Vertex) -> None:
        """A hidden vertex due to run (it received a value) is never applied: it takes
        the values it received, in the graph's order like a run would, and stays clean."""
        v.pending = False
        if v.inbox:
            v.running = True
            self._running += 1
            assert self._tg is not None
            v.apply_task = self._tg.create_task(self._receive_hidden(v))

    async def _receive_hidden(self, v: Vertex) -> None:
        try:
            while v.inbox:
                await self._receive(v)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.error("%s: (hidden) refused the values it received: %s", v.ident, e)
        finally:
            v.running = False
            v.apply_task = None
            self._running -= 1
        for c in v.children:
            self._poke(c)  # held back while it was taking the values
        self._check_idle()

    def _runnable(self, v: Vertex) -> bool:
        if not v.pending or v.running or v.failed or v.retry_wait or not v.watch_ready:
            return False
        if self._stopping or self.vertices.get(v.ident) is not v:
            return False
        for p in v.parents:  # noqa: SIM110 (a loop, `clean` inlined: 3 calls per vertex)
            if not p.ok or p.pending or p.running:
                return False  # held back: p pokes us on success
        return True

    def _drain(self) -> None:
        """Start queued runs; a batch at a time, so the loop stays responsive."""
        self._drain_scheduled = False
        for _ in range(DRAIN_BATCH):
            if not self._ready:
                break
            v = self._ready.popleft()
            v.queued = False
            self._queued -= 1
            if self._runnable(v):  # still: a parent may have turned dirty since
                self._start(v)
        if self._ready:
            self._drain_scheduled = True
            asyncio.get_running_loop().call_soon(self._drain)
        self._check_idle()

    def _start(self, v: Vertex) -> None:
        v.running = True
        v.pending = False
        self._running += 1
        res = v.res
        meta = res.meta
        assert self._tg is not None
        if not (
            res.eager
            and not meta.sema
            and meta.timeout is None
            and meta.limit == math.inf
            and self._global_sema is None
            and not v.inbox
            and not meta.reverse
            and not getattr(res, "_group_members", None)
        ):
            v.apply_task = self._tg.create_task(self._process(v))
            return
        # Eager: a kind whose check_apply is local syscalls runs inline, with
        # no task; if it suspends after all, a task drives the rest.
        apply = not (self.settings.noop or meta.noop)
        v.refresh_now, v.refresh_flag = v.refresh_flag, False
        self._observe(v, "running")
        self._intend(v, apply)
        coro = res.check_apply(apply)
        try:
            yielded = coro.send(None)
        except StopIteration as done:
            self._finish(v, bool(done.value), None, apply)
            return
        except Exception as e:
            self._finish(v, True, _error_text(e, res), apply)
            return
        v.apply_task = self._tg.create_task(self._finish_later(v, coro, yielded, apply))

    async def _finish_later(
        self, v: Vertex, coro: Coroutine[Any, Any, bool], yielded: Any, apply: bool
    ) -> None:
        error: str | None = "cancelled"
        result = True
        try:
            result = bool(await _resume(coro, yielded))
            error = None
        except asyncio.CancelledError:
            raise
        except Exception as e:
            error = _error_text(e, v.res)
        finally:
            self._finish(v, result, error, apply)

    async def _process(self, v: Vertex) -> None:
        res = v.res
        apply = not (self.settings.noop or res.meta.noop)
        v.refresh_now, v.refresh_flag = v.refresh_flag, False
        self._observe(v, "running")
        error: str | None = "cancelled"
        result = True
        try:
            if v.inbox:
                res = await self._receive(v)
            if res.meta.reverse and apply and not v.reversal_saved:
                self._capture_reversal(v)
            self._intend(v, apply)
            result = await self._guarded_check_apply(v, res, apply)
            error = None
        except asyncio.CancelledError:
            raise
        except Exception as e:
            error = _error_text(e, res)
        finally:
            self._finish(v, result, error, apply)

    def _intend(self, v: Vertex, apply: bool) -> None:
        """Write-ahead: before a vertex with notify children may change anything, say
        whom to refresh (see store.py); removed once their flags are written."""
        if apply and v.notify_children:
            v.intent = self.store.intend(v)
            crash_point("intent-written")

    def _finish(self, v: Vertex, result: bool, error: str | None, apply: bool) -> None:
        v.running = False
        v.apply_task = None
        self._running -= 1
        if error is not None:
            if v.intent:
                # the apply failed: no refresh is owed (a retry that changes owes it)
                v.intent = False
                self.store.intent_done(v)
            v.refresh_flag = v.refresh_flag or v.refresh_now  # not served: keep it
            v.refresh_now = False
            v.reported = None
            self._record_failure(v, error)
        else:
            self._record_success(v, result, apply)
        self._check_idle()

    async def _guarded_check_apply(self, v: Vertex, res: Resource, apply: bool) -> bool:
        meta = res.meta
        if meta.limit != math.inf:
            with self._waiting_for(v):
                await self._take_token(v, meta.limit, meta.burst)
        grouped = getattr(res, "_group_members", None)
        if grouped:
            # a group holds the semaphores of all its members
            semas = semaphores(s for r in (res, *grouped) for s in r.meta.sema)
            return await self._guarded(v, lambda: res.check_apply_group(apply), semas, meta.timeout)
        if not meta.sema and meta.timeout is None and self._global_sema is None:
            return bool(await res.check_apply(apply))  # the common case, kept lean
        return await self._guarded(
            v, lambda: res.check_apply(apply), semaphores(meta.sema), meta.timeout
        )

    async def _guarded(
        self,
        v: Vertex,
        call: Callable[[], Awaitable[bool]],
        sema: list[tuple[str, int]],
        timeout: float | None,
    ) -> bool:
        """`call()` holding the semaphores `sema` (normalised and ordered by id, as
        `semaphores` gives them: every holder takes shared ones in one order, so
        they cannot deadlock), after the global one."""
        semas = [self._sema(sid, n) for sid, n in sema]
        if self._global_sema is not None:
            semas.insert(0, self._global_sema)
        async with contextlib.AsyncExitStack() as stack:
            with self._waiting_for(v):
                for s in semas:
                    await stack.enter_async_context(s)
            if timeout is not None:
                async with asyncio.timeout(timeout):
                    return bool(await call())
            return bool(await call())
        raise AssertionError("unreachable")  # pragma: no cover

    @contextlib.contextmanager
    def _waiting_for(self, v: Vertex) -> Iterator[None]:
        """While `v`'s run waits for a token or a semaphore: a stop cancels it at once."""
        mine = v.apply_task is not None and v.apply_task is asyncio.current_task()
        if mine:
            self._waiting.add(v)
        try:
            yield
        finally:
            if mine:
                self._waiting.discard(v)

    async def _take_token(self, v: Vertex, limit: float, burst: int) -> None:
        """Token bucket: `burst` starts at once, then `limit` per second."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        if v.bucket_at == 0.0:
            v.tokens, v.bucket_at = float(burst), now
        v.tokens = min(float(burst), v.tokens + (now - v.bucket_at) * limit)
        v.bucket_at = now
        if v.tokens < 1.0:
            wait = (1.0 - v.tokens) / limit
            await asyncio.sleep(wait)
            v.tokens, v.bucket_at = 1.0, loop.time()
        v.tokens -= 1.0

    def _sema(self, sid: str, n: int) -> asyncio.Semaphore:
        key = f"{sid}:{n}"
        s = self._semas.get(key)
        if s is None:
            s = self._semas[key] = asyncio.Semaphore(n)
        return s

    def _record_success(self, v: Vertex, was_clean: bool, applied: bool) -> None:
        intent, v.intent = v.intent, False
        self._record_success_(v, was_clean, applied)
        if intent:
            self.store.intent_done(v)  # the children's flags (if any) are written

    def _record_success_(self, v: Vertex, was_clean: bool, applied: bool) -> None:
        v.ok = True
        v.ever_ok = True
        v.last_error = None
        if v.refresh_now and not v.refresh_flag and applied:
            crash_point("child-applied")
            self.store.refresh_served(v)
        v.refresh_now = False
        if v.res.meta.retryreset:
            v.retries_left = v.res.meta.retry
        if v.repair_delay:
            v.repair_delay = 0.0  # repaired: a later failure backs off from the start
        if was_clean:
            if v.reported is not None:
                v.reported = None  # differences reported, yet all was well: none
            v.clean_count += 1
            why = v.unknown_why
            if why is None:
                self._observe(v, "clean")
            else:  # a noop run that could not tell (--noop-no-commands)
                v.unknown_why = None
                v.last_error = why
                self._observe(v, "unknown")
        else:
            v.changed_count += 1
            v.last_changed = time.time()
            diffs = not applied or self.settings.diff
            reported, v.reported = v.reported, None
            v.changes = changes.build(reported, v.secret_fields, v.mask, diffs) if reported else ()
            if applied:
                self._log_changes(v, "applied", diffs)
                crash_point("parent-changed")
                for c in v.notify_children:
                    # Persist before anything else can happen: a crash between
                    # this change and the child's apply must not lose it.
                    self.store.owe_refresh(c)
                    c.refresh_flag = True
                    c.pending = True
                crash_point("refresh-owed")
            else:
                self._log_changes(v, "would change (noop)", diffs)
            self._observe(v, "changed")
        if v.send_edges:
            self._send(v)
        for c in v.children:
            self._poke(c)
        if v.pending:
            self._poke(v)

    def _log_changes(self, v: Vertex, what: str, diffs: bool) -> None:
        """One log record for a run that changed something (or would): the fields
        changed; with `diffs` (noop, `--diff`) a line per change with its diff, and
        whom a change notifies or sends values to. Structured logs get them all from
        the record's `data` (`changes.record_data`)."""
        done = v.changes
        notify = [c.ident for c in v.notify_children]
        send = [f"{value} → {c.ident}.{field}" for value, c, field in v.send_edges]
        data = changes.record_data(v.ident, what != "applied", done, notify, send)
        # an applied change is an effect: the log writes it through (cli/logs.py)
        extra = {"data": data, "effect": what == "applied"}
        if not done and not (diffs and (notify or send)):
            log.info("%s: %s", v.ident, what, extra=extra)
            return
        head = f"{v.ident}: {what}: {changes.summary(done)}" if done else f"{v.ident}: {what}"
        if not diffs:
            log.info("%s", head, extra=extra)
            return
        out = [head, *changes.lines(done, diffs=True)]
        notifies, sends = ("would notify", "would send") if data["noop"] else ("notifies", "sends")
        out.extend(f"  {notifies} {ident}" for ident in notify)
        out.extend(f"  {sends} {line}" for line in send)
        log.info("%s", "\n".join(out), extra=extra)

    def _record_failure(self, v: Vertex, error: str) -> None:
        error = v.mask(error)
        v.unknown_why = None
        v.ok = False
        v.fail_count += 1
        v.last_error = error
        if v.retries_left == 0 or self._stopping:
            self._fail_permanently(v, error)
            return
        if v.retries_left > 0:
            v.retries_left -= 1
        log.warning(
            "%s: %s (retrying in %d ms, %s left)",
            v.ident,
            error,
            v.res.meta.delay,
            "forever" if v.retries_left < 0 else v.retries_left,
        )
        self._observe(v, "retrying")
        v.retry_wait = True
        self._retrying += 1
        assert self._tg is not None
        t = self._tg.create_task(self._retry_later(v, v.res.meta.delay / 1000))
        self._timers.add(t)
        t.add_done_callback(self._timers.discard)

    async def _retry_later(self, v: Vertex, delay: float) -> None:
        try:
            await asyncio.sleep(delay)
        finally:
            v.retry_wait = False
            self._retrying -= 1
        v.pending = True
        self._poke(v)
        self._check_idle()

    def _fail_permanently(self, v: Vertex, error: str, revive: bool = True) -> None:
        """`v` failed for good (its retries spent). Unless `revive` is False (its init
        or watch failed: nothing to try again), its next event or a backoff timer
        runs it again (`_revive`): a transient cause (a missing parent, a full disk)
        never leaves it failed for good."""
        error = v.mask(error)
        v.ok = False
        v.failed = True
        v.pending = False
        v.last_error = error
        log.error("%s: %s", v.ident, error)
        self._observe(v, "failed")
        if not revive:
            v.repair_delay = -1.0
            return
        cap = self.settings.repair_backoff_max
        # a one-shot run ends at convergence: a timer could only delay it
        if cap <= 0 or self._stopping or self.one_shot or not self.settings.watch:
            return
        first = max(REPAIR_FIRST, v.res.meta.delay / 1000)
        v.repair_delay = delay = min(cap, v.repair_delay * 2 if v.repair_delay > 0 else first)
        log.info("%s: tried again at its next event, or in %s", v.ident, _took(delay))
        assert self._tg is not None
        old = self._repairs.pop(v, None)
        if old is not None:
            old.cancel()
        self._repairs[v] = self._tg.create_task(self._repair_later(v, delay))

    async def _repair_later(self, v: Vertex, delay: float) -> None:
        await asyncio.sleep(delay)
        if self._repairs.get(v) is asyncio.current_task():
            del self._repairs[v]
        if v.failed and not self._stopping and self.vertices.get(v.ident) is v:
            self._revive(v, f"backoff {_took(delay)}")

    def _revive(self, v: Vertex, why: str) -> None:
        """Run a vertex failed for good again, with its retry budget anew: it
        returns to clean when a run succeeds, or fails for good again (and backs off
        longer). Meanwhile observers saw it failed, with its last error."""
        timer = self._repairs.pop(v, None)
        if timer is not None and timer is not asyncio.current_task():
            timer.cancel()
        log.info("%s: failed before; trying again (%s)", v.ident, why)
        v.failed = False
        v.retries_left = v.res.meta.retry
        v.pending = True
        self.converger.busy()
        self._poke(v)

    # -- convergence and stopping ------------------------------------------------------
    def _check_idle(self) -> None:
        if self._progress:
            for waiter in self._progress:
                if not waiter.done():
                    waiter.set_result(None)
            self._progress.clear()
        if self._running or self._retrying or self._unready or self._queued:
            return
        self.converger.idle()

    def _on_converged(self) -> None:
        # one walk of the vertices (at 1M vertices each walk holds the loop ~0.1 s)
        failed: list[str] = []
        named, others = self._recap_statuses(failed)
        changed = sum(1 for s in named if s.changed_count)
        took = self.clock.monotonic() - self.started
        if failed:
            log.error(
                "converged with %d of %d vertices not clean (%s) after %.2fs",
                len(failed),
                len(self.vertices),
                ", ".join(failed[:5]) + (", ..." if len(failed) > 5 else ""),
                took,
            )
        else:
            log.info(
                "converged: %d vertices clean, %d changed, after %.2fs",
                len(self.vertices),
                changed,
                took,
            )
        text, data = self.recaps.take(named, "converged", self.settings.noop, others)
        log.info("%s", text, extra={"data": data})
        if self.settings.converged_exit or not self.settings.watch:
            self._stop.set()  # without watches, nothing would ever run again

    def _recap_statuses(
        self, failed: list[str] | None = None
    ) -> tuple[list[VertexStatus], tuple[int, int]]:
        """Snapshots of the vertices a recap may name (ever changed, or failing), and
        (how many others, how many of those are clean): no snapshot per clean vertex.
        `failed` gets the idents of the vertices not clean."""
        named: list[VertexStatus] = []
        others = clean = 0
        for v in self.vertices.values():
            state = v.state
            if failed is not None and not v.ok:
                failed.append(v.ident)
            if v.changed_count or state == "failed" or state == "retrying" or state == "unknown":
                named.append(v.status())
            else:
                others += 1
                if state == "clean" or state == "changed":
                    clean += 1
        return named, (others, clean)

    def _recap_at_exit(self) -> None:
        """At exit, a last recap if it has news (the run never converged, or changed
        or failed something since the last recap)."""
        if not self.vertices:
            return
        named, others = self._recap_statuses()
        if self.recaps.news(named):
            text, data = self.recaps.take(named, "exit", self.settings.noop, others)
            log.info("%s", text, extra={"data": data})

    async def _max_runtime(self, seconds: float) -> None:
        """A hard bound: in-flight applies are cancelled (their commands get SIGTERM,
        then SIGKILL after a grace)."""
        await asyncio.sleep(max(0.0, self.started + seconds - self.clock.monotonic()))
        if self.busy() or not self.vertices:
            # work left undone (a check pending or running, a watch not ready, no
            # graph yet): the run was cut short, which is no success (exit 1)
            self._cut_short = True
            log.error(
                "max runtime of %ss reached with work undone: stopping, cancelling "
                "in-flight applies (exit status 1)",
                seconds,
            )
        else:
            log.info("max runtime of %ss reached: stopping", seconds)
        self._hard_stop.set()
        self._stop.set()

    async def _shutdown(self, aux: list[asyncio.Task[Any]]) -> None:
        self._stopping = True
        self.converger.close()
        for t in [*aux, *self._timers, *self._repairs.values()]:
            t.cancel()
        for i, v in enumerate(list(self.vertices.values()), 1):
            self._unsubscribe(v)
            if v.watch_task is not None:
                v.watch_task.cancel()
            if i % YIELD_EVERY == 0:
                await asyncio.sleep(0)  # a 1M graph: keep the loop (and leases) turning
        for v in self._waiting:  # changed nothing yet: nothing to finish
            if v.apply_task is not None:
                v.apply_task.cancel()
        applies = {v.apply_task for v in self.vertices.values() if v.apply_task is not None}
        if applies:
            await self._end_applies(applies)
        nothing = Resource.cleanup  # (most kinds take nothing in init: no await for them)
        for i, v in enumerate(list(self.vertices.values()), 1):
            if type(v.res).cleanup is not nothing or _members(v.res):
                await self._call_cleanup(v)
            if i % YIELD_EVERY == 0:
                await asyncio.sleep(0)

    async def _end_applies(self, applies: set[asyncio.Task[None]]) -> None:
        """Let in-flight applies finish, for `settings.stop_grace` seconds at most, or
        until a hard stop; then cancel what still runs and wait for it to end."""
        loop = asyncio.get_running_loop()
        grace = self.settings.stop_grace
        deadline = loop.time() + grace
        hard = asyncio.ensure_future(self._hard_stop.wait())
        try:
            while applies and not hard.done():
                left = deadline - loop.time()
                if left <= 0:
                    log.warning("applies still running %ss after the stop: cancelling them", grace)
                    break
                done, _ = await asyncio.wait(
                    [*applies, hard], timeout=left, return_when=asyncio.FIRST_COMPLETED
                )
                applies -= done
            for t in applies:
                t.cancel()
            if applies:
                await asyncio.wait(applies)
        finally:
            hard.cancel()


def _parents_first(idents: list[str], vertices: dict[str, Vertex]) -> list[str]:
    """`idents` ordered so that each comes after those of its parents among them."""
    among = set(idents)
    done: set[str] = set()
    out: list[str] = []
    for root in idents:
        stack = [(root, False)]
        while stack:
            ident, expanded = stack.pop()
            if expanded:
                out.append(ident)
                continue
            if ident in done:
                continue
            done.add(ident)
            stack.append((ident, True))
            stack.extend(
                (p.ident, False)
                for p in vertices[ident].parents
                if p.ident in among and p.ident not in done
            )
    return out


def _carry_retries(prev: Vertex, new: Vertex) -> int:
    """Retries left for a replaced vertex: the old budget's use, against the new budget."""
    budget = new.res.meta.retry
    if budget < 0 or prev.res.meta.retry < 0:
        return budget
    used = max(0, prev.res.meta.retry - prev.retries_left)
    return max(0, budget - used)


def _as_declared(res: Resource, values: dict[str, object]) -> dict[str, object]:
    """Received values as the receiver declares them: a sender of `Any` (value) is
    only checked here, when a value arrives; a mismatch is an InputError."""
    types = {f.name: f.type for f in msgspec.structs.fields(res)}
    out: dict[str, object] = {}
    for k, val in values.items():
        try:
            out[k] = msgspec.convert(val, types[k])
        except msgspec.ValidationError as e:
            raise InputError(f"received {k}: {e}", res.ident) from None
    return out


def _with_values(res: Resource, values: dict[str, object]) -> Resource:
    """A copy of `res` with some parameters replaced (group members kept)."""
    new = msgspec.structs.replace(res, **values)
    if res.group_members:
        new.group_members.extend(res.group_members)
    return new


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _take_place(gone: Vertex, new: Vertex) -> None:
    """Give `new` the edges of the vertex it replaces, in both directions."""
    new.parents, new.children = gone.parents, gone.children
    new.notify_children, new.send_edges = gone.notify_children, gone.send_edges
    gone.parents, gone.children, gone.notify_children, gone.send_edges = [], [], (), ()
    for p in new.parents:
        p.children[p.children.index(gone)] = new
        kids = p.notify_children
        if isinstance(kids, list) and gone in kids:
            kids[kids.index(gone)] = new
        if p.send_edges:
            p.send_edges = [(s, new if c is gone else c, r) for s, c, r in p.send_edges]
    for c in new.children:
        c.parents[c.parents.index(gone)] = new


def _error_text(e: BaseException, res: Resource) -> str:
    if isinstance(e, TimeoutError):
        return f"check_apply timed out after {res.meta.timeout}s"
    if isinstance(e, InputError):
        return str(e)
    return str(e) or type(e).__name__


async def _resume(coro: Coroutine[Any, Any, bool], yielded: Any) -> bool:
    """Drive a coroutine that was started outside a task and then suspended.

    Does what a Task's step does: wait for what it yielded (a future, or a
    bare yield), then send into it; an exception of the wait (the future's
    own, or our cancellation) is thrown into it.
    """
    while True:
        try:
            if yielded is None:
                await asyncio.sleep(0)
            else:
                await _wait(yielded)
        except BaseException as exc:
            try:
                yielded = coro.throw(exc)
            except StopIteration as done:
                return bool(done.value)
            continue
        try:
            yielded = coro.send(None)
        except StopIteration as done:
            return bool(done.value)


@types.coroutine
def _wait(fut: Any) -> Generator[Any, None, None]:
    """Wait until `fut` is done, leaving its result for the coroutine that awaits it."""
    while not fut.done():
        fut._asyncio_future_blocking = True
        yield fut


async def _ended(task: asyncio.Task[Any]) -> None:
    """Wait for `task` to end, whatever its outcome (its own to report). Our own
    cancellation still propagates: `suppress(BaseException)` around `await task`
    swallowed it, and a swap cancelled by a stop (the graph-update follower, mid-swap)
    went on to wait for the next graph, holding the agent's exit forever."""
    await asyncio.wait([task])
    if not task.cancelled():
        task.exception()  # retrieved: its outcome was reported where it happened


def _members(res: Resource) -> list[Resource]:
    """Group members without creating the list on resources that have none (hot path)."""
    members: list[Resource] = getattr(res, "_group_members", None) or []
    return members
