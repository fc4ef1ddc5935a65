"""Eager checks that suspend (a file's write waiting for the disk) are bounded
(`state.SUSPENDED_MAX`): the drain starts no more until they are down to
`SUSPENDED_LOW`. The bound changes when checks start, never what they decide:
the same runs, outcomes, counts, exit status and recap as without it."""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

import pytest

from evergraph.engine import guard, scheduling
from evergraph.engine.engine import Engine
from tests.kit.engine import settings
from tests.kit.probe import Journal, make, registry

NAMES = [f"p{i}" for i in range(60)]
#: a chain of 10 (each waits for its parent), the rest independent
EDGES = [(f"p{i}", f"p{i + 1}") for i in range(9)]
#: some succeed without change, some fail for good (meta.retry 0)
PARAMS = {
    **{f"p{i}": {"clean": True} for i in range(0, 60, 3)},
    **{f"p{i}": {"fail_times": 1} for i in (5, 20, 41)},
}


def run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> tuple[Journal, int, object, str]:
    journal = Journal()
    model = make(journal, NAMES, EDGES, eager=True, **PARAMS)  # type: ignore[arg-type]
    engine = Engine(settings(tmp_path), registry=registry)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="evergraph.engine"):
        status = asyncio.run(engine.run(model))
    views = sorted(
        (s.ident, s.state, s.changed_count, s.clean_count, s.fail_count, s.error)
        for s in engine.status()
    )
    recap = "\n".join(
        # (each line's duration differs run to run)
        re.sub(r"\([0-9.]+ m?s\)", "(t)", r.getMessage())
        for r in caplog.records
        if r.getMessage().startswith("recap")
    )
    return journal, status, views, recap


def most_at_once(journal: Journal) -> int:
    """The most checks started and not yet ended (or failed) at any time."""
    now = most = 0
    for _name, what, _t in journal.entries:
        if what == "start":
            now += 1
            most = max(most, now)
        elif what in ("end", "fail"):
            now -= 1
    return most


def test_the_bound_holds_and_changes_no_outcome(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    free_journal, free_status, free_views, free_recap = run(tmp_path / "free", caplog)
    assert most_at_once(free_journal) > 4  # (without the bound they do overlap)

    monkeypatch.setattr(scheduling, "SUSPENDED_MAX", 4)
    monkeypatch.setattr(guard, "SUSPENDED_LOW", 2)
    journal, status, views, recap = run(tmp_path / "bound", caplog)

    assert most_at_once(journal) <= 4
    assert status == free_status == 1  # three failed for good
    assert views == free_views
    assert recap == free_recap
    assert recap.startswith("recap: 35 changed, 3 failed, 18 clean")
    # every probe ran once, except those held back below a failed parent
    assert sorted(n for n, w, _ in journal.entries if w == "start") == sorted(
        n for n, w, _ in free_journal.entries if w == "start"
    )
