"""The engine's state, shared by the subjects it is split into.

`Engine` (engine.py) is one object whose methods live in one module per subject,
the way mgmt's engine/graph spreads `*Engine` methods over files: scheduling
(scheduling.py), graph swap (swap.py), outcomes and retry (outcomes.py), the
guard around resource code (guard.py), send/recv (sendrecv.py) and reversal
(reverse.py). Each subject is a class over `EngineState`: the attributes all
of them read, and the signatures a subject calls in another one (the stubs
below, each overridden by the subject that owns it). No subject imports
another's class (swap.py borrows sendrecv.py's `with_values` function);
`Engine` puts them together, and import-linter checks none imports engine.py.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from evergraph._util.clock import SYSTEM, Clock
from evergraph.engine.contract import Registry, Resource, default_registry
from evergraph.engine.converger import Converger, print_report
from evergraph.engine.model import Edge, GraphModel
from evergraph.engine.recap import Recaps
from evergraph.engine.recap import took as _took
from evergraph.engine.services import Services
from evergraph.engine.settings import Settings
from evergraph.engine.status import Observer, State
from evergraph.engine.stop import StopSignal
from evergraph.engine.store import VertexStore
from evergraph.engine.vertex import Vertex
from evergraph.errors import InputError

if TYPE_CHECKING:
    from evergraph.cluster.hostkeys import HostKeys
    from evergraph.engine.ahead import Ahead
    from evergraph.engine.changes import Entry
    from evergraph.engine.contract import PathWatcher
    from evergraph.world.kv import KV

log = logging.getLogger("evergraph.engine")

#: runs started per event-loop turn before other work (signals, events) gets a turn
DRAIN_BATCH = 1000
#: vertices built or started between yields to the loop during a swap: a graph of
#: 1M vertices takes seconds to build and start, and the World lease's keep-alive,
#: signals and the HTTP server must get their turn meanwhile (a lease expired
#: during a 1M-vertex swap)
YIELD_EVERY = 1000
#: eager checks that suspended (a write waiting for the disk) at most at once: the
#: drain starts no more until they are down to SUSPENDED_LOW. Without a bound a 10k
#: first apply started all 10k, each holding its task and coroutines while its write
#: waited for the committer (peak RSS 115 MB, against 99 MB with it). Twice the
#: committer's own bound (resources/_commit.py: MAX_PENDING), so that as many again
#: wait for its room, and refilled in batches before it runs dry: with 1024 and a
#: refill at 512 the loop idled between bursts and a first apply took ~0.4 s more
#: CPU; a refill 128 below it does not. Each check waiting holds its task, its
#: coroutines and its write (~3-4 KB of RSS): 2048 raised a 10k first apply's RSS by
#: ~3 MB over 1024 (BENCHMARKS.md, "Issue 28: first-apply memory").
SUSPENDED_MAX = 1024
#: ... and drains again once they are down to this many (a batch, not one at a time)
SUSPENDED_LOW = SUSPENDED_MAX - 128


async def yield_now() -> None:
    """Give the loop a turn (no time passes: not a sleep)."""
    await asyncio.sleep(0)


def members(res: Resource) -> list[Resource]:
    """Group members without creating the list on resources that have none (hot path)."""
    found: list[Resource] = getattr(res, "_group_members", None) or []
    return found


def error_text(e: BaseException, res: Resource) -> str:
    """What a failed check_apply of `res` records (its exception, said plainly)."""
    if isinstance(e, TimeoutError):
        return f"check_apply timed out after {res.meta.timeout}s"
    if isinstance(e, InputError):
        return str(e)
    return str(e) or type(e).__name__


async def ended(task: asyncio.Task[Any]) -> None:
    """Wait for `task` to end, whatever its outcome (its own to report). Our own
    cancellation still propagates: `suppress(BaseException)` around `await task`
    swallowed it, and a swap cancelled by a stop (the graph-update follower, mid-swap)
    went on to wait for the next graph, holding the agent's exit forever."""
    await asyncio.wait([task])
    if not task.cancelled():
        task.exception()  # retrieved: its outcome was reported where it happened


