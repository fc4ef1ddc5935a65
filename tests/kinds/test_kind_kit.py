"""The kind test kit (evergraph.testing.kinds) and the services registry the kinds
share state through: a fake handle and steps drive a real kind on real files."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

import evergraph.resources  # noqa: F401  (declares the built-in kinds)
from evergraph.engine.build import build
from evergraph.engine.contract import MOVED_TO, default_registry
from evergraph.engine.services import Services
from evergraph.errors import ResourceError
from evergraph.testing.kinds import (
    Apply,
    Call,
    Check,
    ExpectChanged,
    ExpectClean,
    FakeHandle,
    Start,
    run_steps,
)
from evergraph.watch.inotify import IN_MOVED_TO


def test_a_file_timeline_in_process(tmp_path: Path) -> None:
    f = tmp_path / "d" / "f"
    res = build(default_registry, "file", {"name": str(f), "content": "hi\n", "mode": "0640"})
    h = run_steps(
        res,
        [
            Start(watch=True),
            Check(ok=False, changes=["state", "content", "mode"]),  # a noop run's report
            Apply(),
            ExpectChanged(["content"]),
            ExpectClean(),
            Call(lambda: f.write_text("drift\n")),  # in place: not our own write
            Check(ok=False, changes=["content"]),
            Apply(changes=["content"]),
            ExpectClean(),
            Call(lambda: f.unlink()),
            Apply(changes=["state", "content", "mode"]),
        ],
    )
    assert f.read_text() == "hi\n"
    assert f.stat().st_mode & 0o777 == 0o640
    assert h.watcher.paths == []  # unsubscribed at the end
    assert h.logs == []


def test_the_watch_skips_our_own_rename_and_reports_anyone_elses(tmp_path: Path) -> None:
    f = tmp_path / "f"
    res = build(default_registry, "file", {"name": str(f), "content": "hi\n"})
    handle = FakeHandle()

    def own_rename() -> None:
        assert handle.watcher.fire(str(f), MOVED_TO) == 1
        assert handle.events == 0  # the inode we wrote: not a change to repair

    def their_rename() -> None:
        tmp = tmp_path / ".edit"
        tmp.write_text("theirs\n")
        os.replace(tmp, f)
        handle.watcher.fire(str(f), MOVED_TO)
        assert handle.events == 1

    run_steps(res, [Start(watch=True), Apply(), Call(own_rename), Call(their_rename)], handle)


def test_a_step_that_must_fail_names_the_reason(tmp_path: Path) -> None:
    (tmp_path / "dir").mkdir()
    res = build(default_registry, "file", {"name": str(tmp_path / "dir"), "content": "x"})
    run_steps(res, [Start(), Apply(raises=r"exists and is a directory \(force: true")])
    with pytest.raises(AssertionError, match="did not raise"):
        run_steps(res, [Start(), Check(ok=False, raises="never")])


def test_the_contract_moved_to_bit_is_the_watchs() -> None:
    assert MOVED_TO == IN_MOVED_TO


def test_services_are_made_once_per_key_and_closed_last_first() -> None:
    closed: list[str] = []

    class Sync:
        def __init__(self, name: str = "sync") -> None:
            self.name = name

        def close(self) -> None:
            closed.append(self.name)

    class Async:
        async def aclose(self) -> None:
            closed.append("async")

    class Failing:
        def close(self) -> None:
            raise RuntimeError("boom")

    async def main() -> None:
        s = Services()
        a = s.get(Sync)
        assert s.get(Sync) is a
        assert s.get(Sync, "other") is not a
        assert s.find(Async) is None
        s.get(Failing)
        s.get(Async)
        assert len(s) == 4
        await s.aclose()  # a failing close is logged; the others close still
        with pytest.raises(RuntimeError, match="services are closed"):
            s.get(Sync)

    asyncio.run(main())
    assert closed == ["async", "other", "sync"]


def test_an_engine_closes_the_services_it_made_and_never_its_owners(tmp_path: Path) -> None:
    from evergraph.engine.engine import Engine
    from evergraph.engine.model import GraphModel
    from evergraph.engine.settings import Settings

    closed: list[str] = []

    class Held:
        def __init__(self, who: str) -> None:
            self.who = who

        def close(self) -> None:
            closed.append(self.who)

    def settings() -> Settings:
        return Settings(state_dir=tmp_path, converged_timeout=0, converged_exit=True, hostname="t")

    async def main() -> None:
        own = Engine(settings())
        own.services.get(Held, "engine")
        assert await own.run(GraphModel()) == 0
        assert closed == ["engine"]
        given = Services()
        given.get(Held, "agent")
        assert await Engine(settings(), services=given).run(GraphModel()) == 0
        assert closed == ["engine"]  # the owner's services outlive the engine's run
        await given.aclose()
        assert closed == ["engine", "agent"]

    asyncio.run(main())


def test_durable_writes_end_their_committer_thread_when_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from evergraph.resources import _commit

    monkeypatch.setattr(_commit, "SLOW_S", 0.0)  # every write to the committer
    monkeypatch.setattr(_commit, "STREAM_S", 1e9)
    monkeypatch.setattr(_commit, "SAMPLE", 10**9)

    async def main() -> None:
        s = Services()
        writes = s.get(_commit.DurableWrites)
        await asyncio.gather(
            *(
                writes.write(str(tmp_path / f"f{i}"), b"x", 0o644, None, lambda fd: None)
                for i in range(5)
            )
        )
        committer = writes._committer
        assert committer is not None
        thread = committer._thread
        await s.aclose()
        assert thread is None or not thread.is_alive()

    asyncio.run(main())
    assert all((tmp_path / f"f{i}").read_bytes() == b"x" for i in range(5))


def test_a_fake_handle_refuses_what_it_was_not_given() -> None:
    h = FakeHandle()
    for what in ("state_dir", "keys", "world"):
        with pytest.raises(ResourceError):
            getattr(h, what)
