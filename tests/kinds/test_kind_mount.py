"""mount: the timeline for real, in a private mount namespace the test makes.

The agent runs under `unshare --mount --propagation private` with an overlay
over /etc (its /etc/fstab edits land in the test's tmp dir) and mounts tmpfs
file systems on tmp dirs: nothing of it is seen outside. Drift is made "from
outside" with `nsenter` into the agent's mount namespace; what is mounted is
read from the agent's own /proc/PID/mountinfo.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from evergraph.resources.mount import Mounted, mounted_at
from tests.conftest import EVERGRAPH, wait_for
from tests.kit.kinds import refused
from tests.kit.namespaces import NsAgent, ns_once, overlay_etc

MOUNT_NS = ["--mount", "--propagation", "private"]


def mounted(agent: NsAgent, point: Path) -> Mounted | None:
    return mounted_at(str(point), Path(f"/proc/{agent.pid}/mountinfo").read_text())


def fstab(upper: Path) -> str:
    """The agent's /etc/fstab (as written into the overlay)."""
    try:
        return (upper / "fstab").read_text()
    except FileNotFoundError:
        return Path("/etc/fstab").read_text()


def log_count(agent: NsAgent, needle: str) -> int:
    return agent.log.read_text().count(needle)


@pytest.fixture
def host_untouched() -> Iterator[None]:
    before = Path("/etc/fstab").read_bytes(), Path("/proc/self/mountinfo").read_text()
    yield
    after = Path("/etc/fstab").read_bytes(), Path("/proc/self/mountinfo").read_text()
    assert after[0] == before[0], "the host's /etc/fstab changed"
    assert "evergraph-mnt" not in after[1], "a test mount is visible on the host"


def test_timeline(tmp_path: Path, ns_agents: Callable[..., NsAgent], host_untouched: None) -> None:
    point = tmp_path / "evergraph-mnt"
    point.mkdir()
    g = tmp_path / "g.yaml"
    g.write_text(
        "graph: g\nresources:\n  mount:\n"
        f"  - name: {point}\n"
        "    device: tmpfs\n    type: tmpfs\n"
        "    options: {nosuid: '', nodev: '', size: 8m}\n"
        "    meta: {reverse: true}\n"
    )
    line = f"tmpfs {point} tmpfs nosuid,nodev,size=8m 0 0\n"
    setup, upper = overlay_etc(tmp_path)
    original = Path("/etc/fstab").read_text()
    agent = ns_agents(g, tmp_path / "s", MOUNT_NS, setup, "-v")
    agent.wait_converged()
    # applied: mounted with the flags, and the fstab line appended (other lines kept)
    now = mounted(agent, point)
    assert now is not None
    assert now.type == "tmpfs"
    assert now.source == "tmpfs"
    assert {"nosuid", "nodev"} <= now.flags
    assert fstab(upper).startswith(original.rstrip("\n") + "\n")
    assert fstab(upper).endswith(line)
    # drift: unmounted from outside (the kernel's notice on mountinfo), mounted again
    agent.ns("umount", str(point))
    wait_for(lambda: log_count(agent, "mounted tmpfs (tmpfs") == 2, what="mounted again")
    assert mounted(agent, point) is not None
    # drift: a flag changed by a remount, remounted back
    agent.ns("mount", "-o", "remount,suid", str(point))
    wait_for(lambda: "remounted (nosuid)" in agent.log.read_text(), what="remounted")
    now = mounted(agent, point)
    assert now is not None
    assert "nosuid" in now.flags
    # drift: the fstab line removed by hand beside another edit: the line back, the edit kept
    edit = tmp_path / "fstab.edit"
    agent.ns(
        "sh",
        "-c",
        f"grep -v evergraph-mnt /etc/fstab > {edit}; echo '# mine' >> {edit};"
        f" cp {edit} /etc/.fstab.new; mv /etc/.fstab.new /etc/fstab",
    )  # as sed -i: by rename
    wait_for(lambda: fstab(upper).endswith(line), what="the fstab line back")
    assert "# mine\n" in fstab(upper)
    # a check from outside finds it clean
    r = agent.ns_run(
        *EVERGRAPH, "run", str(g), "--state-dir", str(tmp_path / "s2"), "--noop", "--converged-exit"
    )
    assert r.returncode == 0, r.stderr
    assert "nothing would change or failed, 1 clean" in r.stderr
    # reversal: the resource leaves the graph; nothing was there before: unmounted, no line
    g.write_text("graph: g\nresources:\n  noop:\n  - name: n\n")
    wait_for(lambda: mounted(agent, point) is None, what="unmounted by the reversal")
    wait_for(lambda: "evergraph-mnt" not in fstab(upper), what="the line removed")
    assert "# mine\n" in fstab(upper)
    assert agent.stop() == 0