class EngineState:
    #: the log lines of changes not written through (made ahead), held while the
    #: one-shot lane runs a batch and logged together at its end or before any other
    #: line (outcomes.py, `_log_held`); None: each line logged as it comes
    _held: list[Entry] | None = None

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
        services: Services | None = None,
    ) -> None:
        """Everything the resources may use is handed in by the owner (the agent):
        `watcher` (the running inotify hub; None: file watches are refused),
        `world`, `keys` (called on first use: loading keys costs start-up time),
        `services` (what the resources share; the owner closes them. None: the
        engine makes its own and closes it when its run ends)."""
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
        #: what the resources share (connections, locks, the committer)
        self.services = services if services is not None else Services()
        self._own_services = services is None
        self._tg: asyncio.TaskGroup | None = None
        self._running = 0
        self._retrying = 0
        self._unready = 0
        #: the one stop signal: everything about stopping derives from its level
        self.stop = StopSignal()
        #: the shutdown began (see `stopping`)
        self._draining = False
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
        #: eager checks suspended now (see SUSPENDED_MAX)
        self._suspended = 0
        self.store = VertexStore(settings.state_dir)
        self._owed_loaded = False
        self._edges: list[Edge] = []
        self.registry = registry or default_registry
        self._swap_lock = asyncio.Lock()
        converged_timeout = settings.converged_timeout
        if converged_timeout is None and not settings.watch:
            converged_timeout = 0.0  # --no-watch: nothing can change once converged
        self.converger = Converger(
            converged_timeout,
            settings.converged_status_file,
            self._on_converged,
            clock,
            print_report if settings.converged_report else None,
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
        self.one_shot = settings.one_shot
        #: the one-shot lane (scheduling.py, `_drain_lane`): a run that ends once
        #: converged (`one_shot`, or --no-watch) runs each due plain eager vertex
        #: (`lane_fits`) in one fused step, its outcome recorded and its children
        #: queued without the general path's layers; everything else (and what
        #: suspends, fails or changes) takes the general path, in the same order
        self.lane = self.one_shot or not settings.watch
        #: vertices run (and found clean) through the lane, for tests and benchmarks
        self.lane_runs = 0
        #: of which found in their state by the checks run ahead, with no check here
        self.ahead_runs = 0
        #: vertices the child ahead made (recorded changed, with no init and no check)
        self.ahead_made = 0
        #: the checks run ahead for the first graph (ahead.py), once it is swapped in
        self._ahead: Ahead | None = None
        #: passive subscriptions and poll timers set up, for tests and benchmarks
        self.subscriptions = 0
        self.started = clock.monotonic()
        self.graph_name = ""
        #: the first graph's "loaded" line was logged before its swap (express.py)
        self.loaded_said = False
        self.recaps = Recaps()

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

    def _check_idle(self) -> None:
        if self._progress:
            for waiter in self._progress:
                if not waiter.done():
                    waiter.set_result(None)
            self._progress.clear()
        if self._running or self._retrying or self._unready or self._queued:
            return
        self.converger.idle()

    @property
    def stopping(self) -> bool:
        """The shutdown began (the turn after a stop request, see engine._shutdown):
        no run starts, no failure is retried. A run that became due in the turn the
        stop was asked for still starts, and the shutdown lets it finish."""
        return self._draining

    # -- what a subject calls in another (each overridden by its owner) ----------
    # scheduling.py
    def _poke(self, v: Vertex) -> None:
        raise NotImplementedError

    def _inline_ok(self, v: Vertex) -> bool:
        raise NotImplementedError

    def _takes_verdict(self, res: Resource) -> bool:
        raise NotImplementedError

    def _drain(self) -> None:
        raise NotImplementedError

    def vertex_ready(self, v: Vertex) -> None:
        raise NotImplementedError

    def vertex_event(self, v: Vertex) -> None:
        raise NotImplementedError

    # outcomes.py
    def _record_success(self, v: Vertex, was_clean: bool, applied: bool) -> None:
        raise NotImplementedError

    def _record_failure(self, v: Vertex, error: str) -> None:
        raise NotImplementedError

    def _fail_permanently(self, v: Vertex, error: str, revive: bool = True) -> None:
        raise NotImplementedError

    def _revive(self, v: Vertex, why: str) -> None:
        raise NotImplementedError

    def _log_held(self) -> None:
        raise NotImplementedError

    def _finish(self, v: Vertex, result: bool, error: str | None, apply: bool) -> None:
        raise NotImplementedError

    # guard.py
    def _check_apply_inline(self, v: Vertex, apply: bool) -> None:
        raise NotImplementedError

    async def _start_vertex(self, v: Vertex) -> None:
        raise NotImplementedError

    def _init_deferred(self, v: Vertex) -> bool:
        raise NotImplementedError

    async def _finish_later(
        self, v: Vertex, coro: Coroutine[Any, Any, bool], yielded: Any, apply: bool
    ) -> None:
        raise NotImplementedError

    async def _guarded_check_apply(self, v: Vertex, res: Resource, apply: bool) -> bool:
        raise NotImplementedError

    async def _call_cleanup(self, v: Vertex) -> None:
        raise NotImplementedError

    def _unsubscribe(self, v: Vertex) -> None:
        raise NotImplementedError

    # swap.py
    async def swap(self, model: GraphModel) -> None:
        raise NotImplementedError

    # sendrecv.py
    async def _receive(self, v: Vertex) -> Resource:
        raise NotImplementedError

    def _send(self, v: Vertex) -> None:
        raise NotImplementedError

    # reverse.py
    def _capture_reversal(self, v: Vertex) -> None:
        raise NotImplementedError

    async def _reverse(self, ident: str, record: dict[str, Any]) -> None:
        raise NotImplementedError

    # engine.py
    def keys(self) -> HostKeys:
        raise NotImplementedError

    def request_exit(self, code: int, by: str) -> None:
        raise NotImplementedError

    def _on_converged(self) -> None:
        raise NotImplementedError
