"""A vertex without an engine: it talks to its host through `VertexHost` only, so a
tiny fake host is enough to build one and drive its handle."""

from __future__ import annotations

from pathlib import Path

import pytest

from evergraph.engine.contract import PathWatcher
from evergraph.engine.settings import Settings
from evergraph.engine.store import vertex_dir
from evergraph.engine.vertex import Vertex, VertexHost
from evergraph.errors import ResourceError
from tests.kit.probe import Journal, make


class FakeHost:
    """Records what the vertex asks of its host."""

    def __init__(self, state_dir: Path, **settings: bool) -> None:
        self.settings = Settings(state_dir=state_dir, hostname="fake", **settings)
        self.hostname = "fake"
        self.watcher: PathWatcher | None = None
        self.world = None
        self.calls: list[tuple[str, object]] = []

    def keys(self):  # type: ignore[no-untyped-def]
        raise ResourceError("no keys here")

    def vertex_ready(self, v: Vertex) -> None:
        self.calls.append(("ready", v.ident))

    def vertex_event(self, v: Vertex) -> None:
        self.calls.append(("event", v.ident))

    def request_exit(self, code: int, by: str) -> None:
        self.calls.append(("exit", (code, by)))


def _vertex(tmp_path: Path, **settings: bool) -> tuple[Vertex, FakeHost]:
    host = FakeHost(tmp_path, **settings)
    _: VertexHost = host  # the fake is a VertexHost (checked by mypy)
    res = make(Journal(), ["x"], []).resources["probe[x]"]
    return Vertex(host, res), host


def test_a_vertex_reports_ready_events_and_exits_to_its_host(tmp_path: Path) -> None:
    v, host = _vertex(tmp_path)
    assert v.pending
    assert not v.running
    assert not v.ok
    assert not v.clean
    v.ready()
    v.event()
    v.request_exit(4)
    assert host.calls == [("ready", "probe[x]"), ("event", "probe[x]"), ("exit", (4, "probe[x]"))]
    assert v.hostname == "fake"


def test_a_vertex_gives_its_state_dir_and_refuses_what_the_host_has_not(tmp_path: Path) -> None:
    v, _host = _vertex(tmp_path)
    d = v.state_dir
    assert d == vertex_dir(tmp_path, "probe", "x")
    assert d.is_dir()
    assert d.stat().st_mode & 0o777 == 0o700
    with pytest.raises(ResourceError, match="no file watcher"):
        _ = v.watcher
    with pytest.raises(ResourceError, match="no World"):
        _ = v.world
    with pytest.raises(ResourceError, match="no keys"):
        _ = v.keys


def test_a_vertex_collects_reported_changes_and_masks_its_secrets(tmp_path: Path) -> None:
    v, _host = _vertex(tmp_path)
    v.changed("content", "a", "b", content=True)
    v.changed("mode", 0o600, 0o644)
    assert v.reported == [("content", "a", "b", True), ("mode", 0o600, 0o644, False)]
    v.secrets |= {"hunter2"}
    v.last_error = "login with hunter2 failed"
    assert v.status().error == "login with ******** failed"
    assert "hunter2" not in v.mask("pw=hunter2")
    v.unknown("cannot tell")
    assert v.unknown_why == "cannot tell"


def test_noop_without_commands_is_asked_of_the_host_settings(tmp_path: Path) -> None:
    v, _ = _vertex(tmp_path)
    assert v.may_run_commands
    assert _vertex(tmp_path, noop=True)[0].may_run_commands  # noop commands by default
    assert not _vertex(tmp_path, noop=True, noop_commands=False)[0].may_run_commands
    assert _vertex(tmp_path, noop_commands=False)[0].may_run_commands
