"""A fake handle and a step harness for testing a resource kind in process.

mgmt tests each resource with a list of steps (`resources_test.go`: start it,
check, apply, expect a change, expect clean); this is the same for evergraph's
kinds, on real files in a temporary directory, with no agent, engine or process:

    from evergraph.testing.kinds import Apply, Call, Check, run_steps

    res = build(default_registry, "file", {"name": f"{tmp}/f", "content": "hi\\n"})
    handle = run_steps(res, [
        Check(ok=False, changes=["state", "content"]),  # what a noop run reports
        Apply(),                                        # changed it: returns "not clean"
        Check(ok=True),                                 # clean now: nothing reported
        Call(lambda: (tmp / "f").write_text("drift")),  # the world changes
        Apply(changes=["content"]),
    ], state_dir=tmp / "state")

`FakeHandle` is the `Handle` a resource gets in `init`: it records the changes
reported (`changed()`), the log lines, the watch's `ready()`/`event()` calls and
the subscriptions to its fake watcher (`fire()` one), and gives a `Services` that
`run_steps` closes at the end. A step whose resource raises fails the test unless
it says `raises=` (a regex of the message).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from evergraph.engine.contract import PathSubscription, Resource
from evergraph.engine.services import Services
from evergraph.errors import InputError, ResourceError

if TYPE_CHECKING:
    from evergraph.cluster.hostkeys import HostKeys
    from evergraph.world.kv import KV


@dataclass(frozen=True)
class Change:
    """One difference a resource reported (`handle.changed(field, old, new)`)."""

    field: str
    old: object
    new: object
    content: bool = False


class _Subscription:
    def __init__(self, watcher: FakeWatcher, path: str, callback: Callable[[int], None]) -> None:
        self._watcher, self.path, self.callback = watcher, path, callback

    def __call__(self) -> None:
        self._watcher.subscriptions.remove(self)

    def settle(self) -> None:
        pass


class FakeWatcher:
    """A PathWatcher that records subscriptions; `fire(path, mask)` calls them."""

    def __init__(self) -> None:
        self.subscriptions: list[_Subscription] = []

    def subscribe(self, path: str, callback: Callable[[int], None]) -> PathSubscription:
        sub = _Subscription(self, path, callback)
        self.subscriptions.append(sub)
        return sub

    def subscribe_dir(self, directory: str, callback: Callable[[int], None]) -> PathSubscription:
        return self.subscribe(directory.rstrip("/") + "/", callback)

    @property
    def paths(self) -> list[str]:
        """The paths watched now (a directory's listing ends with `/`)."""
        return [s.path for s in self.subscriptions]

    def fire(self, path: str, mask: int = 0x2) -> int:
        """Call the callbacks of `path` with `mask` (default IN_MODIFY); how many."""
        subs = [s for s in self.subscriptions if s.path == path]
        for s in subs:
            s.callback(mask)
        return len(subs)


class _Records(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.DEBUG)
        self._into = into

    def emit(self, record: logging.LogRecord) -> None:
        self._into.append(record.getMessage())


class FakeHandle:
    """The `Handle` of one resource, recording what the resource tells it."""

    def __init__(
        self,
        *,
        state_dir: Path | None = None,
        hostname: str = "test",
        watcher: Any = None,
        world: KV | None = None,
        keys: HostKeys | None = None,
        services: Services | None = None,
        secrets: Sequence[str] = (),
        may_run_commands: bool = True,
    ) -> None:
        self._state_dir = state_dir
        self._hostname = hostname
        #: a FakeWatcher unless another (a running InotifyHub) is given
        self.watcher = FakeWatcher() if watcher is None else watcher
        self._world = world
        self._keys = keys
        self.services = Services() if services is None else services
        self._secrets = frozenset(secrets)
        self.may_run_commands = may_run_commands
        #: every change reported, in order; the log lines; ready() and event() calls
        self.changes: list[Change] = []
        self.logs: list[str] = []
        self.readies = 0
        self.events = 0
        #: set before a check: a notify edge asked for a refresh
        self.refresh_now = False
        self.unknowns: list[str] = []
        self.exit_codes: list[int] = []
        self._logger = logging.Logger("evergraph.resource.test", logging.DEBUG)
        self._logger.addHandler(_Records(self.logs))

    # -- the Handle protocol ------------------------------------------------------
    @property
    def logger(self) -> logging.Logger:
        return self._logger

    @property
    def hostname(self) -> str:
        return self._hostname

    @property
    def state_dir(self) -> Path:
        if self._state_dir is None:
            raise ResourceError("this FakeHandle was given no state_dir")
        self._state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        return self._state_dir

    @property
    def keys(self) -> HostKeys:
        if self._keys is None:
            raise ResourceError("this FakeHandle was given no keys")
        return self._keys

    @property
    def world(self) -> KV:
        if self._world is None:
            raise ResourceError("this run has no World")
        return self._world

    def ready(self) -> None:
        self.readies += 1

    def event(self) -> None:
        self.events += 1

    def refresh(self) -> bool:
        return self.refresh_now

    def unknown(self, why: str) -> None:
        self.unknowns.append(why)

    def request_exit(self, code: int) -> None:
        self.exit_codes.append(code)

    def is_secret(self, field: str) -> bool:
        return field in self._secrets

    def changed(self, field: str, old: object, new: object, *, content: bool = False) -> None:
        self.changes.append(Change(field, old, new, content))

    # -- for tests ----------------------------------------------------------------
    def fields(self, since: int = 0) -> list[str]:
        """The fields of the changes reported (from the `since`-th on)."""
        return [c.field for c in self.changes[since:]]


# -- steps ------------------------------------------------------------------------


@dataclass
class Step:
    """Base of the steps; `raises`: the step must fail with a ResourceError whose
    message matches this regex."""

    raises: str | None = field(default=None, kw_only=True)

    async def run(self, res: Resource, handle: FakeHandle) -> None:
        raise NotImplementedError


@dataclass
class Start(Step):
    """validate() and init(handle); with `watch`, subscribe() too (a passive watch)."""

    watch: bool = False

    async def run(self, res: Resource, handle: FakeHandle) -> None:
        res.validate()
        await res.init(handle)
        subscribe = getattr(res, "subscribe", None)
        if self.watch and subscribe is not None:
            handle.unsubscribe = subscribe()  # type: ignore[attr-defined]


@dataclass
class _CheckApply(Step):
    #: what check_apply must return (True: clean); None: either
    ok: bool | None = None
    #: the fields the step must report (in order); None: not checked; []: none
    changes: Sequence[str] | None = None
    apply: bool = False

    async def run(self, res: Resource, handle: FakeHandle) -> None:
        before = len(handle.changes)
        got = await res.check_apply(self.apply)
        what = "apply" if self.apply else "check"
        reported = handle.fields(before)
        assert self.ok is None or got is self.ok, (
            f"{res.ident}: {what} returned {got}, expected {self.ok}; reported {reported}"
        )
        if self.changes is not None:
            assert reported == list(self.changes), (
                f"{res.ident}: {what} reported {reported}, expected {list(self.changes)}"
            )


@dataclass
class Check(_CheckApply):
    """check_apply(False): `ok` (clean or not) and the `changes` it reports."""


@dataclass
class Apply(_CheckApply):
    """check_apply(True); by default it must find something to change (ok=False)."""

    ok: bool | None = False
    apply: bool = True


def ExpectClean() -> Check:
    """A check that finds nothing to change and reports nothing."""
    return Check(ok=True, changes=[])


@dataclass
class ExpectChanged(Step):
    """The step before reported a change (of these fields, when given)."""

    fields: Sequence[str] = ()

    async def run(self, res: Resource, handle: FakeHandle) -> None:
        seen = handle.fields(getattr(handle, "_last_step_start", 0))
        assert seen, f"{res.ident}: the last step reported no change"
        for f in self.fields:
            assert f in seen, f"{res.ident}: {f!r} not among the changes {seen}"


@dataclass
class Call(Step):
    """Run `fn()` (or `fn(res, handle)` when it takes two arguments; may be async):
    the world changes between checks, or a test looks at it."""

    fn: Callable[..., object | Awaitable[object]] = lambda: None

    async def run(self, res: Resource, handle: FakeHandle) -> None:
        n = len(inspect.signature(self.fn).parameters)
        out = self.fn(res, handle) if n >= 2 else self.fn()
        if inspect.isawaitable(out):
            await out


async def arun_steps(
    res: Resource, steps: Sequence[Step], handle: FakeHandle | None = None, **kw: Any
) -> FakeHandle:
    """Run `steps` on `res` (a FakeHandle made with `kw` unless given); then the
    resource's cleanup(), its watch's unsubscribe and the services' close, always."""
    h = FakeHandle(**kw) if handle is None else handle
    try:
        for i, step in enumerate(steps):
            mark = len(h.changes)
            failed: str | None = None
            try:
                await step.run(res, h)
            except (ResourceError, InputError) as e:
                if step.raises is None:
                    raise
                failed = str(e)
            what = f"step {i} ({type(step).__name__})"
            if step.raises is not None:
                assert failed is not None, f"{what} did not raise /{step.raises}/"
                assert re.search(step.raises, failed), (
                    f"{what} raised {failed!r}: not /{step.raises}/"
                )
            if not isinstance(step, ExpectChanged):
                h._last_step_start = mark  # type: ignore[attr-defined]
    finally:
        unsubscribe = getattr(h, "unsubscribe", None)
        if unsubscribe is not None:
            unsubscribe()
        if getattr(res, "handle", None) is h:
            await res.cleanup()
        await h.services.aclose()
    return h


def run_steps(
    res: Resource, steps: Sequence[Step], handle: FakeHandle | None = None, **kw: Any
) -> FakeHandle:
    """`arun_steps` in a new event loop (for a test that is not async)."""
    return asyncio.run(arun_steps(res, steps, handle, **kw))


def graph_error(path: str | Path) -> str:
    """The InputError a graph file raises as `evergraph check` loads it (in process),
    with its `file:line:` location; AssertionError if it loads."""
    from evergraph.frontends.open import open_graph_file

    try:
        open_graph_file(Path(path)).load()
    except InputError as e:
        return str(e)
    raise AssertionError(f"{path} loaded: expected an input error")
