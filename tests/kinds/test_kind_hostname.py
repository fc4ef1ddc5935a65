"""hostname: the timeline for real, in a UTS and mount namespace the test makes.

The agent runs under `unshare --uts --mount` with an overlay over /etc (its
writes land in the test's tmp dir), so the host's hostname and /etc never
change; drift is made "from outside" with `nsenter` into the agent's
namespaces. Once with the files (no hostnamed: this machine runs no systemd),
once through a real systemd-hostnamed, bus-activated by a private dbus-daemon.

`NsAgent`, `ns_agents` and `ns_once` (tests/kit/namespaces.py) are shared with
the other kinds' namespace tests.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import EVERGRAPH, wait_for
from tests.kit.kinds import refused
from tests.kit.namespaces import NsAgent, ns_once, overlay_etc

HOSTNAMED = Path("/lib/systemd/systemd-hostnamed")


# -- hostname ------------------------------------------------------------------------

UTS_MOUNT = ["--uts", "--mount", "--propagation", "private"]


def no_bus(tmp_path: Path) -> dict[str, str]:
    """The environment of an agent that finds no system bus (so no hostnamed)."""
    return dict(os.environ, DBUS_SYSTEM_BUS_ADDRESS=f"unix:path={tmp_path / 'no-bus'}")


PRETTY = 'Evergraph\'s "Test" Box'
GRAPH = f"""graph: g
resources:
  hostname:
  - name: h
    static_hostname: eg-static
    transient_hostname: eg-trans
    pretty_hostname: {json.dumps(PRETTY)}
    meta: {{reverse: true}}
