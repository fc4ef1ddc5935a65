"""The Python frontend: `def graph(g, world)`, re-run live when the World changes
under its reads or the module is saved; user-code errors as input errors."""

from __future__ import annotations

import asyncio
import re
import textwrap
from pathlib import Path

import pytest

from evergraph.world.sqlite import SQLiteKV
from tests.conftest import REPO, Agent, run_cli, wait_for

SITE = """
def graph(g, world):
    greeting = world.get("cfg/greeting", default="hello")
    with open({runs!r}, "a") as f:  # counts the runs of graph()
        f.write("run\\n")
    a = g.add("file", "greet", path={greet!r}, content=greeting + "\\n")
    b = g.add("file", "static", path={static!r}, content="same\\n")
    g.edge(a, b)
"""


def site(tmp_path: Path) -> tuple[Path, Path, Path, Path]:
    greet, static, runs = tmp_path / "out" / "greet", tmp_path / "out" / "static", tmp_path / "runs"
    mod = tmp_path / "site.py"
    mod.write_text(SITE.format(greet=str(greet), static=str(static), runs=str(runs)))
    return mod, greet, static, runs


def runs_of(p: Path) -> int:
    return p.read_text().count("run") if p.exists() else 0


def test_python_graph_converges_and_checks(tmp_path: Path) -> None:
    mod, greet, static, _runs = site(tmp_path)
    r = run_cli("run", mod, "--state-dir", tmp_path / "st", "--converged-exit")
    assert r.returncode == 0, r.stderr
    assert greet.read_text() == "hello\n"
    assert static.read_text() == "same\n"
    r = run_cli("check", mod)
    assert r.returncode == 0, r.stderr
    assert "2 resources (file: 2), 1 edges" in r.stdout
    r = run_cli("graph", mod, "--format", "json")
    assert '"file[greet]"' in r.stdout
    assert r.returncode == 0


def test_world_write_from_the_cli_rerenders_live(tmp_path: Path, agents) -> None:  # type: ignore[no-untyped-def]
    mod, greet, _static, runs = site(tmp_path)
    state = tmp_path / "st"
    a: Agent = agents(mod, state, "-v")
    a.wait_converged()
    assert greet.read_text() == "hello\n"
    r = run_cli("world", "put", "cfg/greeting", "bonjour", "--state-dir", state)
    assert r.returncode == 0, r.stderr
    wait_for(lambda: greet.read_text() == "bonjour\n", what="re-rendered file")
    a.wait_converged(2)
    wait_for(
        lambda: "greet]: applied" in ([*a.log.read_text().split("swapped"), ""])[1],
        what="the swap logged",
    )
    log = a.log.read_text()
    # the unchanged resource was neither re-applied nor restarted
    assert log.count("file[static]: applied") == 1, log
    assert "1 started, 1 stopped" in log, log
    # a write to a key graph() never read does not run it again
    before = runs_of(runs)
    assert run_cli("world", "put", "cfg/other", "x", "--state-dir", state).returncode == 0
    assert run_cli("world", "put", "cfg/greeting", "salut", "--state-dir", state).returncode == 0
    wait_for(lambda: greet.read_text() == "salut\n", what="second re-render")
    assert runs_of(runs) == before + 1


def test_a_burst_of_world_changes_costs_few_runs(tmp_path: Path, agents) -> None:  # type: ignore[no-untyped-def]
    mod, greet, _static, runs = site(tmp_path)
    state = tmp_path / "st"
    a: Agent = agents(mod, state, "-v")
    a.wait_converged()
    assert runs_of(runs) == 1

    async def burst() -> None:
        async with SQLiteKV(state / "world.sqlite") as kv:
            for i in range(200):
                await kv.put("cfg/greeting", f"v{i}".encode())

    asyncio.run(burst())
    wait_for(lambda: greet.read_text() == "v199\n", what="the last value rendered")
    a.wait_converged(2)
    # 200 writes, debounced: a handful of runs at most, never one per write
    assert runs_of(runs) <= 4, runs_of(runs)


