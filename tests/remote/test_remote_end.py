"""The end of an `evergraph remote` session (remote/runner.py's `Ending`): by
default it ends once every live host is converged and the World stayed quiet, so
an export between hosts is applied first and a host still busy holds everyone.
The rule itself on a fake World revision; the sessions over real sshds
(tests/kit/sshbed.py)."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from evergraph.remote.runner import Ending
from tests.conftest import wait_for
from tests.kit.sshbed import SshBed
from tests.remote.test_remote import EVERGRAPH, hosts_of, pytestmark, remote, remote_argv
from tests.remote.test_remote_exports import exporting_graph

__all__ = ["pytestmark"]

EVERGRAPH_RUN = [*EVERGRAPH, "run"]


class FakeWorld:
    """A World revision the test moves: `write()` is a write."""

    def __init__(self) -> None:
        self.rev = 1

    def write(self) -> None:
        self.rev += 1

    async def revision(self) -> int:
        return self.rev


async def _settle() -> None:
    """Let the decider run all it can (its quiet window is 0 s: a few turns)."""
    for _ in range(20):
        await asyncio.sleep(0)


def _rule_holds() -> None:
    async def body() -> None:
        world = FakeWorld()
        ending = Ending(world.revision, quiet=0)
        async with asyncio.TaskGroup() as tg:
            decider = tg.create_task(ending.run())
            a, b = ending.live("a"), ending.live("b")
            ending.report("a", True)
            await _settle()
            assert not a.is_set()  # b is still setting up (busy)
            ending.report("b", True)
            ending.report("b", False)  # b went busy again (an export arrived)
            await _settle()
            assert not a.is_set()
            assert not b.is_set()
            ending.report("b", True)
            await _settle()
            assert a.is_set()
            assert b.is_set()
            # a host that failed leaves the set: the others end without it
            c, d = ending.live("c"), ending.live("d")
            ending.report("c", True)
            await _settle()
            assert not c.is_set()
            ending.gone("d")
            await _settle()
            assert c.is_set()
            assert not d.is_set()
            decider.cancel()

    asyncio.run(body())


def test_the_session_ends_once_every_live_host_is_converged() -> None:
    _rule_holds()


def test_a_world_write_or_a_busy_host_in_the_quiet_window_starts_it_again() -> None:
    async def body() -> None:
        world = FakeWorld()
        spoil: list[Callable[[], None]] = []

        async def revision() -> int:
            # the first read of a window sees the World as it is, then a spoiler runs
            # (as if it happened during the window)
            rev = world.rev
            if spoil:
                spoil.pop(0)()
            return rev

        ending = Ending(revision, quiet=0)
        async with asyncio.TaskGroup() as tg:
            decider = tg.create_task(ending.run())
            a = ending.live("a")
            spoil += [world.write, lambda: None, lambda: ending.report("a", False)]
            ending.report("a", True)
            await _settle()
            # window 1: a write (an export on its way); window 2: the host went busy
            assert not a.is_set()
            assert ending.busied == 1
            ending.report("a", True)
            await _settle()
            assert a.is_set()
            decider.cancel()

    asyncio.run(body())


def test_an_export_arrives_before_a_session_with_the_default_end_ends(
    sshbed: Callable[[int], SshBed], tmp_path: Path
) -> None:
    bed = sshbed(2)
    h0, h1 = bed.hosts
    file = exporting_graph(tmp_path, bed.files, h0.addr, h1.addr)
    out = remote(remote_argv(bed, file, *hosts_of(bed)), tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (h1.files / "from-exporter").read_text() == f"from {h0.addr}\n"
    assert not (h0.files / "from-exporter").exists()
    for h in bed.hosts:
        assert (h.files / h.addr).read_text() == f"{h.addr}\n"
        assert f"{h.addr}: converged" in out.stdout
    assert "total: 2 host(s): 2 converged" in out.stdout


def held_graph(tmp: Path, files: Path, held: str) -> Path:
    """Each host writes its name file; `held` also runs an exec that waits for a
    line on the FIFO `files`/go (the test releases it), then records it."""
    path = tmp / "held.py"
    path.write_text(
        "def graph(g, world):\n"
        f"    g.add('file', 'name', path='{files}/' + world.host, content=world.host + '\\n')\n"
        f"    if world.host == '{held}':\n"
        f"        g.add('exec', 'held', cmd='cat {files}/go > {files}/released',\n"
        f"              creates='{files}/released', shell='/bin/sh')\n"
    )
    return path


def test_a_host_still_busy_holds_the_session_until_it_converges_last(
    sshbed: Callable[[int], SshBed], tmp_path: Path
) -> None:
    bed = sshbed(2)
    h0, h1 = bed.hosts
    fifo = h1.files / "go"
    os.mkfifo(fifo)
    file = held_graph(tmp_path, bed.files, h1.addr)
    env = {**os.environ, "SSH_AUTH_SOCK": "", "HOME": str(tmp_path), "TMPDIR": str(tmp_path)}
    argv = [*remote_argv(bed, file, *hosts_of(bed)), "--log-format", "json"]
    err_file = tmp_path / "initiator.err"
    with err_file.open("w") as err_out:
        initiator = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=err_out, text=True, env=env
        )
    records: list[dict[str, Any]] = []
    assert initiator.stdout is not None
    reader = threading.Thread(
        target=lambda: records.extend(json.loads(line) for line in initiator.stdout or ()),
        daemon=True,
    )
    reader.start()

    def converged(host: str) -> list[dict[str, Any]]:
        return [
            r
            for r in list(records)
            if r.get("host") == host and str(r.get("msg", "")).startswith("converged:")
        ]

    def released() -> bool:
        if initiator.poll() is not None:
            raise AssertionError(f"the session ended while {h1.addr} was busy: {records}")
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno == errno.ENXIO:  # the exec does not read it yet
                return False
            raise
        os.write(fd, b"go\n")
        os.close(fd)
        return True

    try:
        # h0 converged while h1's exec waits: the session stays open (h0's agent too)
        wait_for(lambda: converged(h0.addr), timeout=120, what=f"{h0.addr} converged")
        wait_for(released, timeout=120, what=f"{h1.addr}'s exec reading its FIFO")
        # (stdout is the reader's alone: no communicate())
        initiator.wait(timeout=120)
        reader.join(timeout=30)
        err = err_file.read_text()
        assert initiator.returncode == 0, "\n".join(map(json.dumps, records)) + err
    finally:
        if initiator.poll() is None:
            initiator.kill()
            initiator.wait()
        reader.join(timeout=30)
        if initiator.stdout is not None:
            initiator.stdout.close()
    assert (h1.files / "released").read_text() == "go\n"
    assert [r["recap"] for r in records if "recap" in r] == ["converged", "converged"]
    # h0 was told to stop only after h1 converged (the records' own times: when each
    # agent logged them, whenever they reached us). (That a host not converged holds
    # the others is checked without any race by the rule's tests above.)
    last = max(r["ts"] for r in converged(h1.addr))
    stops = [
        r["ts"]
        for r in records
        if r.get("host") == h0.addr and str(r.get("msg", "")).startswith("stopping")
    ]
    assert stops, records
    assert min(stops) >= last, (stops, last)


def test_an_agent_reports_each_converged_transition_and_a_term_keeps_noops_status(
    tmp_path: Path,
) -> None:
    """What a remote agent runs with by default (`run --converged-timeout 0
    --converged-report`), on this machine: `true` the moment it is converged,
    `false` when drift makes it busy, `true` again; SIGTERM (the wrapper's "exit")
    then gives --noop's exit status 3 (something would change)."""
    target = tmp_path / "managed"
    site = tmp_path / "site.py"
    site.write_text(f"def graph(g, world):\n    g.add('file', '{target}', content='one\\n')\n")
    env = {**os.environ, "HOME": str(tmp_path)}
    argv = [*EVERGRAPH_RUN, str(site), "--state-dir", str(tmp_path / "state")]
    flags = ["--converged-timeout", "0", "--converged-report", "--log-format", "json"]
    with subprocess.Popen(
        [*argv, *flags], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    ) as agent:
        try:
            assert agent.stdout is not None
            assert agent.stdout.readline() == "evergraph-converged: true\n"
            assert target.read_text() == "one\n"
            target.write_text("drift\n")  # its watch fires: busy, repaired, converged again
            assert agent.stdout.readline() == "evergraph-converged: false\n"
            assert agent.stdout.readline() == "evergraph-converged: true\n"
            assert target.read_text() == "one\n"
            agent.terminate()
            assert agent.wait(timeout=60) == 0
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
    target.write_text("drift\n")
    with subprocess.Popen(
        [*argv, *flags, "--noop"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    ) as noop:
        try:
            assert noop.stdout is not None
            assert noop.stdout.readline() == "evergraph-converged: true\n"
            noop.terminate()
            assert noop.wait(timeout=60) == 3
        finally:
            if noop.poll() is None:
                noop.kill()
                noop.wait()
    assert target.read_text() == "drift\n"
