"""The scheduler (cluster/scheduler.py), the `schedule` kind, `evergraph schedule` and
`world.schedule(ns)`: pure strategies; volunteers and one fenced leader on the
memory and sqlite Worlds; real agents sharing one sqlite World."""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from evergraph.cluster.scheduler import (
    Chosen,
    Options,
    Volunteer,
    choose,
    chosen,
    chosen_key,
    decide,
    namespace_problem,
    read_chosen,
    volunteer_key,
    watch_chosen,
    withdrawn_key,
)
from evergraph.world.follow import Tombstone, watch_one
from evergraph.world.kv import KV
from tests.conftest import EVERGRAPH, Agent, run_cli, wait_for
from tests.kit.worlds import Factory, world_factory

#: the longest any wait in these tests may take (seconds)
BOUND = 20.0

# -- pure: the strategies ----------------------------------------------------------------


def test_rr_keeps_who_is_chosen_and_fills_by_name() -> None:
    # first choice: by name
    assert choose("rr", 2, ["d", "b", "c", "a"]) == ["a", "b"]
    # a host joining takes nobody's place, even one that sorts first
    assert choose("rr", 2, ["0", "a", "b", "c"], previous=["b", "c"]) == ["b", "c"]
    # a chosen host leaving is replaced by the first free one by name; the other stays
    assert choose("rr", 2, ["a", "b", "d"], previous=["b", "c"]) == ["a", "b"]
    # the same inputs, the same answer: no needless reshuffle
    for _ in range(3):
        assert choose("rr", 2, ["c", "b", "a", "e"], previous=["c", "e"]) == ["c", "e"]
    # nobody volunteers: nobody is chosen
    assert choose("rr", 2, [], previous=["a", "b"]) == []


def test_alpha_is_the_first_max_by_name() -> None:
    assert choose("alpha", 2, ["c", "b", "a"]) == ["a", "b"]
    # a new host that sorts first displaces the last one chosen
    assert choose("alpha", 2, ["0", "a", "b"], previous=["a", "b"]) == ["0", "a"]
    assert choose("alpha", 1, ["b", "a"], previous=["b"]) == ["a"]


def test_max_bounds_the_choice_and_a_lower_max_keeps_the_first() -> None:
    assert choose("rr", 5, ["b", "a"]) == ["a", "b"]
    assert choose("rr", 1, ["a", "b", "c"], previous=["b", "c"]) == ["b"]
    assert choose("alpha", 3, ["e", "d", "c", "b", "a"]) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="max"):
        choose("rr", 0, ["a"])
    with pytest.raises(ValueError, match="strategy"):
        choose("random", 1, ["a"])


def test_persist_keeps_a_vanished_host_until_it_withdraws() -> None:
    # without persist a vanished host is replaced
    assert choose("rr", 1, ["a", "c"], previous=["b"]) == ["a"]
    # with persist it stays chosen (and keeps its place: nobody is added)
    assert choose("rr", 1, ["a", "c"], previous=["b"], persist=True) == ["b"]
    assert choose("rr", 2, ["a"], previous=["b", "c"], persist=True) == ["b", "c"]
    # until it withdrew on purpose
    assert choose("rr", 1, ["a", "c"], previous=["b"], persist=True, withdrawn=["b"]) == ["a"]
    # a withdrawal of a host that volunteers again means nothing
    assert choose("rr", 1, ["a", "b"], previous=["b"], persist=True, withdrawn=["b"]) == ["b"]
    # a lower max keeps the hosts still volunteering first
    assert choose("rr", 1, ["c"], previous=["b", "c"], persist=True) == ["c"]
    # alpha: vanishing does not drop it, but a volunteer sorting before it does
    assert choose("alpha", 1, ["c"], previous=["b"], persist=True) == ["b"]
    assert choose("alpha", 1, ["a", "c"], previous=["b"], persist=True) == ["a"]


