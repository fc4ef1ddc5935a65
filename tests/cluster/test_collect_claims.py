"""Collected exports are held to the claims rule: one that manages what a local
resource (or an earlier export) manages with other parameters is skipped with one
line, so another host can neither make this graph fight itself nor fail to load."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import evergraph.resources  # noqa: F401  (registers the kinds)
from evergraph.engine.build import build
from evergraph.engine.contract import default_registry
from evergraph.engine.model import GraphModel
from evergraph.frontends.collect import merge


def _file(name: str, path: Path, content: str) -> object:
    return build(default_registry, "file", {"name": name, "path": str(path), "content": content})


def test_an_export_fighting_a_local_file_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    target = tmp_path / "motd"
    m = GraphModel(name="g")
    m.add(_file("motd", target, "local\n"))
    evil = _file("sneaky", target, "theirs\n")
    same = _file("twin", target, "local\n")  # equal but named otherwise: no fight
    other = _file("other", tmp_path / "other", "ok\n")
    with caplog.at_level(logging.WARNING, logger="evergraph.collect"):
        merge(m, [evil, same, other])  # type: ignore[list-item]
    assert sorted(m.resources) == ["file[motd]", "file[other]", "file[twin]"]
    assert f"collected file[sneaky] manages file:{target}, as file[motd] does" in caplog.text
    m.check()  # the merged graph loads


def test_two_exports_fighting_each_other_keep_the_first(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    target = tmp_path / "x"
    m = GraphModel(name="g")
    with caplog.at_level(logging.WARNING, logger="evergraph.collect"):
        merge(m, [_file("a", target, "1\n"), _file("b", target, "2\n")])  # type: ignore[list-item]
    assert list(m.resources) == ["file[a]"]
    assert "collected file[b] manages" in caplog.text
    m.check()


def test_a_collected_line_against_a_local_file_with_content_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    target = tmp_path / "hosts"
    m = GraphModel(name="g")
    m.add(_file("hosts", target, "127.0.0.1 localhost\n"))
    line = build(default_registry, "line", {"name": "l", "file": str(target), "content": "x"})
    with caplog.at_level(logging.WARNING, logger="evergraph.collect"):
        merge(m, [line])
    assert list(m.resources) == ["file[hosts]"]
    assert f"collected line[l] manages content:{target}, as file[hosts] does" in caplog.text
    m.check()


def test_a_collected_file_with_content_against_a_local_line_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    target = tmp_path / "hosts"
    m = GraphModel(name="g")
    m.add(build(default_registry, "line", {"name": "l", "file": str(target), "content": "x"}))
    with caplog.at_level(logging.WARNING, logger="evergraph.collect"):
        merge(m, [_file("hosts", target, "theirs\n")])  # type: ignore[list-item]
    assert list(m.resources) == ["line[l]"]
    assert "collected file[hosts] manages" in caplog.text
    m.check()


def test_collected_exports_are_rebuilt_only_when_they_change(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Each round hands out new objects (prepare and the engine keep state on the
    ones they get), built again only for a changed or new export; a bad one is
    rejected every round, and a gone one is forgotten."""
    from evergraph.cluster.exports import Exported
    from evergraph.frontends.collect import Built, to_resources

    def exp(src: str, name: str, content: str) -> Exported:
        params = {"path": str(tmp_path / name), "content": content}
        return Exported(src=src, to="me", kind="file", name=name, params=params)

    cache = Built()
    first = [exp("a", "one", "1\n"), exp("b", "two", "2\n")]
    got1 = to_resources(default_registry, first, cache)
    got1[0]._own_ino = 42  # state an engine would keep on its object
    bad = Exported(src="c", to="me", kind="file", name="three", params={"mode": "rwx"})
    second = [first[0], exp("b", "two", "changed\n"), bad]
    with caplog.at_level(logging.WARNING, logger="evergraph.collect"):
        got2 = to_resources(default_registry, second, cache)
    assert [r.content for r in got2] == ["1\n", "changed\n"]  # type: ignore[attr-defined]
    assert got2[0] is not got1[0]
    assert got2[0] == got1[0]
    assert got2[0].__dict__ == {}  # a copy of the fields, not of the engine's state
    assert "rejected export: file[three]" in caplog.text
    assert sorted(n for _, _, n in cache._by) == ["one", "two"]
    to_resources(default_registry, [second[1]], cache)
    assert [n for _, _, n in cache._by] == ["two"]
