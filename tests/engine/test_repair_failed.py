"""A resource that failed for good (its retries spent) is not left failed: its next
event, or a backoff timer, runs it again, and it returns to clean once the cause is
gone (issue 23 item 2). Real agents, real files, a real full tmpfs."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

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