def test_saving_the_module_swaps_and_a_later_error_keeps_the_graph(
    tmp_path: Path,
    agents,  # type: ignore[no-untyped-def]
) -> None:
    mod, greet, _static, _runs = site(tmp_path)
    a: Agent = agents(mod, tmp_path / "st", "-v")
    a.wait_converged()
    # an exception in graph() at a re-run: logged with the user's line, old graph kept
    mod.write_text(
        f"def graph(g, world):\n    g.add('file', 'x', path={str(tmp_path / 'x')!r})\n"
        "    raise ValueError('boom')\n"
    )
    wait_for(lambda: "ValueError: boom" in a.log.read_text(), what="the error logged")
    assert f"{mod}:3: ValueError: boom (the running graph is kept)" in a.log.read_text()
    assert not (tmp_path / "x").exists()  # nothing of the failed re-run was applied
    greet.write_text("drift\n")  # the old graph still runs: drift is repaired
    wait_for(lambda: greet.read_text() == "hello\n", what="drift repaired by the kept graph")
    mod.write_text("def graph(g, world)\n    pass\n")
    wait_for(lambda: "Python syntax error" in a.log.read_text(), what="syntax error logged")
    assert f"{mod}:1:" in a.log.read_text()
    new = tmp_path / "out" / "new"
    mod.write_text(f"def graph(g, world):\n    g.add('file', 'new', path={str(new)!r})\n")
    wait_for(new.exists, what="the fixed module's graph applied")
    assert "Traceback" not in a.log.read_text()
    assert a.proc.poll() is None


