"""A vertex: one resource instance in the running graph, and its handle.

The vertex is also the `Handle` a resource receives in `init`, so a graph of
100k vertices carries one object per resource, not two. It talks to what runs
it through `VertexHost` (the engine, in a run; a small fake in a test), never
to the engine's class: a vertex can be built and tested without an engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

from evergraph.engine.contract import PathWatcher, Resource
from evergraph.engine.masking import MaskingLogger, mask
from evergraph.engine.services import Services
from evergraph.engine.settings import Settings
from evergraph.engine.status import Change, State, VertexStatus
from evergraph.engine.store import vertex_dir
from evergraph.errors import ResourceError

if TYPE_CHECKING:
    from evergraph.cluster.hostkeys import HostKeys
    from evergraph.world.kv import KV

_loggers: dict[str, logging.Logger] = {}


_NONE: frozenset[str] = frozenset()
#: the received values of a vertex that has none (most): one shared, read-only empty
#: mapping, not two dicts a vertex (1.3 MB at 10k); a value received replaces it
NO_VALUES: Mapping[str, object] = MappingProxyType({})

#: `Vertex.ahead` besides a place among the resources checked ahead (ahead.py):
#: initialised as usual; its verdict taken, not initialised; made by a child ahead
#: (recorded changed, not initialised; its log line is not written through: the
#: child's journal holds it)
INITIALISED = -1
VERDICT_USED = -2
MADE_AHEAD = -3


class VertexHost(Protocol):
    """What a vertex (and the resource, through its handle) asks of what runs it."""

    @property
    def settings(self) -> Settings: ...

    @property
    def hostname(self) -> str: ...

    @property
    def watcher(self) -> PathWatcher | None:
        """The running inotify hub (None: file watches are refused)."""
        ...

    @property
    def world(self) -> KV | None: ...

    @property
    def services(self) -> Services:
        """What the resources share (connections, locks, the committer)."""
        ...

    def keys(self) -> HostKeys:
        """The host's key pairs (ResourceError if there are none)."""
        ...

    def vertex_ready(self, v: Vertex) -> None:
        """`v`'s watch is ready: it may run."""
        ...

    def vertex_event(self, v: Vertex) -> None:
        """`v`'s watch saw a change: it must be checked again."""
        ...

    def request_exit(self, code: int, by: str) -> None:
        """End the run with exit status `code` (asked for by `by`)."""
        ...


