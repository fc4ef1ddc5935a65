"""What the tests of real agents share: graph files saved as editors save them,
conditions to wait on, and `ExportPair`, two agents where one exports a file to
the other."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

from tests.conftest import Agent, wait_for

AgentFactory = Callable[..., Agent]


def save(path: Path, text: str) -> None:
    """Save as editors do: a new file renamed over the old one (a reader sees the
    old text or the new, never half of it)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def file_graph(name: str, target: Path, content: str, meta: str = "") -> str:
    """Graph `name`: one file `target` holding `content` (with `meta`, if any)."""
    return (
        f"graph: {name}\nresources:\n  file:\n  - name: {target}\n"
        f"    content: {json.dumps(content)}\n" + (f"    meta: {meta}\n" if meta else "")
    )


def error_lines(text: str) -> list[str]:
    """The non-blank lines of `text`."""
    return [ln for ln in text.splitlines() if ln.strip()]


def holds(path: Path, text: str) -> Callable[[], bool]:
    """A condition: `path` holds `text`."""
    return lambda: path.exists() and path.read_text() == text


def exited(agent: Agent) -> bool:
    """Whether the agent's process has ended."""
    return agent.proc.poll() is not None


def noop_graph(tmp_path: Path) -> Path:
    """`tmp_path/g.yaml`: graph `m`, one noop resource."""
    g = tmp_path / "g.yaml"
    g.write_text("graph: m\nresources:\n  noop:\n  - name: m\n")
    return g


class ExportPair:
    """Agent A exports a file to B (sealed, hidden on A); B collects it."""

    def __init__(self, tmp_path: Path, agents: AgentFactory, world: tuple[str, ...]) -> None:
        self.agents, self.world = agents, world
        self.target = tmp_path / "on-b" / "from-a.conf"
        self.ga, gb = tmp_path / "a.yaml", tmp_path / "b.yaml"
        self.key = f"exported/hostb/hosta/file/{quote(str(self.target), safe='')}"
        self.state_a = tmp_path / "sa"
        self.export("v1\n")
        gb.write_text(
            "graph: b\nresources:\n  noop:\n  - name: b\ncollect:\n"
            "- {kind: file, filter: {host: hosta}}\n"
        )
        self.b = agents(gb, tmp_path / "sb", "--hostname", "hostb", *world)
        self.b.wait_converged()  # B's keys are in the World before A seals to them
        self.a = self.start_a()
        self.wait_content("v1\n")
        # B's log is flushed every 0.1 s: count its swaps only once the first is there
        wait_for(lambda: self.b_swaps() >= 1, what="B's first swap in its log")

    def export(self, content: str) -> None:
        save(self.ga, file_graph("a", self.target, content, "{export: [hostb], hidden: true}"))

    def start_a(self) -> Agent:
        with contextlib.suppress(FileNotFoundError):
            (self.state_a / "converged.status").unlink()
        a = self.agents(self.ga, self.state_a, "--hostname", "hosta", *self.world)
        a.wait_converged()
        return a

    def wait_content(self, content: str, timeout: float = 15) -> None:
        wait_for(holds(self.target, content), timeout=timeout, what=f"B applied {content!r}")

    def b_swaps(self) -> int:
        return self.b.log.read_text().count("collected exports changed")
