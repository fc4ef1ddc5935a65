"""The resource contract: what a resource kind is, and all it may touch.

A kind is a typed class (a `msgspec.Struct`) registered under a name by
`@register("kind")`. Its fields are its parameters, each with a type, a safe
default and one line of doc (`Annotated[T, doc("...")]`); meta parameters live
in `res.meta`, never among the parameters. The engine calls, per vertex:

    validate()                 pure, no I/O; raise InputError(field=...) on bad values
    await init(handle)         handle: logger, hostname, state dir, event(), ready(), ...
    await watch()              long-running; handle.ready() once, handle.event() per change
    await check_apply(apply)   True if already correct; else fix (if apply) and return False;
                               each difference found is reported: handle.changed(f, old, new)
    cmp(other)                 equality of parameters: decides survival across a graph swap
    await cleanup()
    ahead_check(seen)          optional: in state? told before init, in a forked child

Resources import this module and nothing else of the engine.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
from collections.abc import AsyncIterator, Callable, Hashable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Protocol, TypeVar

import msgspec

from evergraph.errors import InputError
from evergraph.world.names import hostname_problem

if TYPE_CHECKING:
    from evergraph._util.atomic import OpenDirs, Pending
    from evergraph.cluster.hostkeys import HostKeys
    from evergraph.engine.services import Services
    from evergraph.world.kv import KV


def doc(text: str) -> msgspec.Meta:
    """One line of documentation for a parameter: `x: Annotated[int, doc("...")] = 0`."""
    return msgspec.Meta(description=text)


class Meta(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Meta parameters, common to every resource (`meta:` in YAML)."""

    noop: Annotated[bool, doc("check only, never change; reported as would-change")] = False
    retry: Annotated[int, doc("retries after a failure of watch or check_apply; -1 = forever")] = 0
    retryreset: Annotated[bool, doc("a success resets the retry counter")] = False
    delay: Annotated[int, doc("milliseconds to wait between retries (at most a year)")] = 0
    timeout: Annotated[
        float | None, doc("deadline in seconds for one check_apply (0.001 to a year)")
    ] = None
    poll: Annotated[
        float,
        doc(">0: check every N s (>= 0.001) instead of watching; <0: check once, never watch"),
    ] = 0
    limit: Annotated[
        float,
        doc("check_apply starts per second (token bucket); `.inf` = no limit; 0 is refused"),
    ] = math.inf
    burst: Annotated[int, doc("token bucket size for a finite limit (>= 1)")] = 0
    sema: Annotated[list[str], doc("counting semaphores `id` or `id:N`, graph-wide")] = []
    rewatch: Annotated[bool, doc("on a graph swap, restart a vertex that failed permanently")] = (
        False
    )
    reset: Annotated[bool, doc("reset retry state when params change across swaps")] = False
    hidden: Annotated[bool, doc("kept in the graph but never watched or applied")] = False
    export: Annotated[list[str], doc("hostnames (or `*`) this resource is exported to")] = []
    reverse: Annotated[bool, doc("apply the inverse when the resource leaves the graph")] = False
    autoedge: Annotated[bool, doc("take part in automatic edges")] = True
    autogroup: Annotated[bool, doc("take part in automatic grouping")] = True
    realize: Annotated[bool, doc("at least one successful apply before removal on a swap")] = False

    def check(self, where: str) -> None:
        if self.retry < -1:
            raise InputError("must be -1 (forever) or >= 0", f"{where}.meta.retry")
        if not 0 <= self.delay <= MAX_SECONDS * 1000:
            raise InputError(
                f"must be between 0 and {MAX_SECONDS * 1000:.0f} milliseconds (a year), "
                f"not {self.delay}",
                f"{where}.meta.delay",
            )
        if self.timeout is not None and (why := seconds_problem(self.timeout)):
            raise InputError(f"{why} (leave it out for no deadline)", f"{where}.meta.timeout")
        poll = self.poll
        if not (poll == 0 or -math.inf < poll < 0) and seconds_problem(poll):
            raise InputError(
                f"must be 0 (watch), < 0 (check once) or between {MIN_INTERVAL:g} and "
                f"{MAX_SECONDS:.0f} seconds (a year), not {poll:g}",
                f"{where}.meta.poll",
            )
        self._check_limit(where)

    def _check_limit(self, where: str) -> None:
        if self.limit == 0:
            raise InputError(
                "0 would never run it: give starts per second (> 0), or .inf for no limit "
                "(the default)",
                f"{where}.meta.limit",
            )
        if not (MIN_RATE <= self.limit <= math.inf):  # NaN too
            raise InputError(
                f"must be between {MIN_RATE:g} starts per second and .inf (no limit, the "
                f"default), not {self.limit:g}",
                f"{where}.meta.limit",
            )
        if self.burst < 0:
            raise InputError(f"must be >= 0, not {self.burst}", f"{where}.meta.burst")
        if self.limit != math.inf and self.burst < 1:
            raise InputError("a finite limit needs burst >= 1", f"{where}.meta.burst")
        for to in self.export:
            why = None if to == "*" else hostname_problem(to)
            if why:
                raise InputError(f"{why} (or `*` for every host)", f"{where}.meta.export")
        counts: dict[str, int] = {}
        for s in self.sema:
            parsed = parse_sema(s)
            if parsed is None:
                raise InputError(f"{s!r} is not `id` or `id:N` with N >= 1", f"{where}.meta.sema")
            sid, n = parsed
            if counts.setdefault(sid, n) != n:
                raise InputError(
                    f"semaphore {sid!r} is given counts {counts[sid]} and {n}: one count per id",
                    f"{where}.meta.sema",
                )


