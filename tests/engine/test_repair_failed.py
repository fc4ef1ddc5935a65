"""A resource that failed for good (its retries spent) is not left failed: its next
event, or a backoff timer, runs it again, and it returns to clean once the cause is
gone (issue 23 item 2). Real agents, real files, a real full tmpfs; and the
backoff's timing in process, on the fake clock."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Agent, wait_for


def _graph(tmp: Path, body: str) -> Path:
    g = tmp / "g.yaml"
    g.write_text("graph: repair\nresources:\n" + body)
    return g


def _logged(a: Agent, text: str, timeout: float = 10) -> None:
    """The agent's log (a pipe, flushed soon after each line) says `text`."""
    wait_for(lambda: text in a.log.read_text(), timeout, repr(text))


def test_a_failed_file_is_repaired_at_its_next_event(
    tmp_path: Path, agents: Callable[..., Agent]
) -> None:
    # the parent is a plain file: the write fails (retry: 0, the default)
    blocker = tmp_path / "d"
    blocker.write_text("in the way\n")
    target = blocker / "conf"
    g = _graph(
        tmp_path,
        f'  file:\n  - name: conf\n    path: {target}\n    content: "v=1\\n"\n',
    )
    # events only: no timer could be what repairs it
    a = agents(g, tmp_path / "state", "--repair-backoff-max", "0")
    a.wait_converged()
    _logged(a, "file[conf]: ")
    assert not target.exists()
    blocker.unlink()  # the cause goes: the directory's event runs it again
    wait_for(lambda: target.exists() and target.read_text() == "v=1\n", 10, "the file repaired")
    _logged(a, "file[conf]: failed before; trying again (an event)")
    # and it keeps repairing drift like any clean resource
    target.write_text("drift\n")
    wait_for(lambda: target.read_text() == "v=1\n", 10, "drift repaired")
    assert a.stop() == 0


def test_a_failed_command_is_tried_again_by_a_doubling_timer(
    tmp_path: Path, agents: Callable[..., Agent]
) -> None:
    marker, out = tmp_path / "marker", tmp_path / "out"
    g = _graph(
        tmp_path,
        "  exec:\n  - name: copy\n    shell: /bin/sh\n"
        f"    cmd: cat {marker} > {out}.tmp && mv {out}.tmp {out}\n",
    )
    a = agents(g, tmp_path / "state", "--repair-backoff-max", "2")
    a.wait_converged()
    # no event will ever come for a command: the timer tries it again, 1 s, then 2 s
    _logged(a, "exec[copy]: tried again at its next event, or in 2", 15)
    assert not out.exists()
    marker.write_text("hello\n")
    wait_for(lambda: out.exists() and out.read_text() == "hello\n", 10, "the command ran")
    _logged(a, "exec[copy]: failed before; trying again (backoff")
    assert a.stop() == 0


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    point = tmp_path / "small"
    point.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(point)], check=True)
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], check=True)


def test_a_file_failed_on_a_full_disk_is_written_once_space_is_freed(
    tmp_path: Path, agents: Callable[..., Agent], small_tmpfs: Path
) -> None:
    filler = small_tmpfs / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:  # fill it
        with pytest.raises(OSError, match="No space") as full:  # noqa: PT012 (ends by it)
            while os.write(fd, b"x" * 4096):
                pass
        assert full.value.errno == errno.ENOSPC
    finally:
        os.close(fd)
    target = small_tmpfs / "conf"
    content = "y" * 20000
    g = _graph(tmp_path, f"  file:\n  - name: conf\n    path: {target}\n    content: {content}\n")
    # freeing space is no event of the file's: the timer finds it (1 s, then 2 s...)
    a = agents(g, tmp_path / "state", "--repair-backoff-max", "2")
    a.wait_converged()
    _logged(a, "No space left on device")
    assert not target.exists()
    filler.unlink()
    wait_for(lambda: target.exists() and target.read_text() == content, 10, "written")
    assert a.stop() == 0