def test_decide_writes_only_a_different_choice_with_the_next_version() -> None:
    rr2 = Options(max=2)
    first = decide(rr2, ["b", "a", "c"], None, leader="a")
    assert first == Chosen(hosts=["a", "b"], strategy="rr", max=2, version=1, leader="a")
    # the same choice (whoever leads now): nothing to write
    assert decide(rr2, ["a", "b", "c", "d"], first, leader="c") is None
    # a change of hosts, or of the options in force, is a new version
    second = decide(rr2, ["b", "c"], first)
    assert second is not None
    assert (second.hosts, second.version) == (["b", "c"], 2)
    third = decide(Options(max=2, strategy="alpha"), ["b", "c"], second)
    assert third is not None
    assert (third.hosts, third.strategy, third.version) == (
        ["b", "c"],
        "alpha",
        3,
    )


def test_bad_options_and_namespaces_are_named() -> None:
    assert Options().problem() is None
    assert Options(strategy="random").problem() == (
        "strategy",
        "'random' is not a strategy: rr or alpha",
    )
    assert (Options(max=0).problem() or ("",))[0] == "max"
    assert (Options(ttl=-1).problem() or ("",))[0] == "ttl"
    assert (Options(ttl=0).problem() or ("",))[0] == "ttl"
    assert namespace_problem("web") is None
    assert namespace_problem("db.primary-1") is None
    for bad in ("", "a/b", "a b", "-x", "é"):
        assert namespace_problem(bad) is not None, bad


# -- in process: volunteers and their leader on the memory and sqlite Worlds -------------


@pytest.fixture(params=["memory", "sqlite"])
def factory(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Factory]:
    with world_factory(request.param, tmp_path) as (make, _server):
        yield make


class Cluster:
    """Volunteers, each with its own KV client (as separate hosts would have)."""

    def __init__(self, factory: Factory, ns: str) -> None:
        self.factory = factory
        self.ns = ns
        self.kv = factory()  # an observer's client
        self.vols: dict[str, Volunteer] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self._clients: list[KV] = [self.kv]

    def start(self, host: str, **opts: object) -> Volunteer:
        kv = self.factory()
        self._clients.append(kv)
        vol = Volunteer(kv, self.ns, host, Options(ttl=1, **opts))  # type: ignore[arg-type]
        self.vols[host] = vol
        self.tasks[host] = asyncio.create_task(vol.run(), name=f"volunteer-{host}")
        return vol

    async def stop(self, host: str, withdraw: bool = False) -> None:
        """The resource leaving the graph: its watch cancelled, then its cleanup."""
        task = self.tasks.pop(host)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await self.vols.pop(host).leave(withdraw=withdraw)

    def leaders(self) -> list[str]:
        return [h for h, v in self.vols.items() if v.is_leader]

    async def until_chosen(self, pred: Callable[[list[str]], bool]) -> list[str]:
        async with asyncio.timeout(BOUND):
            async with contextlib.aclosing(watch_chosen(self.kv, self.ns)) as it:
                async for hosts in it:
                    if pred(hosts):
                        return hosts
        raise AssertionError("the World was closed")

    async def until_gone(self, key: str) -> None:
        async with asyncio.timeout(BOUND):
            async with contextlib.aclosing(watch_one(self.kv, key)) as it:
                async for snap in it:
                    if isinstance(snap, Tombstone):
                        return

    async def close(self) -> None:
        for host in list(self.tasks):
            await self.stop(host)
        for kv in self._clients:
            await kv.close()


def run_cluster(factory: Factory, ns: str, body: Callable[[Cluster], Awaitable[None]]) -> None:
    async def main() -> None:
        c = Cluster(factory, ns)
        try:
            await asyncio.wait_for(body(c), 60)
        finally:
            await c.close()

    asyncio.run(main())


async def until(pred: Callable[[], object]) -> None:
    """Wait (bounded) for a condition on in-process state (a leader elected, ...)."""
    async with asyncio.timeout(BOUND):
        while not pred():
            await asyncio.sleep(0.005)


