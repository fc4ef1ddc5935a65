"""The cluster benchmark, small (issue 15): five agents, a hub and a 3-member etcd on
loopback, each agent in its own mount namespace. Correctness only, no timings:
fan-out reaches everyone (through a change, a withdrawal and a dead etcd leader),
fan-in is complete, churn (kill -9, restart) leaves nothing stale or lost after the
member TTL, and one signed deploy reaches every agent."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench.cluster import run_cluster

pytestmark = pytest.mark.slow


def test_five_agents_on_three_etcd_members(shm: Path) -> None:
    out = run_cluster(5, shm, idle_s=0.5)
    assert out["ok"] == {
        "fanin_complete": True,
        "fanout_reached_all": True,
        "members_exact_after_churn": True,
        "exports_exact_after_churn": True,
        "fanin_after_churn": True,
        "fanout_survived_etcd_kill": True,
        "deploy_reached_all": True,
        "no_agent_died": True,
    }