def test_absent_unmounts_and_removes_the_line_and_keeps_it_so(
    tmp_path: Path, ns_agents: Callable[..., NsAgent], host_untouched: None
) -> None:
    point = tmp_path / "evergraph-mnt"
    point.mkdir()
    g = tmp_path / "g.yaml"
    g.write_text(f"graph: g\nresources:\n  mount:\n  - name: {point}\n    state: absent\n")
    setup, upper = overlay_etc(tmp_path)
    setup += f"\necho 'tmpfs {point} tmpfs defaults 0 0' >> /etc/fstab"
    setup += f"\nmount -t tmpfs tmpfs {point}"
    agent = ns_agents(g, tmp_path / "s", MOUNT_NS, setup, "-v")
    agent.wait_converged()
    assert mounted(agent, point) is None
    assert "evergraph-mnt" not in fstab(upper)
    agent.ns("mount", "-t", "tmpfs", "again", str(point))
    wait_for(lambda: log_count(agent, "unmounted") == 2, what="unmounted again")
    assert mounted(agent, point) is None
    assert agent.stop() == 0


def test_another_file_system_in_the_way_is_replaced(
    tmp_path: Path, ns_agents: Callable[..., NsAgent], host_untouched: None
) -> None:
    point = tmp_path / "evergraph-mnt"
    point.mkdir()
    g = tmp_path / "g.yaml"
    g.write_text(
        f"graph: g\nresources:\n  mount:\n  - name: {point}\n    device: mine\n    type: tmpfs\n"
    )
    setup, _ = overlay_etc(tmp_path)
    setup += f"\nmount -t tmpfs other {point}"
    agent = ns_agents(g, tmp_path / "s", MOUNT_NS, setup, "-v")
    agent.wait_converged()
    now = mounted(agent, point)
    assert now is not None
    assert now.source == "mine"
    assert agent.stop() == 0


BAD_INPUT = [
    ("{name: mnt, device: tmpfs, type: tmpfs}", "mount[mnt].name: 'mnt' is not an absolute"),
    ("{name: /mnt, state: mounted}", "mount[/mnt].state: Invalid enum value 'mounted'"),
    ("{name: /mnt, device: tmpfs}", "mount[/mnt].type: needs a file system type"),
    ("{name: /mnt, type: tmpfs}", "mount[/mnt].device: needs a device"),
    ("{name: /mnt, device: x, type: 'ext 4'}", "mount[/mnt].type: 'ext 4' is not one"),
    (
        "{name: /mnt, device: x, type: tmpfs, options: {'a,b': ''}}",
        "mount[/mnt].options: 'a,b' is not an option name",
    ),
    ("{name: /mnt, device: x, type: tmpfs, passno: 12}", "mount[/mnt].passno: must be between"),
    (
        "{name: /mnt, device: x, type: tmpfs, options: [ro]}",
        "mount[/mnt].options: expected object, got array",
    ),
]


@pytest.mark.parametrize(("item", "needle"), BAD_INPUT)
def test_bad_input_is_exit_2_and_changes_nothing(
    tmp_path: Path, item: str, needle: str, host_untouched: None
) -> None:
    g = tmp_path / "g.yaml"
    g.write_text(f"graph: g\nresources:\n  mount:\n  - {item}\n")
    # in process, as `evergraph check` loads it; one of them end to end: exit 2,
    # nothing changed
    if not refused(g, needle, f"{g}:4:", end_to_end=(item, needle) == BAD_INPUT[0]):
        return
    setup, upper = overlay_etc(tmp_path)
    r = ns_once(
        MOUNT_NS,
        setup,
        *EVERGRAPH,
        *("run", str(g), "--state-dir", str(tmp_path / "s"), "--converged-exit"),
    )
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr
    assert list(upper.iterdir()) == []  # /etc/fstab untouched