BAD = {
    "syntax": ("def graph(g, world)\n    pass\n", r"site\.py:1:\d+: Python syntax error"),
    "exception": (
        "def helper():\n    return {}['missing']\n\ndef graph(g, world):\n    helper()\n",
        r"site\.py:2: KeyError: 'missing'",
    ),
    "module-level": ("import json\nX = 1 / 0\n", r"site\.py:2: ZeroDivisionError"),
    "bad-param": (
        "def graph(g, world):\n    g.add('file', 'f', path='/tmp/f', mode=644)\n",
        r"site\.py:2: file\[f\]\.mode: expected str",
    ),
    "unknown-param": (
        "def graph(g, world):\n\n    g.add('file', 'f', path='/tmp/f', contnet='x')\n",
        r"site\.py:3: file\[f\]\.contnet: unknown parameter; did you mean 'content'\?",
    ),
    "invalid-value": (
        "def graph(g, world):\n    g.add('file', 'f', path='relative')\n",
        r"site\.py:2: file\[f\]\.path: ",
    ),
    "unknown-kind": (
        "def graph(g, world):\n    g.add('flie', 'f')\n",
        r"site\.py:2: unknown resource kind 'flie'",
    ),
    "bad-edge": (
        "def graph(g, world):\n    a = g.add('noop', 'a')\n    g.edge(a, 'noop[b]')\n",
        r"site\.py:3: edge names noop\[b\], which is not a resource",
    ),
    "cycle": (
        "def graph(g, world):\n    a = g.add('noop', 'a')\n    b = g.add('noop', 'b')\n"
        "    g.edge(a, b)\n    g.edge(b, a)\n",
        r"site\.py:\d: the graph has a cycle",
    ),
    "no-graph": ("def grpah(g, world):\n    pass\n", r"site\.py: the module defines no `def graph"),
    "sys-exit": (
        "import sys\n\ndef graph(g, world):\n    sys.exit(3)\n",
        r"site\.py:4: SystemExit: 3",
    ),
    "arity": ("def graph(g):\n    pass\n", r"site\.py:1: graph\(\) must take two arguments"),
    "duplicate": (
        "def graph(g, world):\n    g.add('noop', 'a')\n    g.add('print', 'p', msg='x')\n"
        "    g.add('print', 'p', msg='y')\n",
        r"site\.py:4: print\[p\] is declared twice with different parameters "
        r"\(first at .*site\.py:3\)",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_user_code_errors_are_input_errors(tmp_path: Path, case: str) -> None:
    text, pattern = BAD[case]
    out = tmp_path / "out"  # where the cases' files would go (never made)
    text = text.replace("'/tmp/", f"'{out}/")
    mod = tmp_path / "site.py"
    mod.write_text(text)
    state = tmp_path / "st"
    r = run_cli("run", mod, "--state-dir", state, "--converged-exit")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert re.search(pattern, r.stderr), r.stderr
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists()
    if case in ("syntax", "module-level", "no-graph", "arity"):
        assert not state.exists()  # refused before anything was set up
    r = run_cli("check", mod)
    assert r.returncode == 2, r.stderr
    assert re.search(pattern, r.stderr), r.stderr


def test_graph_builder_in_process() -> None:
    import evergraph

    g = evergraph.Graph("t")
    a = g.add("noop", "a")
    assert a.ident == "noop[a]"
    assert str(a) == "noop[a]"
    assert g.add("noop", "a") == a  # an equal duplicate merges
    with pytest.raises(evergraph.InputError) as e:
        g.edge(a, 42)  # type: ignore[arg-type]
    assert "test_python_frontend.py:" in e.value.where
    with pytest.raises(evergraph.InputError, match="send= and recv="):
        g.edge(a, a, send="output")
    with pytest.raises(evergraph.InputError, match="give the name once"):
        g.add("noop", "b", name="c")
    assert list(g.model().resources) == ["noop[a]"]
    world = evergraph.World()  # no World: defaults
    assert world.get("k", default="d") == "d"
    assert world.collect() == []
    assert world.members() == []


def test_embedding_from_a_plain_script(tmp_path: Path) -> None:
    out = tmp_path / "out" / "embedded.conf"
    script = tmp_path / "deploy_it.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys
        import evergraph

        g = evergraph.Graph("embedded")
        conf = g.add("file", "conf", path={str(out)!r}, content="from a script\\n")
        note = g.add("exec", "note", cmd="/bin/sh", args=["-c", "echo ran > {tmp_path}/ran"],
                     refresh_only=True)
        g.edge(conf, note, notify=True)
        status = evergraph.run(g, state_dir={str(tmp_path / "st")!r}, converged_exit=True)
        bad = evergraph.run({str(tmp_path / "nope.yaml")!r}, state_dir={str(tmp_path / "st")!r})
        sys.exit(status * 10 + bad)
        """)
    )
    import subprocess
    import sys

    r = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)  # 0 for the graph, 2 for the missing file
    assert out.read_text() == "from a script\n"
    assert (tmp_path / "ran").read_text() == "ran\n"
    assert "nope.yaml: no such file" in r.stderr


def test_public_api_is_what_all_lists() -> None:
    import evergraph

    assert evergraph.__all__ == [
        "Collected",
        "Graph",
        "InputError",
        "Member",
        "Meta",
        "Ref",
        "Resource",
        "World",
        "WorldOptions",
        "__version__",
        "doc",
        "register",
        "run",
    ]
    for name in evergraph.__all__:
        assert getattr(evergraph, name) is not None, name
    assert dir(evergraph) == sorted(evergraph.__all__)
    with pytest.raises(AttributeError):
        _ = evergraph.nothing_here  # type: ignore[attr-defined]
    assert (Path(evergraph.__file__).parent / "py.typed").exists()
    assert evergraph.run.__doc__
    assert evergraph.Graph.__doc__


EXAMPLES = REPO / "examples"


def test_every_python_example_is_run_here() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == ["app.py", "motd.py", "web.py"]


@pytest.mark.slow
def test_example_motd_follows_members_and_greeting(
    tmp_path: Path,
    agents,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    db = tmp_path / "world.sqlite"
    roots = {h: tmp_path / h for h in ("h1", "h2")}
    started = {}
    for h, root in roots.items():
        monkeypatch.setenv("EVERGRAPH_EXAMPLE_ROOT", str(root))
        started[h] = agents(
            EXAMPLES / "motd.py", tmp_path / f"st-{h}", "--hostname", h, "--world-db", str(db)
        )
    motd = roots["h1"] / "motd"
    wait_for(lambda: motd.exists() and "  - h1\n  - h2\n" in motd.read_text(), what="both members")
    assert motd.read_text().startswith("Welcome to h1.\n2 host(s)")
    assert run_cli("world", "put", "motd/greeting", "Hi", "--world-db", db).returncode == 0
    wait_for(lambda: (roots["h2"] / "motd").read_text().startswith("Hi to h2."), what="greeting")
    assert started["h2"].stop() == 0  # a clean stop withdraws the member record at once
    wait_for(lambda: "1 host(s)" in motd.read_text(), what="h2 gone from h1's motd")
    assert "h2" not in motd.read_text()


def test_example_web_tier_collects_app_exports(
    tmp_path: Path,
    agents,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    db = tmp_path / "world.sqlite"
    root = tmp_path / "out"
    monkeypatch.setenv("EVERGRAPH_EXAMPLE_ROOT", str(root))
    common = ("--world-db", str(db))
    web: Agent = agents(EXAMPLES / "web.py", tmp_path / "sw", "--hostname", "web1", *common)
    web.wait_converged()
    conf = root / "upstreams.conf"
    assert conf.read_text() == "# no app hosts yet\n"
    agents(EXAMPLES / "app.py", tmp_path / "s1", "--hostname", "app1", *common)
    agents(EXAMPLES / "app.py", tmp_path / "s2", "--hostname", "app2", *common)
    both = "upstream app {\n    server app1:8080;\n    server app2:8080;\n}\n"
    wait_for(lambda: conf.read_text() == both, what="both app hosts collected")
    assert (root / "upstreams.d" / "app2.conf").read_text() == "server app2:8080;\n"
    assert run_cli("world", "put", "app/app1/port", "9000", *common).returncode == 0
    wait_for(lambda: "server app1:9000;" in conf.read_text(), what="the port change collected")
    assert (root / "app-app1.conf").read_text() == "port=9000\n"
    wait_for(lambda: (root / "reloads").read_text().count("reloaded") >= 3, what="reloads")


def test_embedding_a_custom_kind(tmp_path: Path) -> None:
    """A script defines its own kind with Resource/register/doc and runs it."""
    import subprocess
    import sys

    mark = tmp_path / "marked"
    script = tmp_path / "custom.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, sys
        from typing import Annotated
        import evergraph

        @evergraph.register("marker")
        class Marker(evergraph.Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
            \"\"\"Writes its name into a file once.\"\"\"
            path: Annotated[str, evergraph.doc("the file")] = ""

            def validate(self):
                if not self.path.startswith("/"):
                    raise self.bad("path", "must be absolute")

            async def check_apply(self, apply):
                if os.path.exists(self.path):
                    return True
                if apply:
                    with open(self.path, "w") as f:
                        f.write(self.name)
                return False

        state = {str(tmp_path / "st")!r}
        g = evergraph.Graph()
        g.add("marker", "hello", path={str(mark)!r})
        first = evergraph.run(g, state_dir=state, converged_exit=True, world=None)
        bad = evergraph.Graph()
        try:
            bad.add("marker", "x", path="relative")
        except evergraph.InputError as e:
            print("refused:", e)
        sys.exit(first)
        """)
    )
    r = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert mark.read_text() == "hello"
    assert f"refused: {script}:29: marker[x].path: must be absolute" in r.stdout


def test_a_graph_that_never_returns_does_not_block_stopping(tmp_path: Path, agents) -> None:  # type: ignore[no-untyped-def]
    started = tmp_path / "started"
    mod = tmp_path / "site.py"
    mod.write_text(
        "import time\n\ndef graph(g, world):\n"
        f"    open({str(started)!r}, 'w').close()\n"
        "    while True:\n        time.sleep(0.05)\n"
    )
    a: Agent = agents(mod, tmp_path / "st")
    wait_for(started.exists, what="graph() running")
    assert a.stop() == 0  # SIGTERM; stop() would SIGKILL (-9) after 10 s