DEFAULT_META = Meta()

#: the longest duration or interval accepted (a year): a longer one is a mistake
MAX_SECONDS = 365 * 24 * 3600.0
#: the shortest interval or duration: a shorter one only spins (and floods the log)
MIN_INTERVAL = 0.001
#: the slowest finite meta.limit, starts per second
MIN_RATE = 1e-6


def seconds_problem(value: float, *, zero: bool = False) -> str | None:
    """Why `value` is no duration in seconds (None: it is one): NaN, infinite,
    negative, below `MIN_INTERVAL` (unless 0 and `zero`) or above `MAX_SECONDS`."""
    if MIN_INTERVAL <= value <= MAX_SECONDS or (zero and value == 0):
        return None
    low = "0" if zero else f"{MIN_INTERVAL:g}"
    return f"must be between {low} and {MAX_SECONDS:.0f} seconds (a year), not {value:g}"


def parse_sema(spec: str) -> tuple[str, int] | None:
    """A semaphore spec as (id, count): `a` is `a:1`. None: not `id` or `id:N`, N >= 1."""
    sid, colon, n = spec.partition(":")
    if not sid or (colon and (not n.isascii() or not n.isdigit() or int(n) < 1)):
        return None
    return sid, int(n) if colon else 1


def runs_inline(res: Resource) -> bool:
    """What of running inline (no task of its own) the resource alone decides: an
    eager kind (its check_apply is local syscalls) that waits for nothing (no
    token, semaphore nor timeout) and has no reversal to capture. The engine adds
    its own conditions (scheduling's `_inline_ok`); so does a child that makes
    resources ahead (ahead.py's `creatable`): what it makes must run inline."""
    meta = res.meta
    return (
        res.eager
        and not meta.sema
        and meta.timeout is None
        and meta.limit == math.inf
        and not meta.reverse
    )


def semaphores(specs: Iterable[str]) -> list[tuple[str, int]]:
    """Semaphore specs normalised (`a` is `a:1`), one per id, in the order they are
    taken: by id, so that any two holders take the ids they share in the same order
    (counts agree graph-wide: `GraphModel.check`). Invalid specs are skipped."""
    out: dict[str, int] = {}
    for spec in specs:
        parsed = parse_sema(spec)
        if parsed is not None:
            out[parsed[0]] = parsed[1]
    return sorted(out.items())


