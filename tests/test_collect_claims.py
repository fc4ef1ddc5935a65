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