async def settled(c: Cluster) -> Volunteer:
    """The leader, once it has decided on the news up to now (one step more)."""
    await until(lambda: len(c.leaders()) == 1)
    leader = c.vols[c.leaders()[0]]
    steps = leader.steps
    # a write it must see, and that decides nothing: a key of the namespace no one reads
    await c.kv.put(f"scheduler/{c.ns}/note", b"")
    await until(lambda: leader.steps > steps)
    return leader


def test_volunteers_elect_one_leader_that_writes_the_choice_once(factory: Factory) -> None:
    async def body(c: Cluster) -> None:
        for h in ("h1", "h2", "h3"):
            c.start(h, max=2)
        await until(lambda: all(v.volunteered.is_set() for v in c.vols.values()))
        hosts = await c.until_chosen(lambda hs: len(hs) == 2)
        assert set(hosts) <= {"h1", "h2", "h3"}
        leader = await settled(c)
        record = await c.kv.get(chosen_key(c.ns))
        got = await read_chosen(c.kv, c.ns)
        assert record is not None
        assert got is not None
        assert got.hosts == hosts
        assert got.leader in c.vols
        # every version was written by a leader, once; the others wrote nothing
        assert sum(v.writes for v in c.vols.values()) == got.version
        assert all(v.writes == 0 for v in c.vols.values() if v is not leader and v.steps == 0)
        # a volunteer rewriting its record (nothing to decide): no new choice written
        spare = next(h for h in c.vols if h not in hosts)
        deleted = await c.kv.delete_prefix(volunteer_key(c.ns, spare))
        assert deleted == 1
        async with asyncio.timeout(BOUND):  # its volunteer writes it again
            async with contextlib.aclosing(watch_one(c.kv, volunteer_key(c.ns, spare))) as it:
                async for snap in it:
                    if not isinstance(snap, Tombstone) and snap.mod_revision > record.mod_revision:
                        break
        assert await settled(c) is leader
        after = await c.kv.get(chosen_key(c.ns))
        assert after is not None
        assert after.mod_revision == record.mod_revision
        assert await chosen(c.kv, c.ns) == hosts

    run_cluster(factory, "web", body)


def test_a_chosen_host_leaving_is_replaced_and_a_new_leader_takes_over(factory: Factory) -> None:
    async def body(c: Cluster) -> None:
        for h in ("h1", "h2", "h3"):
            c.start(h, max=2)
        await until(lambda: all(v.volunteered.is_set() for v in c.vols.values()))
        hosts = await c.until_chosen(lambda hs: len(hs) == 2)
        leader = (await settled(c)).host
        # the leader leaves if it is chosen (else a chosen host): the other chosen one stays
        gone = leader if leader in hosts else hosts[0]
        stays = next(h for h in hosts if h != gone)
        spare = next(h for h in c.vols if h not in hosts)
        await c.stop(gone)  # no withdraw: its record expires with the TTL
        assert await c.until_chosen(lambda hs: gone not in hs) == sorted([stays, spare])
        # a host coming back takes nobody's place (rr)
        back = c.start(gone, max=2)
        await until(lambda: back.volunteered.is_set())
        await settled(c)
        assert await chosen(c.kv, c.ns) == sorted([stays, spare])

    run_cluster(factory, "web", body)


def test_a_deposed_leader_cannot_overwrite_the_choice(factory: Factory) -> None:
    async def body(c: Cluster) -> None:
        a = c.start("a", max=1)
        await c.until_chosen(lambda hs: hs == ["a"])
        b = c.start("b", max=1)
        await until(lambda: b.volunteered.is_set())
        assert await settled(c) is a
        old_term = a.election.term
        snapshot = {i.key: i for i in (await c.kv.range(f"scheduler/{c.ns}/"))[0]}
        await a.election.resign()  # b leads now
        await until(lambda: b.is_leader)
        # a still believes it leads at its old term (a paused process that missed the
        # news) and decides differently (max 2): the World refuses the write
        a.election._term = old_term
        a.options = Options(ttl=1, max=2)
        before = await c.kv.get(chosen_key(c.ns))
        refused = a.refused
        assert not await a.step(snapshot)
        assert a.refused == refused + 1
        after = await c.kv.get(chosen_key(c.ns))
        assert before is not None
        assert after is not None
        assert after.mod_revision == before.mod_revision
        assert await chosen(c.kv, c.ns) == ["a"]

    run_cluster(factory, "web", body)


