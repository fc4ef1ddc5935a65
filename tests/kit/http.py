"""What the tests of the agent's HTTP API share: where it listens."""

from __future__ import annotations

import re

from tests.conftest import Agent, wait_for


def api_url(agent: Agent) -> str:
    """The agent's HTTP API address (`http://HOST:PORT`), from its log (text or JSON)."""
    found: list[str] = []

    def listening() -> bool:
        found[:] = re.findall(r"HTTP API on (http://[^\s\"]+)", agent.log.read_text())
        return bool(found)

    wait_for(listening, what="the HTTP API to listen")
    return found[0]