class Handle(Protocol):
    """Everything a resource may use, handed to `init`. Implemented by the engine."""

    @property
    def logger(self) -> logging.Logger: ...

    @property
    def hostname(self) -> str: ...

    @property
    def state_dir(self) -> Path:
        """This resource's private directory (created on first use)."""
        ...

    @property
    def watcher(self) -> PathWatcher: ...

    @property
    def keys(self) -> HostKeys:
        """The host's key pairs (created under `<state>/keys/` on first use)."""
        ...

    @property
    def world(self) -> KV:
        """The World (shared key-value store); ResourceError if the run has none."""
        ...

    @property
    def services(self) -> Services:
        """What this agent's resources share (connections, locks, the durable-write
        committer): made on first use, closed by the agent when the run ends."""
        ...

    def ready(self) -> None:
        """The watch is set up: changes from now on will be reported."""

    def event(self) -> None:
        """The real state may have changed: check again."""

    def refresh(self) -> bool:
        """True when a notify edge asked this resource to refresh on this run."""
        ...

    @property
    def may_run_commands(self) -> bool:
        """False in a noop run with `--noop-no-commands`: a check that would run a
        user's command (exec's `ifcmd`, `nifcmd`, `watchcmd`) must not, and calls
        `unknown()` instead."""
        ...

    def unknown(self, why: str) -> None:
        """This run cannot tell whether the resource would change (`why`: what it
        did not run): the recap names it "unknown", a noop run exits 3."""

    def request_exit(self, code: int) -> None:
        """End the run gracefully (as on SIGTERM) with exit status `code` (the `exit`
        kind); the first code asked for is the one the agent exits with."""

    def is_secret(self, field: str) -> bool:
        """True when `field` holds a value received from a sender that marked it
        secret (a password): keep it sealed, make files of it private. Whatever
        the resource logs or raises is masked by the engine anyway."""
        ...

    def changed(self, field: str, old: object, new: object, *, content: bool = False) -> None:
        """Report one difference, where check_apply finds it (before applying, so a
        noop run reports it too): `field` is `old` now and becomes `new` (None:
        absent or unset; shown as text). `content=True`: old and new are whole
        contents (bytes or str), shown as a unified diff. Cheap: the engine keeps
        the values and makes text and diffs of them only if the run changed
        something. A field holding a received secret is never shown; a kind whose
        own values are secrets (password) reports what happened, never a value."""


async def watch_snapshots(handle: Handle, snapshots: AsyncIterator[object]) -> None:
    """A watch over a stream of snapshots (the World's `watch_one` and its kin): the
    first one means ready, each later one an event; the stream is closed after."""
    first = True
    async with contextlib.aclosing(snapshots):  # type: ignore[type-var]
        async for _ in snapshots:
            if first:
                first = False
                handle.ready()
            else:
                handle.event()


class PathSubscription(Protocol):
    """Call it to unsubscribe."""

    def __call__(self) -> None: ...

    def settle(self) -> None:
        """After creating the path's parent directories: watch the parent from now on."""


#: the inotify bit a PathWatcher callback's mask has when an entry was renamed into
#: place (IN_MOVED_TO; the watch's own constant, here so kinds need not import it)
MOVED_TO = 0x00000080


class PathWatcher(Protocol):
    """The engine's shared inotify service (one instance for every resource)."""

    def subscribe(self, path: str, callback: Callable[[int], None]) -> PathSubscription:
        """Call `callback(mask)` on any change of `path` (even before it exists).
        `mask` holds inotify bits (e.g. IN_MOVED_TO), or IN_Q_OVERFLOW for "anything
        may have changed"."""
        ...

    def subscribe_dir(self, directory: str, callback: Callable[[int], None]) -> PathSubscription:
        """Call `callback(mask)` on any change of an entry directly in `directory`."""
        ...


R = TypeVar("R", bound="Resource")