def test_withdraw_deletes_the_record_at_once_and_persist_waits_for_it(factory: Factory) -> None:
    async def body(c: Cluster) -> None:
        c.start("a", max=1, persist=True)
        await c.until_chosen(lambda hs: hs == ["a"])
        b = c.start("b", max=1, persist=True)
        await until(lambda: b.volunteered.is_set())
        # a stops without withdrawing: its record expires, b leads, a stays chosen
        await c.stop("a")
        await c.until_gone(volunteer_key(c.ns, "a"))
        assert await settled(c) is b
        got = await read_chosen(c.kv, c.ns)
        assert got is not None
        assert got.hosts == ["a"]
        assert got.persist
        # a comes back and withdraws on purpose: its record goes at once, b replaces it
        a = c.start("a", max=1, persist=True)
        await until(lambda: a.volunteered.is_set())
        await c.stop("a", withdraw=True)
        assert await c.kv.get(volunteer_key(c.ns, "a")) is None
        assert await c.until_chosen(lambda hs: hs != ["a"]) == ["b"]
        await c.until_gone(withdrawn_key(c.ns, "a"))  # the leader consumed the withdrawal

    run_cluster(factory, "web", body)


# -- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ("strategy: random", "strategy"),
        ("max: 0", "max"),
        ("ttl: -1", "ttl"),
        ("namespace: a/b", "namespace"),
    ],
)
def test_bad_values_exit_2_naming_the_field(tmp_path: Path, params: str, field: str) -> None:
    g = tmp_path / "bad.yaml"
    g.write_text(f"resources:\n  schedule:\n  - {{name: web, {params}}}\n")
    r = run_cli("check", g)
    assert r.returncode == 2, r.stderr
    assert f"schedule[web].{field}" in r.stderr, r.stderr


def test_bad_values_in_python_and_the_cli(tmp_path: Path) -> None:
    mod = tmp_path / "bad.py"
    mod.write_text("def graph(g, world):\n    g.add('schedule', 'web', max=0)\n")
    r = run_cli("check", mod)
    assert r.returncode == 2, r.stderr
    assert "schedule[web].max" in r.stderr, r.stderr
    mod.write_text("def graph(g, world):\n    world.schedule('a b')\n")
    r = run_cli("check", mod)
    assert r.returncode == 2, r.stderr
    assert "world.schedule" in r.stderr, r.stderr
    db = tmp_path / "world.sqlite"
    assert run_cli("world", "put", "x", "y", "--world-db", db).returncode == 0
    r = run_cli("schedule", "a/b", "--world-db", db)
    assert r.returncode == 2, r.stderr
    assert "NS" in r.stderr, r.stderr
    r = run_cli("schedule", "web", "--world-db", db)
    assert r.returncode == 1, r.stderr
    assert "nothing chosen" in r.stderr, r.stderr
    r = run_cli("schedule", "web", "--world-db", tmp_path / "none.sqlite")
    assert r.returncode == 2, r.stderr


# -- real agents on one sqlite World -------------------------------------------------------

GRAPH = """\
import os

def graph(g, world):
    g.add("schedule", "web", max=2, ttl=2)
    hosts = world.schedule("web")
    g.add("file", "chosen", path=os.environ["OUT"] + "/" + world.host,
          content="".join(h + "\\n" for h in hosts))
"""


