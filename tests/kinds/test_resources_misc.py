"""timer, and the generated reference docs."""

from __future__ import annotations

from pathlib import Path

from evergraph.testing.kinds import graph_error
from tests.conftest import REPO, Agent, run_cli, wait_for


def test_timer_notifies_on_every_tick(tmp_path: Path, agents) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "ticks"
    g = tmp_path / "g.yaml"
    g.write_text(
        f"""graph: t
resources:
  timer:
  - {{name: every, interval: 0.05}}
  exec:
  - {{name: tick, shell: /bin/sh, cmd: "echo tick >> {out}", refresh_only: true}}
edges:
- {{from: {{kind: timer, name: every}}, to: {{kind: exec, name: tick}}, notify: true}}
"""
    )
    agent: Agent = agents(g, tmp_path / "s")
    wait_for(lambda: out.exists() and out.read_text().count("tick") >= 3, what="three ticks")
    assert agent.stop() == 0


def test_timer_needs_a_positive_interval(tmp_path: Path) -> None:
    g = tmp_path / "g.yaml"
    g.write_text("graph: t\nresources:\n  timer:\n  - name: never\n    interval: 0\n")
    err = graph_error(g)  # as `evergraph check` loads it, in process
    assert f"{g}:5:" in err
    assert "timer[never].interval: must be between 0.001 and 31536000 seconds" in err


def test_reference_docs_are_generated_and_current() -> None:
    r = run_cli("docs", "resources")
    assert r.returncode == 0, r.stderr
    for kind in ("## exec", "## file", "## noop", "## print (alias: msg)", "## timer", "## meta"):
        assert kind in r.stdout
    assert "| `content` | str \\| None | `None` | the whole content" in r.stdout
    committed = (REPO / "docs" / "resources.md").read_text()
    assert committed == r.stdout, (
        "docs/resources.md is stale: run `evergraph docs resources > docs/resources.md`"
    )