class Resource(msgspec.Struct, kw_only=True, dict=True, forbid_unknown_fields=True):
    """Base of every resource kind. Subclasses declare parameters as fields."""

    kind: ClassVar[str] = ""
    #: vertices of this kind that cannot reach each other may merge into one
    groupable: ClassVar[bool] = False
    #: check_apply is local work that normally completes without awaiting
    #: (syscalls on local files): the engine may run it inline, without a task
    eager: ClassVar[bool] = False
    #: values this kind can send over an edge, with their types: {"stdout": str}
    sends: ClassVar[dict[str, Any]] = {}
    #: sent fields whose values must never be logged or shown (password); the
    #: engine masks them in every text about the receiver, which `is_secret` tells
    secret_sends: ClassVar[frozenset[str]] = frozenset()
    name: Annotated[str, doc("the resource's name; `kind[name]` is its identity")]
    meta: Annotated[Meta, doc("meta parameters (see `evergraph docs resources`)")] = DEFAULT_META

    # -- life cycle -------------------------------------------------------
    def validate(self) -> None:
        """Pure checks of parameter values; raise `self.bad(field, why)`."""

    async def init(self, handle: Handle) -> None:
        self.handle = handle

    async def watch(self) -> None:
        """Long-running. Default: no watch (the engine treats it as always ready)."""
        raise NotImplementedError

    async def check_apply(self, apply: bool) -> bool:
        raise NotImplementedError

    def cmp(self, other: Resource) -> bool:
        if type(self) is not type(other) or self != other:
            return False
        mine = getattr(self, "_group_members", None)
        theirs = getattr(other, "_group_members", None)
        return mine == theirs if mine and theirs else not mine and not theirs

    async def cleanup(self) -> None:
        """Release what init took."""

    def ahead_check(self, seen: dict[str, Any]) -> bool | None:
        """Optional: whether this resource is in its state, told before init, in
        another process (a run that ends once converged forks one to check ahead
        while it loads: engine/ahead.py). True promises that init then
        check_apply would find it so and change nothing, so the engine skips both
        for it (it runs them after all if anything it depends on changed in the
        run). False: not in its state, and absent (with `ahead_create`, the child may
        make it). None (the default: the kind cannot tell this way; or it is there
        but not in its state): the usual init and check, and the engine knows at
        once that it has one to run (engine/express.py leaves it, and what is below
        it, to the lane; a False is known to be one only when the child's making
        fails). Local reads
        only: no writes, no logging, no handle. `seen`: scratch shared by every
        resource of that process (listings)."""
        return None

    def ahead_create(self, seen: dict[str, Any], dirs: OpenDirs) -> Pending | bool:
        """Optional, with `ahead_check`: make this resource, which `ahead_check`
        just found not in its state, in that same process, when it does not exist
        at all and its kind can make it from its parameters alone (no owner to look
        up, nothing to read). Called only where the engine would have run its check
        next (everything it depends on is in its state) and nothing but that check
        is asked of it (engine/ahead.py, `creatable`). False: not made (the usual
        init and check). True: made, in its state now. A `Pending` write
        (`atomic.prepare`, in `dirs`, `fresh`: nothing is there): the caller commits
        it with others before it tells the engine. The engine then records the
        resource changed with what `ahead_created` reports, and neither initialises
        nor checks it."""
        return False

    def ahead_created(self, handle: Handle) -> None:
        """What making it from nothing (`ahead_create`) changed, reported through
        `handle.changed` as check_apply would have reported it, in the engine's
        process (which never initialised this resource)."""
        raise NotImplementedError

    def ahead_alike(self) -> Hashable | None:
        """Optional, with `ahead_created`: a key of what it reports, such that two
        resources of this kind with equal keys report changes of one shape
        (`changes.shape` without diffs: the same fields and values, a content by its
        size alone). A one-shot run asks `ahead_created` of the first resource made of
        each key and takes its changes for the others (engine/express.py: 10k files
        made alike are a few keys). None (the default): asked of each."""
        return None

    # -- optional abilities (override to take part) -------------------------
    def autoedge_provides(self) -> list[str]:
        """Keys other resources may depend on, `namespace:value`, e.g. `dir:/etc/app/`."""
        return []

    #: the namespaces `autoedge_wants` may name (`dir`, `pkgfile`...), if the kind
    #: knows them: when no resource of a graph provides any of them, the kind's
    #: `autoedge_wants` is not called at all (10k files in a graph without a
    #: managed directory: 10k calls saved). None: always called.
    wants_namespaces: ClassVar[frozenset[str] | None] = None

    def autoedge_wants(self) -> Iterable[Iterable[str]]:
        """Groups of keys this resource depends on; per group the first managed key wins.
        All keys of one group share a namespace (the text before the first `:`).

        Example: a file wants its nearest managed parent directory:
        `[["dir:/a/b/", "dir:/a/", "dir:/"]]` (lazily, nearest first).
        """
        return []

    def claims(self) -> Iterable[str]:
        """What this resource manages on the machine, as keys (`file:/etc/x`,
        `user:alice`, `svc:system:nginx.service`). Two resources of a graph that
        claim one key would fight: a load error, unless they are equal."""
        return ()

    def claims_part(self) -> Iterable[str]:
        """Keys of things this resource manages only a part of (`content:/etc/hosts`
        for one line of it): any number of resources may share such a key, but a
        resource that claims the same key whole (`claims()`: a file with `content`)
        fights each of them: a load error naming both."""
        return ()

    def managed_under(self) -> str | None:
        """A directory (ending in `/`) under which this resource needs the paths that
        other resources of the graph manage (file.purge keeps them). None: not needed."""
        return None

    def know_managed(self, paths: frozenset[str]) -> None:
        """Receives, before init, the managed paths under `managed_under()`."""

    def reversal(self) -> Resource | None:
        """For `meta.reverse`: a resource that restores the state found now (before our
        first apply). None: nothing to undo. Kinds that cannot be reversed keep this."""
        return None

    @classmethod
    def reversible(cls) -> bool:
        return cls.reversal is not Resource.reversal

    def sent(self) -> dict[str, object]:
        """The values produced so far (keys of `sends`); only those are sent."""
        return {}

    def secret_sent(self) -> frozenset[str]:
        """The names of the values sent now that are secrets (default `secret_sends`;
        a kind overrides it when that depends on the value, e.g. `kv` read sealed)."""
        return self.secret_sends

    def group_key(self) -> tuple[object, ...]:
        """Only resources with equal keys group. The default is the kind's family:
        a kind `a:b` joins kind `a`'s group (hierarchical grouping). A kind adds
        its own conditions (pkg: the same target state)."""
        return (self.kind.partition(":")[0],)

    @property
    def group_members(self) -> list[Resource]:
        """Resources merged into this one by autogrouping (empty when not grouped)."""
        members: list[Resource] | None = getattr(self, "_group_members", None)
        if members is None:
            members = []
            self._group_members = members
        return members

    async def check_apply_group(self, apply: bool) -> bool:
        """check_apply for a grouped vertex: this resource and its members.

        The default handles them one by one; a kind overrides it to act on all
        at once (pkg: one transaction).
        """
        clean = True
        for res in (self, *self.group_members):
            clean = await res.check_apply(apply) and clean
        return clean

    # -- helpers ----------------------------------------------------------
    @property
    def ident(self) -> str:
        return f"{self.kind}[{self.name}]"

    def bad(self, field: str, why: str) -> InputError:
        return InputError(why, f"{self.ident}.{field}")

    def watches(self) -> bool:
        """Whether this instance has a watch to run (default: the kind defines one)."""
        return type(self).watch is not Resource.watch

    def subscribe(self) -> Callable[[], None] | None:
        """Optional passive watch, used instead of `watch` when it returns non-None.

        A resource whose watch only registers callbacks with an engine service
        (e.g. `handle.watcher`) that call `handle.event()` can do that here and
        return the unsubscribe: no task per vertex is needed, and it is ready at
        once. Called after `init`; the unsubscribe is called before `cleanup`.
        """
        return None

    @classmethod
    def params(cls) -> Iterator[msgspec.structs.FieldInfo]:
        for f in msgspec.structs.fields(cls):
            if f.name not in ("name", "meta"):
                yield f


