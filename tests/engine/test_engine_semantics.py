"""Engine semantics found broken by testing (issue 13, item 5): semaphores, hidden,
realize, the runtime bound, --no-watch, meta ranges, resources that fight."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any, ClassVar

import pytest

from evergraph.engine import Edge, GraphModel
from evergraph.engine.contract import Meta, Registry, Resource, register
from evergraph.engine.engine import Engine
from evergraph.engine.settings import Settings
from evergraph.errors import InputError
from evergraph.testing.clock import FakeClock
from tests.kit.engine import settings, until
from tests.kit.probe import Journal, Probe, make

registry = Registry()


@register("sender", registry=registry)
class Sender(Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
    """Changes on its first run, then sends `value`."""

    sends: ClassVar[dict[str, Any]] = {"value": str}
    value: str = ""

    async def check_apply(self, apply: bool) -> bool:
        first = not getattr(self, "_done", False)
        self._done = True
        return not first

    def sent(self) -> dict[str, object]:
        return {"value": self.value} if getattr(self, "_done", False) else {}


@register("receiver", registry=registry)
class Receiver(Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
    """Records each check_apply (a class list: a received value makes a new instance)."""

    calls: ClassVar[list[tuple[str, str, bool]]] = []
    msg: str = ""

    async def check_apply(self, apply: bool) -> bool:
        Receiver.calls.append((self.name, self.msg, self.handle.refresh()))
        await asyncio.sleep(0)
        return True


# -- 1. semaphores ------------------------------------------------------------------


def test_semaphores_a_and_a1_are_one_and_taken_in_id_order(tmp_path: Path) -> None:
    """`a` sorts before `a-x`, `a:1` after it: taken by spec text, two of these three
    deadlocked forever. Normalised (`a` is `a:1`) and taken by id, they converge."""
    j = Journal()
    model = make(
        j,
        ["r1", "r2", "r3", "twice"],
        [],
        r1={"meta": Meta(sema=["a"])},
        r2={"meta": Meta(sema=["a", "a-x"])},
        r3={"meta": Meta(sema=["a:1", "a-x"])},
        # one semaphore named twice is taken once (taken twice, it waits for itself)
        twice={"meta": Meta(sema=["b", "b:1"])},
    )

    async def main() -> int:
        return await asyncio.wait_for(Engine(settings(tmp_path)).run(model), 10)

    assert asyncio.run(main()) == 0
    for n in ("r1", "r2", "r3", "twice"):
        assert j.runs(n) == 1, n
    # `a` and `a:1` are one semaphore of count 1: the three never overlap
    spans = sorted((j.stamps(n, "start")[0], j.stamps(n, "end")[0]) for n in ("r1", "r2", "r3"))
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start


@pytest.mark.parametrize(
    ("first", "second"), [(["a:2"], ["a"]), (["a:1"], ["x", "a:3"]), (["a"], ["a:2"])]
)
def test_one_semaphore_id_with_two_counts_is_a_load_error_naming_both(
    first: list[str], second: list[str]
) -> None:
    model = GraphModel(name="g")
    model.add(Probe(name="one", meta=Meta(sema=first)))
    model.add(Probe(name="two", meta=Meta(sema=second)))
    with pytest.raises(InputError) as e:
        model.check()
    assert e.value.where == "probe[two].meta.sema"
    assert "probe[one]" in e.value.message
    assert "'a'" in e.value.message


def test_one_resource_giving_one_semaphore_two_counts_is_refused() -> None:
    model = GraphModel(name="g")
    model.add(Probe(name="one", meta=Meta(sema=["a", "a:2"])))
    with pytest.raises(InputError, match="one count per id") as e:
        model.check()
    assert e.value.where == "probe[one].meta.sema"


def test_equal_counts_across_resources_pass() -> None:
    model = GraphModel(name="g")
    model.add(Probe(name="one", meta=Meta(sema=["a:2", "b"])))
    model.add(Probe(name="two", meta=Meta(sema=["b:1", "a:2"])))
    model.connect(Edge("probe[one]", "probe[two]"))
    assert model.check() == ["probe[one]", "probe[two]"]


# -- 2. hidden -------------------------------------------------------------------------


def test_hidden_vertex_takes_values_and_refreshes_without_applying(tmp_path: Path) -> None:
    """A hidden receiver of a sent value and of a notify refresh is never applied; it
    holds the value it received, stays clean, and its child runs after it."""
    Receiver.calls.clear()
    model = GraphModel(name="hidden")
    model.add(Sender(name="s", value="hello"))
    model.add(Sender(name="n"))
    model.add(Receiver(name="h", meta=Meta(hidden=True)))
    model.add(Receiver(name="k"))
    model.connect(Edge("sender[s]", "receiver[h]", send="value", recv="msg"))
    model.connect(Edge("sender[n]", "receiver[h]", notify=True))
    model.connect(Edge("receiver[h]", "receiver[k]"))
    model.check()

    async def main() -> Engine:
        eng = Engine(settings(tmp_path), registry=registry)
        assert await asyncio.wait_for(eng.run(model), 10) == 0
        return eng

    eng = asyncio.run(main())
    assert [c[0] for c in Receiver.calls] == ["k"], Receiver.calls
    h = eng.vertices["receiver[h]"]
    assert h.res.msg == "hello", "the value still reached the hidden receiver"
    assert h.ok
    assert not h.pending
    assert h.changed_count == 0
    assert not h.refresh_flag
    assert not list((tmp_path / "vertices" / "receiver").glob("h/refresh*"))


# -- 3. realize ------------------------------------------------------------------------


def test_realize_waits_for_its_parents(tmp_path: Path) -> None:
    """A realize vertex removed while its parent runs is applied after the parent
    succeeded, never before."""
    j = Journal()
    first = make(j, ["p", "r"], [("p", "r")], r={"meta": Meta(realize=True)})
    second = GraphModel(name="probes")
    second.add(first.resources["probe[p]"])
    second.check()

    async def main() -> int:
        j.gates["p"] = asyncio.Event()
        j.started["p"] = asyncio.Event()
        eng = Engine(settings(tmp_path, converged_exit=False, converged_timeout=None))
        task = asyncio.create_task(eng.run(first))
        await asyncio.wait_for(j.started["p"].wait(), 5)
        swap = asyncio.create_task(eng.swap(second))
        await until(lambda: "probe[r]" not in eng.vertices)
        for _ in range(20):
            await asyncio.sleep(0)
        assert j.runs("r") == 0, "realize ran before its parent succeeded"
        j.gates["p"].set()
        await asyncio.wait_for(swap, 5)
        eng.request_stop()
        return await asyncio.wait_for(task, 5)

    assert asyncio.run(main()) == 0
    assert j.runs("r") == 1, "realized once on its way out"
    assert j.stamps("r", "start")[0] >= j.stamps("p", "end")[0]


@pytest.mark.parametrize("where", ["meta", "settings"])
def test_realize_honours_noop(tmp_path: Path, where: str) -> None:
    """Removed while waiting to retry (never applied), a noop vertex is checked once
    on its way out, not applied."""
    j = Journal()
    meta = Meta(realize=True, retry=1, delay=60_000, noop=where == "meta")
    first = make(j, ["r"], [], r={"fail_times": 1, "meta": meta})

    async def main() -> int:
        eng = Engine(
            settings(
                tmp_path, converged_exit=False, converged_timeout=None, noop=where == "settings"
            )
        )
        task = asyncio.create_task(eng.run(first))
        await until(lambda: j.stamps("r", "fail") != [])
        await eng.swap(make(j, [], []))
        eng.request_stop()
        return await asyncio.wait_for(task, 5)

    asyncio.run(main())
    assert j.runs("r") == 2, "checked once more on its way out"
    assert len(j.stamps("r", "noop")) == 2, "in noop, realize only checks"


def test_realize_does_not_hold_a_swap_when_its_parent_fails(tmp_path: Path) -> None:
    j = Journal()
    first = make(j, ["p", "r"], [("p", "r")], p={"fail_times": 1}, r={"meta": Meta(realize=True)})
    second = GraphModel(name="probes")
    second.add(first.resources["probe[p]"])
    second.check()

    async def main() -> None:
        j.gates["p"] = asyncio.Event()
        j.started["p"] = asyncio.Event()
        eng = Engine(settings(tmp_path, converged_exit=False, converged_timeout=None))
        task = asyncio.create_task(eng.run(first))
        await asyncio.wait_for(j.started["p"].wait(), 5)
        swap = asyncio.create_task(eng.swap(second))
        await until(lambda: "probe[r]" not in eng.vertices)
        j.gates["p"].set()  # p fails, for good (no retries)
        await asyncio.wait_for(swap, 5)
        eng.request_stop()
        await asyncio.wait_for(task, 5)

    asyncio.run(main())
    assert j.runs("r") == 0


# -- 4. the runtime bound and stopping -----------------------------------------------


def test_stop_ends_waiters_at_once_and_in_flight_applies_after_the_grace(
    tmp_path: Path,
) -> None:
    """A stop request always ends the run: a run waiting for a semaphore is cancelled
    at once (it changed nothing), a hung apply once the stop grace is over."""
    j = Journal()
    model = make(
        j,
        ["holder", "waiter"],
        [],
        holder={"meta": Meta(sema=["s"])},
        waiter={"meta": Meta(sema=["s"])},
    )

    async def main() -> int:
        for n in ("holder", "waiter"):
            j.gates[n] = asyncio.Event()  # never set: both would hang for ever
            j.started[n] = asyncio.Event()
        clock = FakeClock()
        eng = Engine(
            settings(tmp_path, converged_exit=False, converged_timeout=None, stop_grace=0.3),
            clock=clock,
        )
        task = asyncio.create_task(eng.run(model))
        await asyncio.wait_for(j.started["holder"].wait(), 5)
        await until(lambda: eng.vertices["probe[waiter]"] in eng._waiting)
        eng.request_stop()  # once
        await until(lambda: eng.vertices["probe[waiter]"].apply_task is None, 1)
        assert not task.done(), "the in-flight apply has its grace"
        await until(lambda: clock.waiting() > 0)  # the grace's timer
        await clock.advance(0.29)
        assert not task.done(), "the in-flight apply has all of its grace"
        await clock.advance(0.01)
        return await asyncio.wait_for(task, 5)

    rc = asyncio.run(main())
    assert rc == 1
    assert j.runs("waiter") == 0
    assert not j.stamps("holder", "end")


def test_max_runtime_cancels_in_flight_applies_at_its_bound(tmp_path: Path) -> None:
    """In process, on the fake clock: the bound counts from the engine's creation, and
    a run cut short with work undone exits 1."""
    j = Journal()
    model = make(j, ["slow", "after"], [("slow", "after")])

    async def main() -> tuple[int, bool]:
        j.gates["slow"] = asyncio.Event()  # never set
        j.started["slow"] = asyncio.Event()
        clock = FakeClock()
        eng = Engine(settings(tmp_path, converged_exit=False, max_runtime=2.0), clock=clock)
        task = asyncio.create_task(eng.run(model))
        await asyncio.wait_for(j.started["slow"].wait(), 5)
        await clock.advance(1.99)
        assert not task.done()
        await clock.advance(0.01)
        rc = await asyncio.wait_for(task, 5)
        return rc, eng.vertices["probe[slow]"].ok

    rc, ok = asyncio.run(main())
    assert rc == 1
    assert not ok
    assert not j.stamps("slow", "end")
    assert j.runs("after") == 0


def test_max_runtime_is_a_hard_bound(tmp_path: Path) -> None:
    """`--max-runtime 1` with a 30 s command: the command is cancelled (SIGTERM) and
    the agent exits within 2 s of the bound, leaving no process behind."""
    import subprocess
    import sys
    import time

    pidfile = tmp_path / "pid"
    g = tmp_path / "g.yaml"
    g.write_text(
        "graph: t\nresources:\n  exec:\n  - name: slow\n    shell: /bin/sh\n"
        f"    cmd: 'echo $$ > {pidfile}; exec sleep 30'\n"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "evergraph.cli.main",
            "run",
            str(g),
            "--state-dir",
            str(tmp_path / "s"),
            "--max-runtime",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while not (pidfile.exists() and pidfile.read_text().strip()):
            assert proc.poll() is None, "the agent exited before its command ran"
            assert time.monotonic() < deadline, "the command never ran"
            time.sleep(0.005)
        started = time.monotonic()  # the engine started before the command did
        out, _ = proc.communicate(timeout=40)
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert took < 1 + 2, f"exited {took:.1f}s after the command started:\n{out}"
    assert proc.returncode == 1, out
    assert "max runtime of 1.0s reached" in out
    pid = int(pidfile.read_text())
    assert not Path(f"/proc/{pid}").exists(), "the command outlived the agent"


# -- 5. --no-watch -------------------------------------------------------------------


def test_no_watch_returns_once_converged(tmp_path: Path) -> None:
    j = Journal()
    model = make(j, ["a", "b"], [("a", "b")], b={"fail_times": 1, "meta": Meta(retry=1)})
    no_watch = settings(tmp_path, watch=False, converged_timeout=None, converged_exit=False)

    async def main() -> int:
        return await asyncio.wait_for(Engine(no_watch).run(model), 10)

    assert asyncio.run(main()) == 0
    assert j.runs("b") == 2, "a retry still runs before the exit"


def test_no_watch_cli_exits_with_the_status(tmp_path: Path) -> None:
    import subprocess
    import sys

    target = tmp_path / "x.txt"
    g = tmp_path / "g.yaml"
    g.write_text(
        f"graph: t\nresources:\n  file:\n  - name: x\n    path: {target}\n    content: hi\n"
    )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "evergraph.cli.main",
            "run",
            str(g),
            "--no-watch",
            "--state-dir",
            str(tmp_path / "s"),
        ],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert r.returncode == 0, r.stderr
    assert target.read_text() == "hi"
    assert "converged: 1 vertices clean" in r.stderr


# -- 6. ranges -------------------------------------------------------------------------


def _yaml(body: str) -> GraphModel:
    from evergraph.frontends.open import builtin_registry
    from evergraph.frontends.yaml import parse_yaml

    return parse_yaml("graph: g\nresources:\n" + body, "g.yaml", builtin_registry())


def test_limit_inf_is_the_documented_default() -> None:
    model = _yaml("  noop:\n  - name: n\n    meta: {limit: .inf}\n  - name: m\n")
    assert model.resources["noop[n]"].meta.limit == float("inf")
    assert model.resources["noop[m]"].meta == Meta()
    assert Meta().limit == float("inf")


BAD_META = {
    "limit-zero": ("limit: 0", "noop[n].meta.limit", ".inf for no limit"),
    "limit-negative": ("limit: -1", "noop[n].meta.limit", "between 1e-06"),
    "limit-nan": ("limit: .nan", "noop[n].meta.limit", "not nan"),
    "limit-tiny": ("limit: 1.0e-300", "noop[n].meta.limit", "between 1e-06"),
    "burst-negative": ("limit: 2, burst: -1", "noop[n].meta.burst", ">= 0"),
    "burst-missing": ("limit: 2", "noop[n].meta.burst", "burst >= 1"),
    "delay-negative": ("delay: -5", "noop[n].meta.delay", "between 0 and 31536000000 ms"),
    "delay-huge": ("delay: 100000000000000", "noop[n].meta.delay", "between 0 and"),
    "timeout-nan": ("timeout: .nan", "noop[n].meta.timeout", "between 0.001 and 31536000"),
    "timeout-inf": ("timeout: .inf", "noop[n].meta.timeout", "leave it out"),
    "timeout-zero": ("timeout: 0", "noop[n].meta.timeout", "not 0"),
    "timeout-tiny": ("timeout: 1.0e-300", "noop[n].meta.timeout", "between 0.001"),
    "poll-nan": ("poll: .nan", "noop[n].meta.poll", "< 0 (check once)"),
    "poll-inf": ("poll: .inf", "noop[n].meta.poll", "between 0.001 and 31536000"),
    "poll-minus-inf": ("poll: -.inf", "noop[n].meta.poll", "not -inf"),
    "poll-tiny": ("poll: 1.0e-300", "noop[n].meta.poll", "not 1e-300"),
}


@pytest.mark.parametrize("case", list(BAD_META))
def test_bad_meta_values_are_refused_with_the_range(case: str) -> None:
    meta, where, says = BAD_META[case]
    with pytest.raises(InputError) as e:
        _yaml(f"  noop:\n  - name: n\n    meta: {{{meta}}}\n")
    assert where in str(e.value), str(e.value)
    assert says.replace(" ms", " milliseconds") in str(e.value), str(e.value)


@pytest.mark.parametrize("interval", ["0", "-1", ".nan", ".inf", "1.0e-300"])
def test_timer_interval_range(interval: str) -> None:
    with pytest.raises(InputError, match=r"timer\[t\]\.interval: must be between 0\.001 and"):
        _yaml(f"  timer:\n  - name: t\n    interval: {interval}\n")


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--max-runtime", "nan"),
        ("--max-runtime", "inf"),
        ("--max-runtime", "-1"),
        ("--max-runtime", "1e-300"),
        ("--converged-timeout", "nan"),
        ("--converged-timeout", "-0.5"),
    ],
)
def test_bad_duration_flags_are_one_line_and_exit_2(tmp_path: Path, flag: str, value: str) -> None:
    from tests.conftest import run_cli

    g = tmp_path / "g.yaml"
    g.write_text("graph: g\nresources:\n  noop:\n  - name: n\n")
    r = run_cli("run", g, "--state-dir", tmp_path / "s", flag, value, timeout=20)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"evergraph: {flag}: must be between "), r.stderr
    assert not (tmp_path / "s").exists(), "refused before anything was created"


def test_settings_refuse_nonsense_durations(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="--max-runtime"):
        Settings(state_dir=tmp_path, max_runtime=float("nan"))
    with pytest.raises(InputError, match="--converged-timeout"):
        Settings(state_dir=tmp_path, converged_timeout=float("inf"))
    Settings(state_dir=tmp_path, converged_timeout=0, max_runtime=0.5)


# -- 7. two resources managing one thing ---------------------------------------------


FIGHTS = {
    "file-content": (
        "  file:\n  - name: a\n    path: /etc/x\n    content: one\n"
        "  - name: b\n    path: /etc/x\n    content: two\n",
        "file[b]",
        "file[a]",
        "file:/etc/x",
    ),
    "file-name-is-path": (
        "  file:\n  - name: /etc/x\n    content: one\n  - name: b\n    path: /etc//x\n",
        "file[b]",
        "file[/etc/x]",
        "file:/etc/x",
    ),
    "file-and-directory": (
        "  file:\n  - name: a\n    path: /srv/d\n  - name: b\n    path: /srv/d/\n",
        "file[b]",
        "file[a]",
        "file:/srv/d",
    ),
    "svc-unit": (
        "  svc:\n  - name: nginx\n    state: running\n"
        "  - name: nginx.service\n    state: stopped\n",
        "svc[nginx.service]",
        "svc[nginx]",
        "svc:system:nginx.service",
    ),
}


@pytest.mark.parametrize("case", list(FIGHTS))
def test_two_resources_managing_one_thing_are_a_load_error_naming_both(case: str) -> None:
    body, second, first, key = FIGHTS[case]
    with pytest.raises(InputError) as e:
        _yaml(body)
    text = str(e.value)
    assert text.startswith("g.yaml:"), text
    assert f"{second}: manages {key}, as {first} does" in text


def test_equal_resources_under_two_names_or_different_things_pass() -> None:
    model = _yaml(
        "  file:\n  - name: a\n    path: /etc/x\n    content: same\n"
        "  - name: b\n    path: /etc/x\n    content: same\n    meta: {noop: true}\n"
        "  - name: c\n    path: /etc/x.d/\n"
        "  svc:\n  - name: nginx\n  - name: nginx.socket\n  - name: other\n"
        "  - name: own\n    session: true\n"
    )
    assert len(model.resources) == 7


def test_check_cli_refuses_two_files_of_one_path(tmp_path: Path) -> None:
    from tests.conftest import run_cli

    target = tmp_path / "x"
    g = tmp_path / "g.yaml"
    g.write_text(
        "graph: g\nresources:\n  file:\n"
        f"  - name: a\n    path: {target}\n    content: one\n"
        f"  - name: b\n    path: {target}\n    content: two\n"
    )
    r = run_cli("check", g)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    assert f"{g}:7:" in r.stderr
    assert f"file[b]: manages file:{target}, as file[a] does" in r.stderr
