"""End-to-end: the real CLI converging real files and commands, watching, swapping live."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import time
from pathlib import Path

from tests.conftest import REPO, Agent, run_cli, wait_for


def write_graph(path: Path, body: str) -> None:
    path.write_text("graph: t\nresources:\n" + body)


def write_notify_graph(path: Path, conf: Path, reload_cmd: str) -> None:
    """file[conf] (content v1) notifies exec[reload], which runs only when refreshed."""
    write_graph(
        path,
        f"""  file:
  - name: conf
    path: {conf}
    content: "v1\\n"
  exec:
  - name: reload
    shell: /bin/sh
    refresh_only: true
    cmd: {json.dumps(reload_cmd)}
edges:
- {{from: {{kind: file, name: conf}}, to: {{kind: exec, name: reload}}, notify: true}}
""",
    )


def test_second_run_changes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "root"
    g = tmp_path / "g.yaml"
    write_graph(
        g,
        f"""  file:
  - name: d
    path: {root}/sub/
    mode: "0750"
  - name: f
    path: {root}/sub/f.txt
    content: "one\\n"
    mode: "u=rw,g=r,o="
  exec:
  - name: once
    cmd: "touch {root}/ran"
    creates: {root}/ran
edges:
- {{from: {{kind: file, name: d}}, to: {{kind: exec, name: once}}}}
""",
    )
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit")
    assert r.returncode == 0, r.stderr
    assert (root / "sub/f.txt").read_text() == "one\n"
    assert stat.S_IMODE((root / "sub/f.txt").stat().st_mode) == 0o640
    assert stat.S_IMODE((root / "sub").stat().st_mode) == 0o750
    assert (root / "ran").exists()
    before = {p: p.stat().st_mtime_ns for p in root.rglob("*")}
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit")
    assert r.returncode == 0, r.stderr
    assert "applied" not in r.stderr, r.stderr
    assert "converged: 3 vertices clean, 0 changed" in r.stderr
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*")} == before


def test_noop_reports_and_changes_nothing(tmp_path: Path) -> None:
    target = tmp_path / "x.txt"
    g = tmp_path / "g.yaml"
    write_graph(g, f"  file:\n  - name: x\n    path: {target}\n    content: hi\n")
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit", "--noop")
    assert r.returncode == 3, r.stderr  # something would change
    assert "file[x]: would change (noop)" in r.stderr
    assert not target.exists()


def test_failed_command_exits_1_and_holds_children(tmp_path: Path) -> None:
    g = tmp_path / "g.yaml"
    child = tmp_path / "child.txt"
    write_graph(
        g,
        f"""  exec:
  - name: bad
    cmd: "sh -c 'echo broken >&2; exit 3'"
  file:
  - name: child
    path: {child}
edges:
- {{from: {{kind: exec, name: bad}}, to: {{kind: file, name: child}}}}
""",
    )
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit")
    assert r.returncode == 1
    assert "exec[bad]: cmd exited with status 3: broken" in r.stderr
    assert not child.exists()


def test_running_agent_repairs_drift(tmp_path: Path, agents) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "managed" / "app.conf"
    g = tmp_path / "g.yaml"
    write_graph(
        g,
        f'  file:\n  - name: conf\n    path: {f}\n    content: "port=80\\n"\n    mode: "0640"\n',
    )
    agent: Agent = agents(g, tmp_path / "s")
    agent.wait_converged()
    assert f.read_text() == "port=80\n"

    def repaired() -> bool:
        try:
            st = f.stat()
            return f.read_text() == "port=80\n" and stat.S_IMODE(st.st_mode) == 0o640
        except FileNotFoundError:
            return False

    # content modified in place
    with open(f, "a") as fh:
        fh.write("evil=1\n")
    wait_for(repaired, what="content repaired")
    # mode changed
    os.chmod(f, 0o666)
    wait_for(repaired, what="mode repaired")
    # deleted
    f.unlink()
    wait_for(repaired, what="file recreated")
    # replaced by rename (how editors and config tools save)
    tmp = f.with_name("other")
    tmp.write_text("port=8080\n")
    os.rename(tmp, f)
    wait_for(repaired, what="renamed-over file repaired")
    # the whole parent directory moved away (the agent races us if we delete
    # file by file, so take the directory in one step)
    os.rename(f.parent, tmp_path / "gone")
    wait_for(repaired, what="directory and file recreated")
    assert agent.stop() == 0


def test_live_swap_keeps_unchanged_vertices_untouched(tmp_path: Path, agents) -> None:  # type: ignore[no-untyped-def]
    root = tmp_path / "root"
    count = tmp_path / "count"
    g = tmp_path / "g.yaml"

    def graph(extra: str, b_content: str) -> str:
        return f"""  file:
  - name: a
    path: {root}/a.txt
    content: "a\\n"
  - name: b
    path: {root}/b.txt
    content: "{b_content}"
{extra}  exec:
  - name: counter
    cmd: "sh -c 'echo ran >> {count}'"