class Vertex:
    __slots__ = (
        "ahead",
        "apply_task",
        "bucket_at",
        "changed_count",
        "changes",
        "children",
        "clean_count",
        "duration",
        "ever_ok",
        "fail_count",
        "failed",
        "host",
        "ident",
        "inbox",
        "intent",
        "last_changed",
        "last_error",
        "notify_children",
        "ok",
        "parents",
        "pending",
        "queued",
        "received",
        "refresh_flag",
        "refresh_now",
        "repair_delay",
        "reported",
        "res",
        "retries_left",
        "retry_wait",
        "reversal_saved",
        "running",
        "secret_fields",
        "secrets",
        "send_edges",
        "since",
        "state",
        "tokens",
        "unknown_why",
        "unsubscribe",
        "upstream_changed",
        "watch_ready",
        "watch_task",
    )

    def __init__(self, host: VertexHost, res: Resource, ident: str | None = None) -> None:
        self.host = host
        self.res = res
        #: (`ident`: `res.ident`, given by a swap that has it: its model's key)
        self.ident = res.ident if ident is None else ident
        self.parents: list[Vertex] = []
        self.children: list[Vertex] = []
        #: (these two, rare, stay the shared empty tuple until an edge needs them)
        self.notify_children: list[Vertex] | tuple[()] = ()
        #: (value sent, receiving vertex, its field) for each send/recv edge out of here
        self.send_edges: list[tuple[str, Vertex, str]] | tuple[()] = ()
        #: received values now in effect on `res`, and ones waiting for the next run
        #: (replaced, never changed in place: NO_VALUES is shared)
        self.received: Mapping[str, object] = NO_VALUES
        self.inbox: Mapping[str, object] = NO_VALUES
        #: received fields whose sender marked them secret: never logged
        #: (frozensets, replaced when they grow: the empty one is shared, not 216
        #: bytes per vertex, and most vertices never receive anything)
        self.secret_fields: frozenset[str] = _NONE
        #: secret values this vertex received or its senders knew: masked in any
        #: text about it (log lines, errors, status); kept after a new value came
        self.secrets: frozenset[str] = _NONE
        hidden = res.meta.hidden
        #: needs a check: at startup, after an event, a refresh or a retry
        self.pending = not hidden
        self.running = False
        #: poked and waiting in the engine's ready queue
        self.queued = False
        #: last check_apply succeeded (hidden vertices count as clean)
        self.ok = hidden
        #: failed for good: retries exhausted (an event or the repair backoff
        #: tries it again: see outcomes.py)
        self.failed = False
        self.retry_wait = False
        self.retries_left = res.meta.retry
        #: failed for good: seconds until it is tried again by timer (doubling);
        #: 0: not failed since its last success; -1: never revived (init failed)
        self.repair_delay = 0.0
        self.watch_ready = True
        #: a notify edge asked for a refresh (persisted until consumed)
        self.refresh_flag = False
        #: the refresh the current run is serving (what `refresh()` answers)
        self.refresh_now = False
        self.last_error: str | None = None
        #: this run could not tell whether it would change (`unknown()`): why
        self.unknown_why: str | None = None
        self.apply_task: asyncio.Task[None] | None = None
        self.watch_task: asyncio.Task[None] | None = None
        self.unsubscribe: Callable[[], None] | None = None
        #: token bucket for meta.limit/burst
        self.tokens = 0.0
        self.bucket_at: float | None = None
        #: its resource's place among those checked ahead (ahead.py) while its
        #: init waits for the verdict (guard.py `_init_deferred` initialises it if
        #: it has to run); VERDICT_USED: its verdict taken, not initialised;
        #: MADE_AHEAD: made by a child, not initialised; INITIALISED: as usual
        self.ahead = INITIALISED
        #: something this vertex depends on (transitively) changed in this run: a
        #: verdict from ahead no longer holds (None: not worked out yet)
        self.upstream_changed: bool | None = None
        #: the reversal was captured (or found on disk) before our first apply
        self.reversal_saved = False
        #: succeeded at least once (meta.realize)
        self.ever_ok = False
        self.changed_count = 0
        self.clean_count = 0
        self.fail_count = 0
        #: a write-ahead intent is on disk for the apply under way (store.py)
        self.intent = False
        #: the state observers last saw, and since when
        self.state: State = "pending"
        self.since = 0.0
        #: how long the last check_apply took (seconds), and when it last changed
        #: something (wall clock), with what it changed (resources report it)
        self.duration = 0.0
        self.last_changed: float | None = None
        self.changes: tuple[Change, ...] = ()
        #: what the run under way reported through `changed()` (None: nothing); made
        #: `changes` by the engine if the run changed something (engine/changes.py)
        self.reported: list[tuple[str, object, object, bool]] | None = None

    def status(self) -> VertexStatus:
        return VertexStatus(
            self.ident,
            self.res.kind,
            self.res.name,
            self.state,
            self.since,
            self.mask(self.last_error) if self.last_error is not None else None,
            self.changed_count,
            self.clean_count,
            self.fail_count,
            self.duration,
            self.last_changed,
            self.changes,
        )

    def __repr__(self) -> str:
        return f"<Vertex {self.ident}>"

    def mask(self, text: str) -> str:
        """`text` with the secrets this vertex knows replaced by `********`."""
        return mask(text, self.secrets) if self.secrets else text

    @property
    def clean(self) -> bool:
        """Parents must be clean for a child to run."""
        return self.ok and not self.pending and not self.running

    # -- Handle -----------------------------------------------------------
    @property
    def logger(self) -> logging.Logger:
        kind = self.res.kind
        lg = _loggers.get(kind)
        if lg is None:
            lg = _loggers[kind] = logging.getLogger(f"evergraph.resource.{kind}")
        if self.secrets:  # what the resource logs passes through the mask
            return MaskingLogger(lg, self.mask)
        return lg

    @property
    def hostname(self) -> str:
        return self.host.hostname

    def state_path(self) -> Path:
        """`vertices/<kind>/<name-encoded>` under the state dir (see `vertex_dir`)."""
        return vertex_dir(self.host.settings.state_dir, self.res.kind, self.res.name)

    @property
    def state_dir(self) -> Path:
        d = self.state_path()
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        return d

    @property
    def watcher(self) -> PathWatcher:
        if self.host.watcher is None:
            raise ResourceError("this run has no file watcher (the engine's owner gave none)")
        return self.host.watcher

    @property
    def keys(self) -> HostKeys:
        return self.host.keys()

    @property
    def world(self) -> KV:
        if self.host.world is None:
            raise ResourceError("this run has no World")
        return self.host.world

    @property
    def services(self) -> Services:
        return self.host.services

    def ready(self) -> None:
        self.host.vertex_ready(self)

    def event(self) -> None:
        self.host.vertex_event(self)

    def refresh(self) -> bool:
        return self.refresh_now

    def request_exit(self, code: int) -> None:
        self.host.request_exit(code, self.ident)

    @property
    def may_run_commands(self) -> bool:
        return self.host.settings.noop_commands or not self.host.settings.noop

    def unknown(self, why: str) -> None:
        self.unknown_why = why

    def is_secret(self, field: str) -> bool:
        return field in self.secret_fields

    def changed(self, field: str, old: object, new: object, *, content: bool = False) -> None:
        report = (field, old, new, content)
        if self.reported is None:
            self.reported = [report]
        else:
            self.reported.append(report)