"""


def host_state() -> tuple[str, bytes | None, bytes | None]:
    def read(p: str) -> bytes | None:
        try:
            return Path(p).read_bytes()
        except FileNotFoundError:
            return None

    return socket.gethostname(), read("/etc/hostname"), read("/etc/machine-info")


@pytest.fixture
def host_untouched() -> Iterator[None]:
    before = host_state()
    yield
    assert host_state() == before, "the host's hostname or /etc changed"


def test_timeline_with_the_files(
    tmp_path: Path, ns_agents: Callable[..., NsAgent], host_untouched: None
) -> None:
    host_name, host_file, _ = host_state()
    g = tmp_path / "g.yaml"
    g.write_text(GRAPH)
    setup, upper = overlay_etc(tmp_path)
    agent = ns_agents(g, tmp_path / "s", UTS_MOUNT, setup, "-v", env=no_bus(tmp_path))
    agent.wait_converged()
    # applied
    assert agent.ns("cat", "/etc/hostname") == "eg-static\n"
    assert agent.ns("hostname").strip() == "eg-trans"
    assert agent.ns("cat", "/etc/machine-info") == (
        'PRETTY_HOSTNAME="Evergraph\'s \\"Test\\" Box"\n'
    )
    assert (upper / "hostname").read_text() == "eg-static\n"  # where the writes land
    # drift of each name from outside: seen (inotify; the kernel's notice) and repaired
    agent.ns("sh", "-c", "echo drifted > /etc/hostname")
    wait_for(lambda: agent.ns("cat", "/etc/hostname") == "eg-static\n", what="static repaired")
    agent.ns("hostname", "drifted")
    wait_for(lambda: agent.ns("hostname").strip() == "eg-trans", what="transient repaired")
    # written whole (then renamed): a check between a shell's truncation and its write
    # would read an empty file, rightly keep nothing of it, and the CHASSIS line expected
    # below would be lost (seen under load)
    agent.ns(
        "sh",
        "-c",
        "printf 'CHASSIS=vm\\nPRETTY_HOSTNAME=other\\n' > /etc/.mi.new"
        " && mv /etc/.mi.new /etc/machine-info",
    )
    want = 'CHASSIS=vm\nPRETTY_HOSTNAME="Evergraph\'s \\"Test\\" Box"\n'
    wait_for(lambda: agent.ns("cat", "/etc/machine-info") == want, what="pretty repaired")
    # a check from outside finds it clean (noop: exit 3 if anything would change)
    r = agent.ns_run(
        *EVERGRAPH, "run", str(g), "--state-dir", str(tmp_path / "s2"), "--noop", "--converged-exit"
    )
    assert r.returncode == 0, r.stderr
    assert "nothing would change or failed, 1 clean" in r.stderr
    log = agent.log.read_text()
    assert log.count("hostname[h]: static hostname set to eg-static") == 2
    assert log.count("hostname[h]: transient hostname set to eg-trans") == 2
    assert log.count("hostname[h]: pretty hostname set to") == 2
    # reversal: the resource leaves the graph, the names found before come back
    g.write_text("graph: g\nresources:\n  noop:\n  - name: n\n")
    want_file = read_static_of(host_file)
    wait_for(lambda: agent.ns("hostname").strip() == host_name, what="transient reversed")
    wait_for(
        lambda: read_static_of(agent.ns("cat", "/etc/hostname").encode()) == want_file,
        what="static reversed",
    )
    assert agent.stop() == 0


def read_static_of(data: bytes | None) -> str:
    from evergraph.resources.hostname import read_static

    return read_static((data or b"").decode())


@pytest.mark.skipif(
    not HOSTNAMED.exists() or not shutil.which("dbus-daemon"),
    reason="needs systemd-hostnamed and dbus-daemon",
)
def test_timeline_through_hostnamed(
    tmp_path: Path, ns_agents: Callable[..., NsAgent], host_untouched: None
) -> None:
    """A private bus that activates the real systemd-hostnamed (no systemd needed)."""
    services = tmp_path / "services"
    services.mkdir()
    (services / "org.freedesktop.hostname1.service").write_text(
        f"[D-BUS Service]\nName=org.freedesktop.hostname1\nExec={HOSTNAMED}\n"
    )
    bus = tmp_path / "bus"
    conf = tmp_path / "bus.conf"
    conf.write_text(
        '<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"\n'
        ' "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">\n'
        f"<busconfig><listen>unix:path={bus}</listen><servicedir>{services}</servicedir>"
        '<policy context="default"><allow send_destination="*"/><allow own="*"/>'
        '<allow receive_sender="*"/><allow user="*"/>'
        "</policy></busconfig>\n"
    )
    g = tmp_path / "g.yaml"
    g.write_text(GRAPH)
    setup, upper = overlay_etc(tmp_path)
    hostnamed_log = tmp_path / "bus.log"
    # the bus (and what it activates) lives in the agent's PID namespace: gone with it
    setup += f"\ndbus-daemon --config-file={conf} --nofork --nopidfile >{hostnamed_log} 2>&1 &"
    setup += f"\nuntil [ -S {bus} ]; do sleep 0.01; done"  # (the bus is up before the agent)
    env = dict(os.environ, DBUS_SYSTEM_BUS_ADDRESS=f"unix:path={bus}")
    flags = [*UTS_MOUNT, "--pid", "--mount-proc"]
    agent = ns_agents(g, tmp_path / "s", flags, setup, "-v", env=env)
    agent.wait_converged()
    wait_for(
        lambda: "hostname[h]: through systemd-hostnamed" in agent.log.read_text(),
        what="the agent's log line (flushed after a moment)",
    )
    assert agent.ns("cat", "/etc/hostname") == "eg-static\n"  # written by hostnamed
    assert agent.ns("hostname").strip() == "eg-trans"
    assert read_pretty_of(agent.ns("cat", "/etc/machine-info")) == PRETTY
    assert "Changed pretty hostname to" in hostnamed_log.read_text()

    # drift through hostnamed itself (what an admin's hostnamectl calls), repaired through it
    def hostnamed(method: str, value: str) -> None:
        agent.ns(
            *("dbus-send", f"--bus=unix:path={bus}", "--print-reply"),
            *("--dest=org.freedesktop.hostname1", "/org/freedesktop/hostname1"),
            *(f"org.freedesktop.hostname1.{method}", f"string:{value}", "boolean:false"),
        )

    hostnamed("SetStaticHostname", "drifted")
    wait_for(lambda: agent.ns("cat", "/etc/hostname") == "eg-static\n", what="static repaired")
    wait_for(lambda: agent.ns("hostname").strip() == "eg-trans", what="transient repaired")
    hostnamed("SetPrettyHostname", "Other")
    wait_for(
        lambda: read_pretty_of(agent.ns("cat", "/etc/machine-info")) == PRETTY,
        what="pretty repaired",
    )
    wait_for(
        lambda: agent.log.read_text().count("hostname[h]: pretty hostname set to") == 2,
        what="the repairs logged",
    )
    log = agent.log.read_text()
    assert log.count("hostname[h]: static hostname set to eg-static") == 2
    assert log.count("hostname[h]: pretty hostname set to") == 2
    assert agent.stop() == 0
    assert (upper / "hostname").read_text() == "eg-static\n"


def read_pretty_of(text: str) -> str:
    from evergraph.resources.hostname import read_pretty

    return read_pretty(text)


BAD_INPUT = [
    ("static_hostname: 'bad_name!'", "hostname[h].static_hostname: 'bad_name!' is not a host"),
    ("hostname: 'a..b'", "hostname[h].hostname: 'a..b' is not a host name"),
    ("transient_hostname: " + "x" * 65, "hostname[h].transient_hostname: 'xxx"),
    ('pretty_hostname: "two\\nlines"', "hostname[h].pretty_hostname: must be one line"),
    ("", "hostname[h].hostname: nothing to manage"),
    ("statichostname: x", "statichostname"),
]


@pytest.mark.parametrize(("params", "needle"), BAD_INPUT)
def test_bad_input_is_exit_2_and_changes_nothing(
    tmp_path: Path, params: str, needle: str, host_untouched: None
) -> None:
    g = tmp_path / "g.yaml"
    g.write_text(f"graph: g\nresources:\n  hostname:\n  - name: h\n    {params}\n")
    # in process, as `evergraph check` loads it; one of them end to end: exit 2,
    # nothing changed
    if not refused(g, needle, f"{g}:", end_to_end=(params, needle) == BAD_INPUT[0]):
        return
    # run, in a namespace: refused before anything is touched
    setup, upper = overlay_etc(tmp_path)
    r = ns_once(
        UTS_MOUNT,
        setup,
        *EVERGRAPH,
        "run",
        str(g),
        "--state-dir",
        str(tmp_path / "s"),
        "--converged-exit",
        env=no_bus(tmp_path),
    )
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr
    assert list(upper.iterdir()) == []  # nothing written under /etc
