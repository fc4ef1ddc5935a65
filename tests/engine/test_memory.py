"""What a first apply keeps per vertex, and what its recap builds (issue 28: peak RSS
of a 10k first apply): equal change records are one shared object, vertices that
changed alike share their recap entry's text and changes, a vertex with no
received values holds no dict of its own, and at most SUSPENDED_MAX checks wait
suspended. Each is memory only: the values are what they were."""

from __future__ import annotations

from pathlib import Path

import pytest

from evergraph.engine import changes, state
from evergraph.engine.recap import Recaps, what_changed
from evergraph.engine.status import Change, VertexStatus
from evergraph.engine.vertex import NO_VALUES
from evergraph.resources import _commit
from tests.engine.test_vertex import _vertex


def same(text: str) -> str:
    return text


def test_equal_change_records_are_one_object() -> None:
    reports = [("content", None, b"abc\n", True), ("mode", None, "0644", False)]
    first = changes.build(reports, (), same, diffs=False)
    second = changes.build(list(reports), (), same, diffs=False)
    assert first == (Change("content", None, "4 bytes"), Change("mode", None, "0644"))
    assert first is second
    other = changes.build([("content", None, b"abcd\n", True)], (), same, diffs=False)
    assert other == (Change("content", None, "5 bytes"),)
    assert other[0] is not first[0]


def test_diffs_and_long_values_are_not_kept_by_the_memo() -> None:
    long = "x" * 500
    reports = [("content", b"a\n", b"b\n", True), ("cmd", None, long, False)]
    one = changes.build(reports, (), same, diffs=True)
    two = changes.build(reports, (), same, diffs=True)
    assert one == two
    assert one[0].diff is not None
    assert "+b" in one[0].diff
    assert one[1] == Change("cmd", None, long)
    assert one is not two
    assert one[0] is not two[0]
    assert one[1] is not two[1]


def test_a_masked_value_is_memoised_masked() -> None:
    def mask(text: str) -> str:
        return text.replace("hunter2", "********")

    got = changes.build([("args", None, "-p hunter2", False)], (), mask, diffs=False)
    assert got == (Change("args", None, "-p ********"),)
    plain = changes.build([("args", None, "-p hunter2", False)], (), same, diffs=False)
    assert plain == (Change("args", None, "-p hunter2"),), "another vertex, another mask"


def _status(i: int, changed: tuple[Change, ...]) -> VertexStatus:
    return VertexStatus(
        f"file[f{i}]", "file", f"f{i}", "changed", 1.0, None, 1, 0, 0, 0.001 * i, 1e9, changed
    )


def test_vertices_changed_alike_share_their_recap_entry_parts() -> None:
    alike = (Change("content", None, "4 bytes"), Change("mode", None, "0644"))
    other = (Change("content", None, "4 bytes"), Change("mode", "0600", "0644"))
    statuses = [_status(0, alike), _status(1, alike), _status(2, other), _status(3, ())]
    _, data = Recaps().take(statuses, "converged")
    entries = data["changed"]
    # the values are each vertex's own
    for st, entry in zip(statuses, entries, strict=True):
        assert entry == {
            "resource": st.ident,
            "kind": "file",
            "name": st.name,
            "what": what_changed(st.changes),
            "changes": [{"field": c.field, "old": c.old, "new": c.new} for c in st.changes],
            "duration": round(st.duration, 6),
        }
    assert entries[0]["what"] == "content, mode"
    assert entries[2]["what"] == "content, mode 0600 -> 0644"
    assert entries[3]["what"] == "changed"
    assert entries[3]["changes"] == []
    # ... and the parts of those that changed alike are one object
    assert entries[0]["changes"] is entries[1]["changes"]
    assert entries[0]["what"] is entries[1]["what"]
    assert entries[2]["changes"] is not entries[0]["changes"]


def test_a_vertex_that_received_nothing_holds_no_dict_of_its_own(tmp_path: Path) -> None:
    v, _ = _vertex(tmp_path)
    w, _ = _vertex(tmp_path)
    assert v.received is NO_VALUES
    assert v.inbox is NO_VALUES
    assert w.inbox is NO_VALUES
    assert not v.received
    assert not v.inbox
    with pytest.raises(TypeError):
        v.inbox["x"] = 1  # type: ignore[index]  # shared: replaced, never changed in place


def test_suspended_checks_are_bounded_near_the_committer_s_room() -> None:
    # as many again as the committer takes may wait for its room, no more: each
    # waiting check holds its task and coroutines (~3.5 KB)
    assert _commit.MAX_PENDING < state.SUSPENDED_MAX <= 2 * _commit.MAX_PENDING
    assert state.SUSPENDED_LOW == state.SUSPENDED_MAX - 128