"""

    write_graph(g, graph("", "b1\\n"))
    agent: Agent = agents(g, tmp_path / "s")
    agent.wait_converged()
    a_mtime = (root / "a.txt").stat().st_mtime_ns
    assert count.read_text() == "ran\n"

    # Save by rename, as editors do: one resource changes, one is added.
    new = tmp_path / "g.yaml.tmp"
    new.write_text(
        "graph: t\nresources:\n"
        + graph(f'  - name: c\n    path: {root}/c.txt\n    content: "c\\n"\n', "b2\\n")
    )
    os.rename(new, g)
    wait_for(lambda: (root / "c.txt").exists(), what="new vertex applied")
    wait_for(lambda: (root / "b.txt").read_text() == "b2\n", what="changed vertex applied")
    agent.wait_converged(count=2)
    assert (root / "a.txt").stat().st_mtime_ns == a_mtime, "unchanged file was rewritten"
    assert count.read_text() == "ran\n", "unchanged exec ran again"

    # Remove a resource by writing in place: it stops being managed.
    write_graph(
        g,
        graph("", "b2\\n").replace(
            f'  - name: a\n    path: {root}/a.txt\n    content: "a\\n"\n', ""
        ),
    )
    agent.wait_converged(count=3)
    (root / "a.txt").write_text("free now\n")
    (root / "b.txt").write_text("drift\n")
    wait_for(lambda: (root / "b.txt").read_text() == "b2\n", what="b still managed")
    assert (root / "a.txt").read_text() == "free now\n"

    # A broken save is rejected and the old graph keeps running.
    g.write_text("graph: t\nresources: [oops\n")
    wait_for(lambda: "the running graph is kept" in agent.log.read_text(), what="error logged")
    (root / "b.txt").write_text("drift again\n")
    wait_for(lambda: (root / "b.txt").read_text() == "b2\n", what="old graph still repairs")
    assert agent.stop() == 0


def test_watchcmd_lines_are_events(tmp_path: Path, agents) -> None:  # type: ignore[no-untyped-def]
    fifo_dir = tmp_path / "w"
    fifo_dir.mkdir()
    trigger = fifo_dir / "trigger"
    trigger.write_text("")
    out = tmp_path / "runs"
    g = tmp_path / "g.yaml"
    write_graph(
        g,
        f"""  exec:
  - name: react
    shell: /bin/sh
    cmd: "echo run >> {out}"
    watchcmd: "tail -n0 -F {trigger} 2>/dev/null"
""",
    )
    agent: Agent = agents(g, tmp_path / "s")
    agent.wait_converged()
    assert out.read_text() == "run\n"
    with open(trigger, "a") as fh:
        fh.write("go\n")
    wait_for(lambda: out.read_text().count("run") == 2, what="second run after a watch line")
    assert agent.stop() == 0


def test_sigterm_on_idle_agent_stops_promptly(tmp_path: Path, agents) -> None:  # type: ignore[no-untyped-def]
    g = tmp_path / "g.yaml"
    write_graph(g, f"  file:\n  - name: x\n    path: {tmp_path}/x\n")
    agent: Agent = agents(g, tmp_path / "s")
    agent.wait_converged()
    t0 = time.monotonic()
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(10) == 0
    # Reported, not asserted as a bound: the benchmark owns timing claims.
    print(f"idle shutdown took {time.monotonic() - t0:.3f}s")


def test_second_signal_cancels_a_running_command(tmp_path: Path, agents) -> None:  # type: ignore[no-untyped-def]
    pidfile = tmp_path / "child.pid"
    g = tmp_path / "g.yaml"
    write_graph(
        g,
        f"""  exec:
  - name: long
    shell: /bin/sh
    cmd: "echo $$ > {pidfile}; exec sleep 600"
