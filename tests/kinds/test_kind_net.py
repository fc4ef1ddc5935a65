"""net: the timeline for real, in a network namespace the test makes.

The agent runs under `unshare --net` with one interface made there (a dummy
where the kernel has the module, else one end of a veth pair): nothing of it
is seen outside. Drift is made "from outside" with `ip` and `sysctl` through
`nsenter` into the agent's network namespace.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import EVERGRAPH, wait_for
from tests.kit.kinds import refused
from tests.kit.namespaces import NsAgent, ns_once

NET_NS = ["--net"]
IFACE = "eg0"
#: the interface, made inside the namespace (no dummy module here: a veth pair then),
#: not forwarding to begin with (a new namespace copies the host's ip_forward, which
#: a container engine or libvirtd on the machine may have turned on)
MAKE_IFACE = (
    "echo 0 > /proc/sys/net/ipv4/ip_forward && "
    f"ip link add {IFACE} type dummy 2>/dev/null"
    f" || ip link add {IFACE} type veth peer name {IFACE}peer"
)
FORWARDING = f"/proc/sys/net/ipv4/conf/{IFACE}/forwarding"


def addrs(agent: NsAgent) -> set[str]:
    """The interface's addresses (without IPv6 link-local ones)."""
    out = json.loads(agent.ns("ip", "-j", "addr", "show", "dev", IFACE))
    return {
        f"{a['local']}/{a['prefixlen']}"
        for a in out[0].get("addr_info", [])
        if not a["local"].startswith("fe80:")
    }


def is_up(agent: NsAgent) -> bool:
    return "UP" in json.loads(agent.ns("ip", "-j", "link", "show", "dev", IFACE))[0]["flags"]


def gateways(agent: NsAgent) -> list[str]:
    routes = json.loads(agent.ns("ip", "-j", "route", "show", "default"))
    return [r.get("gateway", "") for r in routes if r.get("dev") == IFACE]


def forwarding(agent: NsAgent) -> str:
    return agent.ns("cat", FORWARDING).strip()


GRAPH = f"""graph: g
resources:
  net:
  - name: {IFACE}
    state: up
    addrs: [10.9.0.2/24, "fd00::2/64"]
    gateway: 10.9.0.1
    ip_forward: true
    meta: {{reverse: true}}
"""
WANT = {"10.9.0.2/24", "fd00::2/64"}


def test_timeline(tmp_path: Path, ns_agents: Callable[..., NsAgent]) -> None:
    g = tmp_path / "g.yaml"
    g.write_text(GRAPH)
    agent = ns_agents(g, tmp_path / "s", NET_NS, MAKE_IFACE, "-v")
    agent.wait_converged()
    wait_for(lambda: "net[eg0]: applied" in agent.log.read_text(), what="the log written")
    # applied
    assert is_up(agent)
    assert addrs(agent) == WANT
    assert gateways(agent) == ["10.9.0.1"]
    assert forwarding(agent) == "1"

    def repaired() -> bool:
        return (
            is_up(agent)
            and addrs(agent) == WANT
            and gateways(agent) == ["10.9.0.1"]
            and forwarding(agent) == "1"
        )

    # drift from outside, each seen on the netlink socket and repaired (the state is
    # the proof; the log line says which repair it was)
    for drift, what in [
        (f"ip link set {IFACE} down", "link set up"),  # (the kernel drops the routes too)
        (f"ip addr add 10.1.1.1/8 dev {IFACE}", "address 10.1.1.1/8 removed"),
        (f"ip addr del 10.9.0.2/24 dev {IFACE}", "address 10.9.0.2/24 added"),
        (f"ip route replace default via 10.9.0.254 dev {IFACE}", "default route via 10.9.0.1"),
        (f"ip route del default dev {IFACE}", "default route via 10.9.0.1"),
        (f"sysctl -qw net.ipv4.conf.{IFACE}.forwarding=0", "ip_forward set to 1"),
    ]:
        before = agent.log.read_text().count(what)
        agent.ns("sh", "-c", drift)
        wait_for(
            lambda what=what, before=before: agent.log.read_text().count(what) > before,
            what=f"repair of {drift}",
        )
        wait_for(repaired, what=f"all repaired after {drift}")
    # a check from outside finds it clean
    r = agent.ns_run(
        *EVERGRAPH, "run", str(g), "--state-dir", str(tmp_path / "s2"), "--noop", "--converged-exit"
    )
    assert r.returncode == 0, r.stderr
    assert "nothing would change or failed, 1 clean" in r.stderr
    # reversal: the resource leaves the graph; the link found down, bare and not forwarding
    g.write_text("graph: g\nresources:\n  noop:\n  - name: n\n")
    wait_for(lambda: not is_up(agent), what="the link down again")
    wait_for(lambda: addrs(agent) == set(), what="no addresses again")
    wait_for(lambda: forwarding(agent) == "0", what="no forwarding again")
    assert agent.stop() == 0


def test_a_missing_interface_is_a_clear_failure(tmp_path: Path) -> None:
    g = tmp_path / "g.yaml"
    g.write_text("graph: g\nresources:\n  net:\n  - {name: nosuch0, state: up}\n")
    r = ns_once(
        NET_NS,
        "true",
        *EVERGRAPH,
        *("run", str(g), "--state-dir", str(tmp_path / "s"), "--converged-exit"),
    )
    assert r.returncode == 1, r.stderr
    assert "net[nosuch0]: no network interface nosuch0" in r.stderr
    assert "Traceback" not in r.stderr


BAD_INPUT = [
    ("{name: eg0, state: sideways}", "net[eg0].state: Invalid enum value 'sideways'"),
    ("{name: waytoolonginterface, state: up}", "net[waytoolonginterface].name: "),
    ("{name: eg0, addrs: [10.9.0.2]}", "net[eg0].addrs: '10.9.0.2' has no prefix length"),
    ("{name: eg0, addrs: [10.9.0.300/24]}", "net[eg0].addrs: '10.9.0.300/24' is not an"),
    ("{name: eg0, gateway: nope}", "net[eg0].gateway: 'nope' is not an IP address"),
    ("{name: eg0, state: down, gateway: 10.0.0.1}", "net[eg0].gateway: a link kept down"),
    ("{name: eg0, ip_forward: maybe}", "net[eg0].ip_forward: expected bool | null, got str"),
]


@pytest.mark.parametrize(("item", "needle"), BAD_INPUT)
def test_bad_input_is_exit_2_and_changes_nothing(tmp_path: Path, item: str, needle: str) -> None:
    g = tmp_path / "g.yaml"
    g.write_text(f"graph: g\nresources:\n  net:\n  - {item}\n")
    # in process, as `evergraph check` loads it; one of them end to end: exit 2,
    # nothing changed
    if not refused(g, needle, f"{g}:4:", end_to_end=(item, needle) == BAD_INPUT[0]):
        return
    run = shlex.join(
        [*EVERGRAPH, "run", str(g), "--state-dir", str(tmp_path / "s"), "--converged-exit"]
    )
    r = ns_once(
        NET_NS,
        MAKE_IFACE,
        "sh",
        "-c",
        f"{run}; rc=$?; ip -o link show {IFACE}; ip -o addr show dev {IFACE}; exit $rc",
    )
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr
    assert ",UP" not in r.stdout  # still down,
    assert "inet" not in r.stdout  # and without addresses