class Registry:
    """Kind name -> class. The engine and frontends take one explicitly.

    A kind may be declared lazily (`declare`: its name and the module that registers
    it); the module is imported on the first `get` of that name, so a one-resource
    graph does not import every kind (and their dependencies) at start-up."""

    def __init__(self) -> None:
        self._kinds: dict[str, type[Resource]] = {}
        #: kind name -> module that registers it when imported (not yet imported)
        self._lazy: dict[str, str] = {}
        #: kind name -> module declared for it, imported or not (`declare`)
        self._declared: dict[str, str] = {}

    def add(self, kind: str, cls: type[Resource], *aliases: str) -> None:
        for k in (kind, *aliases):
            if k in self._kinds and self._kinds[k] is not cls:
                raise ValueError(f"resource kind {k!r} registered twice")
            self._kinds[k] = cls
            self._lazy.pop(k, None)

    def declare(self, module: str, *kinds: str) -> None:
        """Kinds that `module` registers on import, loaded on first lookup."""
        for k in kinds:
            self._declared[k] = module
            if k not in self._kinds:
                self._lazy[k] = module

    def get(self, kind: str) -> type[Resource] | None:
        cls = self._kinds.get(kind)
        if cls is not None:
            return cls
        module = self._lazy.get(kind)
        if module is None:
            return None
        importlib.import_module(module)
        # the module registers into the default registry; a copy takes it from there
        cls = self._kinds.get(kind) or default_registry._kinds.get(kind)
        if cls is None:
            raise LookupError(f"module {module!r} did not register resource kind {kind!r}")
        self._kinds[kind] = cls
        self._lazy.pop(kind, None)
        return cls

    def kinds(self) -> list[str]:
        return sorted({*self._kinds, *self._lazy})

    def origin(self, kind: str) -> str:
        """Where `kind` comes from, the same before and after its module is imported:
        the module declared for it (while its class is that module's), else the
        class's module and name. ("" for a kind not here.)"""
        declared = self._declared.get(kind)
        cls = self._kinds.get(kind)
        if declared is not None and (cls is None or cls.__module__ == declared):
            return declared
        return "" if cls is None else f"{cls.__module__}.{cls.__qualname__}"

    def copy(self) -> Registry:
        r = Registry()
        r._kinds = dict(self._kinds)
        r._lazy = dict(self._lazy)
        r._declared = dict(self._declared)
        return r