""",
    )
    agent: Agent = agents(g, tmp_path / "s")
    wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), what="command started")
    child = int(pidfile.read_text())
    agent.proc.send_signal(signal.SIGINT)
    # graceful: the command is still running
    try:
        agent.proc.wait(0.3)
        raise AssertionError("agent exited on the first signal while an apply ran")
    except subprocess.TimeoutExpired:
        pass
    agent.proc.send_signal(signal.SIGINT)
    assert agent.proc.wait(10) == 1
    wait_for(lambda: not _alive(child), what="command killed")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie waiting for its reaper counts as gone
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_every_example_runs_twice_without_change(tmp_path: Path) -> None:
    examples = sorted((REPO / "examples").glob("*.yaml"))
    assert examples
    for ex in examples:
        state = tmp_path / ex.stem
        r = run_cli("run", ex, "--state-dir", state, "--converged-exit")
        assert r.returncode == 0, f"{ex}: {r.stderr}"
        r = run_cli("run", ex, "--state-dir", state, "--converged-exit")
        assert r.returncode == 0, f"{ex}: {r.stderr}"
        assert ": applied" not in r.stderr, r.stderr


def test_refresh_survives_kill_9_and_is_delivered_once(tmp_path: Path, agents) -> None:  # type: ignore[no-untyped-def]
    conf = tmp_path / "app.conf"
    log = tmp_path / "reload.log"
    release = tmp_path / "release"
    pidfile = tmp_path / "reload.pid"
    g = tmp_path / "g.yaml"
    write_notify_graph(
        g,
        conf,
        f"echo $$ > {pidfile}; echo start >> {log};"
        f" while [ ! -f {release} ]; do sleep 0.02; done; echo done >> {log}",
    )
    state = tmp_path / "s"
    first: Agent = agents(g, state)
    wait_for(lambda: log.exists() and "start" in log.read_text(), what="reload started")
    # Crash between the change of conf and the end of the reload it owes.
    os.kill(first.proc.pid, signal.SIGKILL)
    first.proc.wait()
    pid = int(pidfile.read_text())
    os.killpg(pid, signal.SIGKILL)  # the orphaned command (its own process group)
    assert conf.read_text() == "v1\n"
    assert (state / "vertices/exec/reload/refresh").exists()

    release.write_text("")
    second: Agent = agents(g, state)
    second.wait_converged()
    assert log.read_text() == "start\nstart\ndone\n", "the owed refresh ran once on restart"
    assert not (state / "vertices/exec/reload/refresh").exists()
    assert second.stop() == 0

    # Nothing owed any more: a third start runs nothing.
    r = run_cli("run", g, "--state-dir", state, "--converged-exit")
    assert r.returncode == 0, r.stderr
    assert log.read_text() == "start\nstart\ndone\n"


def test_notify_refreshes_only_when_the_parent_changed(tmp_path: Path, agents) -> None:  # type: ignore[no-untyped-def]
    conf = tmp_path / "app.conf"
    log = tmp_path / "reload.log"
    g = tmp_path / "g.yaml"
    write_notify_graph(g, conf, f"echo reload >> {log}")
    agent: Agent = agents(g, tmp_path / "s")
    agent.wait_converged()
    assert log.read_text() == "reload\n"
    conf.write_text("drift\n")  # the agent repairs it, so reload is owed again
    wait_for(lambda: log.read_text() == "reload\nreload\n", what="second reload")
    assert agent.stop() == 0
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit")
    assert r.returncode == 0
    assert log.read_text() == "reload\nreload\n", "a clean conf owes no reload"


def test_reverse_restores_prior_state_on_removal_and_across_restart(
    tmp_path: Path,
    agents,  # type: ignore[no-untyped-def]
) -> None:
    existing = tmp_path / "existing.conf"
    existing.write_text("original\n")
    os.chmod(existing, 0o640)
    fresh = tmp_path / "fresh.conf"
    g = tmp_path / "g.yaml"
    state = tmp_path / "s"

    def graph(with_existing: bool, with_fresh: bool) -> str:
        body = "  noop:\n  - name: keep\n  file:\n"
        if with_existing:
            body += (
                f'  - name: existing\n    path: {existing}\n    content: "managed\\n"\n'
                '    mode: "0600"\n    meta: {reverse: true}\n'
            )
        if with_fresh:
            body += (
                f"  - name: fresh\n    path: {fresh}\n    content: new\n"
                "    meta: {reverse: true}\n"
            )
        return "graph: rev\nresources:\n" + body

    g.write_text(graph(True, True))
    agent: Agent = agents(g, state)
    agent.wait_converged()
    assert existing.read_text() == "managed\n"
    assert fresh.read_text() == "new"
    # Removed from the running graph: the prior state comes back.
    g.write_text(graph(False, True))
    wait_for(lambda: existing.read_text() == "original\n", what="content restored")
    assert stat.S_IMODE(existing.stat().st_mode) == 0o640
    assert agent.stop() == 0
    # Removed while the agent was down: reversed at the next start.
    g.write_text(graph(False, False))
    r = run_cli("run", g, "--state-dir", state, "--converged-exit")
    assert r.returncode == 0, r.stderr
    assert not fresh.exists(), "a file that did not exist before is removed again"
    assert "file[fresh]: left the graph: reversed" in r.stderr
    assert not list(state.rglob("reversal.json"))


def test_reverse_on_a_kind_that_cannot_be_reversed_is_a_load_error(tmp_path: Path) -> None:
    g = tmp_path / "g.yaml"
    g.write_text(
        "graph: r\nresources:\n  exec:\n  - name: e\n    cmd: 'true'\n    meta: {reverse: true}\n"
    )
    r = run_cli("check", g)
    assert r.returncode == 2
    assert "exec[e].meta.reverse: exec resources cannot be reversed" in r.stderr