def test_a_one_shot_run_still_exits_failed_at_once(tmp_path: Path) -> None:
    blocker = tmp_path / "d"
    blocker.write_text("in the way\n")
    g = _graph(tmp_path, f"  file:\n  - name: conf\n    path: {blocker}/conf\n    content: x\n")
    from tests.conftest import run_cli

    r = run_cli("run", g, "--state-dir", tmp_path / "state", "--converged-exit", timeout=30)
    assert r.returncode == 1, r.stderr
    assert "tried again" not in r.stderr


def test_bad_backoff_is_refused(tmp_path: Path) -> None:
    from tests.conftest import run_cli

    g = _graph(tmp_path, "  noop:\n  - name: n\n")
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--repair-backoff-max", "-1")
    assert r.returncode == 2
    assert "--repair-backoff-max" in r.stderr


# -- in process, on the fake clock: the backoff's timing, exactly ---------------------


def _engine_settings(tmp_path: Path, backoff_max: float) -> Any:
    from evergraph.engine.settings import Settings

    return Settings(
        state_dir=tmp_path,
        hostname="test",
        converged_exit=False,
        converged_timeout=None,
        repair_backoff_max=backoff_max,
    )


def test_the_repair_timer_doubles_up_to_its_cap_and_a_success_resets_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from evergraph.engine.engine import Engine
    from evergraph.testing.clock import FakeClock
    from tests.kit.engine import until
    from tests.kit.probe import Journal, make

    clock = FakeClock()
    j = Journal(clock=clock.monotonic)
    # runs 1-4 fail (retry: 0: each failure is for good), run 5 succeeds
    model = make(j, ["p"], [], p={"fail_times": 4})

    async def main() -> tuple[int, float]:
        eng = Engine(_engine_settings(tmp_path, 4), clock=clock)
        task = asyncio.create_task(eng.run(model))
        for n in range(1, 5):
            await until(lambda n=n: len(j.stamps("p", "fail")) == n and clock.waiting() > 0)  # type: ignore[misc]
            assert eng.vertices["probe[p]"].state == "failed"
            await clock.advance_to_next()
        await until(lambda: j.stamps("p", "end") != [])
        v = eng.vertices["probe[p]"]
        await until(lambda: v.state == "changed")  # applied: clean again
        delay = v.repair_delay
        eng.request_stop()
        return await asyncio.wait_for(task, 5), delay

    with caplog.at_level(logging.INFO, logger="evergraph.engine"):
        rc, delay = asyncio.run(main())
    assert rc == 0
    # tried again after 1 s, then 2, 4, and 4 again (the cap)
    assert j.stamps("p", "start") == [0.0, 1.0, 3.0, 7.0, 11.0]
    assert delay == 0.0  # repaired: a later failure backs off from the start
    text = caplog.text
    assert "probe[p]: failed before; trying again (backoff 1" in text
    assert "probe[p]: tried again at its next event, or in 4" in text


def test_an_event_revives_a_failed_vertex_before_its_timer(tmp_path: Path) -> None:
    from evergraph.engine.engine import Engine
    from evergraph.testing.clock import FakeClock
    from tests.kit.engine import until
    from tests.kit.probe import Journal, make

    clock = FakeClock()
    j = Journal(clock=clock.monotonic)
    model = make(j, ["p"], [], p={"fail_times": 1})

    async def main() -> int:
        eng = Engine(_engine_settings(tmp_path, 60), clock=clock)
        task = asyncio.create_task(eng.run(model))
        await until(lambda: j.stamps("p", "fail") != [] and clock.waiting() > 0)
        await clock.advance(0.5)  # before the 1 s timer
        j.handles["p"].event()
        await until(lambda: j.stamps("p", "end") != [])
        assert clock.waiting() == 0  # the repair timer was cancelled
        eng.request_stop()
        return await asyncio.wait_for(task, 5)

    assert asyncio.run(main()) == 0
    assert j.stamps("p", "start") == [0.0, 0.5]