#: The default registry; built-in kinds register here on import of
#: `evergraph.resources`. Pass another Registry to keep tests isolated.
default_registry = Registry()


def register(
    kind: str, *aliases: str, registry: Registry | None = None
) -> Callable[[type[R]], type[R]]:
    """Class decorator: `@register("file")`."""

    def deco(cls: type[R]) -> type[R]:
        cls.kind = kind
        (registry or default_registry).add(kind, cls, *aliases)
        return cls

    return deco


def parent_dir_keys(path: str) -> Iterator[str]:
    """Autoedge keys of a normalised path's parent directories (`dir:/a/b/`), nearest
    first, lazily: the first managed one ends the walk."""
    end = path.rfind("/")
    while end > 0:
        yield f"dir:{path[:end]}/"
        end = path.rfind("/", 0, end)
    yield "dir:/"


class ParentDirs(str):
    """An autoedge group (`autoedge_wants`): a normalised path, whose keys are its
    parent directories' (`parent_dir_keys`, which iterating it gives). The driver
    (engine/autoedge.py) looks up the nearest one, `nearest()`, without walking a
    generator: most resources of a big graph find their own directory at once."""

    __slots__ = ()

    def __iter__(self) -> Iterator[str]:
        return parent_dir_keys(self)

    def nearest(self) -> str:
        """The first key `parent_dir_keys` gives."""
        end = self.rfind("/")
        return f"dir:{self[:end]}/" if end > 0 else "dir:/"