class Lines:
    """A running `evergraph schedule NS --watch`: its lines, read in a thread."""

    def __init__(self, *args: str | Path) -> None:
        self.proc = subprocess.Popen(
            [*EVERGRAPH, "schedule", *map(str, args), "--watch"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.q: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.q.put(line.rstrip("\n"))

    def until(self, pred: Callable[[list[str]], bool], timeout: float = BOUND) -> list[str]:
        """The first line (hosts) that `pred` accepts."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                hosts = self.q.get(timeout=max(0.0, left)).split()
            except queue.Empty:
                raise AssertionError(f"no line matched within {timeout}s") from None
            if pred(hosts):
                return hosts

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()


@contextlib.contextmanager
def watching(*args: str | Path) -> Iterator[Lines]:
    w = Lines(*args)
    try:
        yield w
    finally:
        w.stop()


def test_five_agents_two_chosen_a_killed_one_replaced_and_graphs_follow(
    tmp_path: Path,
    agents: Callable[..., Agent],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    db = tmp_path / "world.sqlite"
    out = tmp_path / "out"
    out.mkdir()
    mod = tmp_path / "site.py"
    mod.write_text(GRAPH)
    monkeypatch.setenv("OUT", str(out))
    names = [f"h{i}" for i in range(1, 6)]
    started: dict[str, Agent] = {}
    for h in names:
        started[h] = agents(mod, tmp_path / f"st-{h}", "--hostname", h, "--world-db", str(db))

    def files_say(hosts: list[str], among: list[str]) -> Callable[[], bool]:
        want = "".join(f"{h}\n" for h in hosts)

        def ok() -> bool:
            return all((out / h).is_file() and (out / h).read_text() == want for h in among)

        return ok

    wait_for(db.is_file, what="the World")
    with watching("web", "--world-db", db) as w:
        first = w.until(lambda hs: len(hs) == 2)
        for a in started.values():
            a.wait_converged()
        r = run_cli("schedule", "web", "--world-db", db)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split("\n")[:-1] == first
        # every agent's graph rendered the choice
        wait_for(files_say(first, names), what="every graph shows the choice")
        # kill -9 a chosen agent (the leader, if it is chosen): another takes its place
        info = asyncio.run(_read(db))
        assert info is not None
        assert info.hosts == first
        victim = info.leader if info.leader in first else first[0]
        os.kill(started[victim].proc.pid, signal.SIGKILL)
        started[victim].proc.wait()
        killed = time.monotonic()
        second = w.until(lambda hs: victim not in hs, timeout=2 + 8)
        took = time.monotonic() - killed
        assert len(second) == 2
        assert set(first) - {victim} < set(second)
        assert took < 2 + 3, f"replaced after {took:.1f}s (ttl 2)"
        alive = [h for h in names if h != victim]
        wait_for(files_say(second, alive), what="the graphs re-rendered the new choice")
    r = run_cli("schedule", "web", "--world-db", db)
    assert r.stdout.split() == second


async def _read(db: Path) -> Chosen | None:
    from evergraph.world.sqlite import SQLiteKV

    async with SQLiteKV(db) as kv:
        return await read_chosen(kv, "web")


SENDING = """\
resources:
  schedule:
  - {{name: db, strategy: alpha, withdraw: true}}
  file:
  - {{name: primary, path: "{out}"}}
edges:
- from: {{kind: schedule, name: db, send: hosts}}
  to: {{kind: file, name: primary, recv: content}}
"""


def test_hosts_are_sent_and_withdraw_hands_over_without_waiting_for_the_ttl(
    tmp_path: Path, agents: Callable[..., Agent]
) -> None:
    db = tmp_path / "world.sqlite"
    outs = {h: tmp_path / f"primary-{h}" for h in ("h1", "h2")}
    started = {}
    for h, out in outs.items():
        g = tmp_path / f"{h}.yaml"
        g.write_text(SENDING.format(out=out))
        started[h] = agents(g, tmp_path / f"st-{h}", "--hostname", h, "--world-db", str(db))
    # alpha, max 1: h1; every host's file receives the choice
    wait_for(
        lambda: all(o.is_file() and o.read_text() == "h1\n" for o in outs.values()),
        what="both files name h1",
    )
    # h1 stops (its resource leaves): withdrawn at once, not after the TTL (10 s)
    stopped = time.monotonic()
    assert started["h1"].stop() == 0
    wait_for(lambda: outs["h2"].read_text() == "h2\n", timeout=8, what="h2 takes over")
    assert time.monotonic() - stopped < 8
    r = run_cli("schedule", "db", "--world-db", db)
    assert r.stdout == "h2\n", r.stderr
