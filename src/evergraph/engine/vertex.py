"""A vertex: one resource instance in the running graph, and its handle.

The vertex is also the `Handle` a resource receives in `init`, so a graph of
100k vertices carries one object per resource, not two.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote, unquote

from evergraph._util.atomic import atomic_write
from evergraph.engine.contract import PathWatcher, Resource
from evergraph.engine.masking import MaskingLogger, mask
from evergraph.engine.services import Services, services_of
from evergraph.engine.status import Change, State, VertexStatus
from evergraph.errors import ResourceError

if TYPE_CHECKING:
    from evergraph.cluster.hostkeys import HostKeys
    from evergraph.engine.engine import Engine
    from evergraph.world.kv import KV

_loggers: dict[str, logging.Logger] = {}


_NONE: frozenset[str] = frozenset()


class Vertex:
    __slots__ = (
        "apply_task",
        "bucket_at",
        "changed_count",
        "changes",
        "children",
        "clean_count",
        "duration",
        "engine",
        "ever_ok",
        "fail_count",
        "failed",
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
        "watch_ready",
        "watch_task",
    )

    def __init__(self, engine: Engine, res: Resource) -> None:
        self.engine = engine
        self.res = res
        self.ident = res.ident
        self.parents: list[Vertex] = []
        self.children: list[Vertex] = []
        #: (these two, rare, stay the shared empty tuple until an edge needs them)
        self.notify_children: list[Vertex] | tuple[()] = ()
        #: (value sent, receiving vertex, its field) for each send/recv edge out of here
        self.send_edges: list[tuple[str, Vertex, str]] | tuple[()] = ()
        #: received values now in effect on `res`, and ones waiting for the next run
        self.received: dict[str, object] = {}
        self.inbox: dict[str, object] = {}
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
        #: tries it again: see Engine._revive)
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
        self.bucket_at = 0.0
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
        return self.engine.hostname

    def state_path(self) -> Path:
        """`vertices/<kind>/<name-encoded>` under the state dir (see `vertex_dir`)."""
        return vertex_dir(self.engine.settings.state_dir, self.res.kind, self.res.name)

    @property
    def state_dir(self) -> Path:
        d = self.state_path()
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        return d

    @property
    def watcher(self) -> PathWatcher:
        if self.engine.watcher is None:
            raise ResourceError("this run has no file watcher (the engine's owner gave none)")
        return self.engine.watcher

    @property
    def keys(self) -> HostKeys:
        return self.engine.keys()

    @property
    def world(self) -> KV:
        if self.engine.world is None:
            raise ResourceError("this run has no World")
        return self.engine.world

    @property
    def services(self) -> Services:
        return services_of(self.engine)

    def ready(self) -> None:
        self.engine.vertex_ready(self)

    def event(self) -> None:
        self.engine.vertex_event(self)

    def refresh(self) -> bool:
        return self.refresh_now

    def request_exit(self, code: int) -> None:
        self.engine.request_exit(code, self.ident)

    @property
    def may_run_commands(self) -> bool:
        return self.engine.settings.noop_commands or not self.engine.settings.noop

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


#: longest encoded name used as it is (NAME_MAX is 255 bytes)
_ENCODED_MAX = 200
#: in a directory named by a hash (a name too long for a path component): the name
NAME_FILE = "@name"


def encode_name(name: str) -> str:
    """A resource name as one safe path component, unique per name and reversible
    (`vertex_name`): percent-encoded (`/`, NUL, `%`, non-ASCII...), `.` and `..`
    encoded whole; when too long, a prefix, `%~` and the name's SHA-256 (the whole
    name is then kept in the directory's `@name` file)."""
    enc = quote(name, safe="", errors="surrogatepass")
    if enc in (".", ".."):
        return enc.replace(".", "%2E")
    if len(enc) > _ENCODED_MAX:
        head = enc[:100]
        cut = head.rfind("%", len(head) - 2)  # not in the middle of a %XX
        if cut >= 0:
            head = head[:cut]
        digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()
        return f"{head}%~{digest}"  # quote never makes "%~": no plain name looks so
    return enc


def vertex_dir(state_dir: Path, kind: str, name: str) -> Path:
    """`vertices/<kind>/<encode_name(name)>` under the state dir. For a hashed
    (long) name the directory is made here with its `@name` file, so the
    start-up scan can read the name back."""
    enc = encode_name(name)
    d = state_dir / "vertices" / kind / enc
    if "%~" in enc and not (d / NAME_FILE).exists():
        with contextlib.suppress(OSError):  # a write into `d` reports it
            atomic_write(d / NAME_FILE, name.encode("utf-8", "surrogatepass"))
    return d


def vertex_name(path: str | os.PathLike[str]) -> str:
    """The resource name of a vertex directory (`vertex_dir`'s inverse)."""
    base = os.path.basename(os.fspath(path))
    if "%~" in base:
        try:
            with open(os.path.join(path, NAME_FILE), "rb") as f:
                return f.read().decode("utf-8", "surrogatepass")
        except (OSError, UnicodeDecodeError):
            return base
    return unquote(base, errors="surrogatepass")
