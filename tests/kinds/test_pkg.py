"""pkg: real Debian packages installed and removed by apt and by PackageKit.

The packages are tiny and need nothing but libc6 (hello, tree, pv;
libmodbus5 has an older version in bookworm and a newer one in its security
archive). A test that finds one of them installed beforehand skips rather
than remove something that is not ours; whatever a test installed is purged
afterwards, on failure too.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from evergraph.resources import _dpkg
from tests.conftest import Agent, run_cli, wait_for
from tests.kit.machine import MACHINE_WIDE
from tests.kit.pkg import installed

HISTORY = Path("/var/log/apt/history.log")
APT_ENV = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}

pytestmark = [
    MACHINE_WIDE,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("apt-get") is None, reason="needs root on Debian"
    ),
]


# -- helpers ---------------------------------------------------------------------------


def transactions() -> list[str]:
    """The Commandline of every apt/dpkg transaction logged so far, oldest first."""
    try:
        text = HISTORY.read_text()
    except FileNotFoundError:
        return []
    out = []
    for entry in text.split("Start-Date:")[1:]:
        cmd = next((ln for ln in entry.splitlines() if ln.startswith("Commandline:")), "")
        out.append(cmd.removeprefix("Commandline:").strip())
    return out


def versions(pkg: str) -> list[str]:
    """Versions apt can install, newest first."""
    r = subprocess.run(["apt-cache", "madison", pkg], capture_output=True, text=True)
    return [ln.split("|")[1].strip() for ln in r.stdout.splitlines() if ln.count("|") >= 2]


def purge(*pkgs: str) -> None:
    present = [p for p in pkgs if installed(p) or _config_left(p)]
    if present:
        subprocess.run(
            ["apt-get", "purge", "-y", "-q", *present],
            env=APT_ENV,
            capture_output=True,
            check=True,
            timeout=300,
        )


def _config_left(pkg: str) -> bool:
    r = subprocess.run(
        ["dpkg-query", "-W", "-f=${db:Status-Abbrev}", pkg], capture_output=True, text=True
    )
    return r.returncode == 0 and r.stdout.startswith("rc")


@pytest.fixture(scope="module")
def apt_lists() -> None:
    """apt's package lists, fetched once when this machine has none yet."""
    if not versions("hello"):
        subprocess.run(
            ["apt-get", "update", "-q"], env=APT_ENV, capture_output=True, check=True, timeout=600
        )
    if not versions("hello"):
        pytest.skip("apt knows no package 'hello' even after apt-get update")


@pytest.fixture
def packages(apt_lists: None) -> Iterator[Callable[..., None]]:
    """Claim test packages: skip if one is installed already; purge them all afterwards."""
    claimed: list[str] = []

    def claim(*pkgs: str) -> None:
        for p in pkgs:
            if installed(p):
                pytest.skip(f"{p} is installed on this machine already: not ours to remove")
            claimed.append(p)

    yield claim
    purge(*claimed)


@pytest.fixture
def apt_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    # agents are child processes: they inherit the choice
    monkeypatch.setenv("EVERGRAPH_PKG_BACKEND", "apt")


def write(tmp_path: Path, body: str, name: str = "g.yaml") -> Path:
    g = tmp_path / name
    g.write_text("graph: pkgs\nresources:\n" + body)
    return g


def run(g: Path, state: Path) -> tuple[int, str]:
    r = run_cli("run", g, "--state-dir", state, "--converged-exit", timeout=600)
    return r.returncode, r.stderr


# -- pure parts ------------------------------------------------------------------------


def test_version_order_is_dpkgs() -> None:
    pairs = [
        ("1.0", "1.0"),
        ("1.0", "1.0-0"),
        ("1.0~rc1", "1.0"),
        ("1.0", "1.0+b1"),
        ("1:0.9", "2.0"),
        ("2.0-1", "2.0-1+deb12u1"),
        ("5.02-1+b1", "5.02-1"),
        ("1.2a", "1.2b"),
        ("1.10", "1.9"),
        ("1.0.", "1.0"),
        ("3.1.6-2.1", "3.1.6-2.1+deb12u1"),
        ("0.19-3+deb12u1", "0.19-3"),
        ("1~~", "1~"),
        ("1.0-1", "1.0-1~bpo"),
    ]
    for a, b in pairs:
        for x, y in ((a, b), (b, a)):
            mine = _dpkg.compare_versions(x, y)
            for op, holds in (("lt", mine < 0), ("eq", mine == 0), ("gt", mine > 0)):
                r = subprocess.run(["dpkg", "--compare-versions", x, op, y])
                assert (r.returncode == 0) == holds, f"{x} {op} {y}: dpkg disagrees"


def test_names_and_versions() -> None:
    assert _dpkg.name_problem("libc6:amd64") is None
    assert _dpkg.name_problem("g++") is None
    for bad in ("", "a", "Hello", "he llo", "-x", "x*"):
        assert _dpkg.name_problem(bad) is not None, bad
    for good in ("1.0", "1:2.3-4", "5.02-1+b1", "2.0~rc1-1~bpo12+1", "1.2-3-4"):
        assert _dpkg.is_version(good), good
    for bad in ("bogus", "v1.0", "1.0 beta", "1.0-", "1:", ":1", "latest"):
        assert not _dpkg.is_version(bad), bad


@pytest.mark.parametrize(
    ("entry", "needle"),
    [
        ("  - {name: hello, state: bogus}\n", "pkg[hello].state: 'bogus' is neither"),
        ('  - {name: hello, state: "1.0 beta"}\n', "pkg[hello].state: '1.0 beta' is neither"),
        ('  - {name: "", state: installed}\n', "pkg resource without a `name:`"),
        ("  - {name: Hello_World}\n", "pkg[Hello_World].name: 'Hello_World' is not a package"),
    ],
)
def test_bad_parameters_are_load_errors_and_install_nothing(
    tmp_path: Path, apt_backend: None, entry: str, needle: str
) -> None:
    if installed("hello") or installed("tree"):
        pytest.skip("hello or tree is installed here already: cannot show nothing was")
    before = transactions()
    g = write(tmp_path, "  pkg:\n  - {name: tree}\n" + entry)
    rc, err = run(g, tmp_path / "s")
    assert rc == 2, err
    assert needle in err
    assert f"{g}:5:" in err  # file:line of the bad entry
    assert installed("hello") is None
    assert installed("tree") is None
    assert transactions() == before


# -- real packages -------------------------------------------------------------------------


@pytest.mark.slow
def test_timeline_group_install_clean_rerun_drift_repair_and_removal(
    tmp_path: Path, apt_backend: None, packages: Callable[..., None], agents: Callable[..., Agent]
) -> None:
    packages("hello", "tree")
    g = write(tmp_path, "  pkg:\n  - {name: hello}\n  - {name: tree, state: installed}\n")
    graph = run_cli("graph", g, "--format", "json")
    assert graph.returncode == 0, graph.stderr
    groups = {v["id"]: v["group"] for v in json.loads(graph.stdout)["vertices"]}
    assert groups == {"pkg[hello]": ["pkg[tree]"]}
    before = transactions()

    # from scratch: both packages in ONE apt transaction
    rc, err = run(g, tmp_path / "s")
    assert rc == 0, err
    assert installed("hello")
    assert installed("tree")
    new = transactions()[len(before) :]
    assert len(new) == 1, new
    assert new[0].startswith("apt-get install"), new
    assert new[0].endswith("-- hello tree"), new
    assert "pkg[hello] pkg[tree]: apt-get install hello tree: 0 upgraded, 2 newly installed" in err

    # a second run finds nothing to do and runs apt not at all
    rc, err = run(g, tmp_path / "s")
    assert rc == 0, err
    assert ": applied" not in err
    assert len(transactions()) == len(before) + 1

    # drift while an agent runs: removed by hand, seen through dpkg's status file
    agent = agents(g, tmp_path / "agent")
    agent.wait_converged()
    subprocess.run(["dpkg", "-r", "hello"], capture_output=True, check=True)
    assert installed("hello") is None
    wait_for(lambda: installed("hello") is not None, timeout=120, what="hello reinstalled")
    # (logged once apt-get ends: after dpkg marks the package installed, its triggers
    # may still run for a while on a loaded machine)
    wait_for(
        lambda: "pkg[hello]: applied" in agent.log.read_text(),
        timeout=120,
        what="the repair logged",
    )
    assert agent.stop() == 0

    # uninstalled removes both, again in one transaction
    g = write(
        tmp_path,
        "  pkg:\n  - {name: hello, state: uninstalled}\n  - {name: tree, state: uninstalled}\n",
    )
    count = len(transactions())
    rc, err = run(g, tmp_path / "s")
    assert rc == 0, err
    assert installed("hello") is None
    assert installed("tree") is None
    new = transactions()[count:]
    assert len(new) == 1, new
    assert new[0].startswith("apt-get remove"), new
    assert new[0].endswith("-- hello tree"), new
    rc, err = run(g, tmp_path / "s")
    assert rc == 0, err
    assert ": applied" not in err


def test_validate_names_the_field_when_embedded() -> None:
    from evergraph.errors import InputError
    from evergraph.resources.pkg import Pkg

    with pytest.raises(InputError, match=r"pkg\[\]\.name"):
        Pkg(name="").validate()
    with pytest.raises(InputError, match=r"pkg\[hello\]\.state"):
        Pkg(name="hello", state="latest").validate()


def test_a_failed_apt_run_reports_apts_own_words(
    tmp_path: Path, apt_backend: None, packages: Callable[..., None]
) -> None:
    packages("hello")
    g = write(tmp_path, '  pkg:\n  - {name: hello, state: "9.9.9-9"}\n')
    rc, err = run(g, tmp_path / "s")
    assert rc == 1
    assert "pkg[hello]: apt-get install hello=9.9.9-9 failed (exit 100)" in err, err
    assert "Version '9.9.9-9' for 'hello' was not found" in err, err
    assert installed("hello") is None


@pytest.mark.slow
def test_a_version_is_held_and_newest_upgrades_to_the_candidate(
    tmp_path: Path, apt_backend: None, packages: Callable[..., None]
) -> None:
    packages("libmodbus5")
    known = versions("libmodbus5")
    if len(known) < 2:
        pytest.skip(f"apt knows one version of libmodbus5 here ({known}): nothing to upgrade")
    newest, older = known[0], known[-1]
    g = write(tmp_path, f'  pkg:\n  - {{name: libmodbus5, state: "{older}"}}\n')
    rc, err = run(g, tmp_path / "s")
    assert rc == 0, err
    assert installed("libmodbus5") == older
    rc, err = run(g, tmp_path / "s")
    assert rc == 0, err
    assert ": applied" not in err

    g = write(tmp_path, "  pkg:\n  - {name: libmodbus5, state: newest}\n")
    # noop sees the difference and changes nothing
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit", "--noop")
    assert "pkg[libmodbus5]: would change (noop)" in r.stderr, r.stderr
    assert installed("libmodbus5") == older
    rc, err = run(g, tmp_path / "s")
    assert rc == 0, err
    assert installed("libmodbus5") == newest
    assert "pkg[libmodbus5]: apt-get install libmodbus5: 1 upgraded" in err
    rc, err = run(g, tmp_path / "s")
    assert rc == 0, err
    assert ": applied" not in err


@pytest.mark.slow
def test_an_installed_package_provides_its_files_to_automatic_edges(
    tmp_path: Path, apt_backend: None, packages: Callable[..., None]
) -> None:
    packages("pv")
    only_pkg = write(tmp_path, "  pkg:\n  - {name: pv}\n", "pkg.yaml")
    g = write(
        tmp_path,
        "  pkg:\n  - {name: pv}\n  exec:\n  - {name: version, cmd: /usr/bin/pv --version}\n"
        "  file:\n  - {name: /usr/share/doc/pv/copyright}\n",  # exists: changes nothing
    )

    def auto_edges() -> set[tuple[str, str]]:
        r = run_cli("graph", g, "--format", "json")
        assert r.returncode == 0, r.stderr
        return {(e["from"], e["to"]) for e in json.loads(r.stdout)["edges"] if e["auto"]}

    # not installed yet: its files are unknown (dpkg lists them only once installed)
    assert auto_edges() == set()
    rc, err = run(only_pkg, tmp_path / "s")
    assert rc == 0, err
    assert installed("pv")
    # now pv's files are known: the exec of its program and a file resource managing
    # one of its files run after the package
    assert auto_edges() == {
        ("pkg[pv]", "exec[version]"),
        ("pkg[pv]", "file[/usr/share/doc/pv/copyright]"),
    }
    rc, err = run(g, tmp_path / "s")
    assert rc == 0, err


# -- PackageKit ----------------------------------------------------------------------

BUS_DIR = Path("/run/dbus")
BUS_SOCKET = BUS_DIR / "system_bus_socket"
BUS_PIDFILE = BUS_DIR / "pid"


def pids_named(*names: str) -> set[int]:
    out = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() in names:
                    out.add(int(entry.name))
            except OSError:
                continue
    return out


def stop_pid(pid: int) -> None:
    """SIGTERM, then SIGKILL after 5 s; the daemons are not our children: poll /proc."""
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            stat = Path(f"/proc/{pid}/stat")
            try:
                if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                    return  # exited; its parent (init) reaps it
            except (OSError, IndexError):
                return
            time.sleep(0.02)


@pytest.fixture
def system_bus() -> Iterator[None]:
    """A system D-Bus daemon of our own; bus activation starts packagekitd and polkitd.

    Everything it started is stopped by PID afterwards: the daemon, and the
    packagekitd/polkitd processes that were not running before.
    """
    if not (Path("/usr/libexec/packagekitd").exists() and shutil.which("dbus-daemon")):
        pytest.skip("needs dbus-daemon and packagekit (scripts/setup installs them)")
    if BUS_SOCKET.exists():
        pytest.skip("a system bus runs here already: not ours to use or stop")
    before = pids_named("packagekitd", "polkitd")
    made_dir = not BUS_DIR.exists()
    BUS_DIR.mkdir(parents=True, exist_ok=True)
    if BUS_PIDFILE.exists():
        old = BUS_PIDFILE.read_text().strip()
        if old.isdigit() and Path(f"/proc/{old}").exists():
            pytest.skip("a system bus daemon runs here already: not ours to use or stop")
        BUS_PIDFILE.unlink()  # left by a daemon that is gone; dbus-daemon refuses to start
    started = subprocess.run(
        ["dbus-daemon", "--system", "--fork", "--print-pid"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert started.returncode == 0, started.stderr
    bus_pid = int(started.stdout.split()[0])
    try:
        yield
    finally:
        for pid in pids_named("packagekitd", "polkitd") - before:
            stop_pid(pid)
        stop_pid(bus_pid)
        for pid in pids_named("packagekitd", "polkitd") - before:  # activated meanwhile
            stop_pid(pid)
        for path in (BUS_PIDFILE, BUS_SOCKET):
            path.unlink(missing_ok=True)
        if made_dir:
            with contextlib.suppress(OSError):
                BUS_DIR.rmdir()


@pytest.mark.slow
def test_packagekit_installs_a_group_in_one_transaction_and_is_found_by_itself(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    packages: Callable[..., None],
    system_bus: None,
) -> None:
    packages("hello", "tree")
    g = write(tmp_path, "  pkg:\n  - {name: hello}\n  - {name: tree}\n")
    before = transactions()
    monkeypatch.setenv("EVERGRAPH_PKG_BACKEND", "packagekit")
    rc, err = run(g, tmp_path / "s")
    assert rc == 0, err
    assert installed("hello")
    assert installed("tree")
    new = transactions()[len(before) :]
    assert new == ["packagekit role='install-packages'"], new
    assert "pkg[hello] pkg[tree]: PackageKit InstallPackages hello;" in err
    rc, err = run(g, tmp_path / "s")
    assert rc == 0, err
    assert ": applied" not in err

    # without the override the agent finds PackageKit on the bus by itself
    monkeypatch.delenv("EVERGRAPH_PKG_BACKEND")
    g = write(
        tmp_path,
        "  pkg:\n  - {name: hello, state: uninstalled}\n  - {name: tree, state: uninstalled}\n",
    )
    count = len(transactions())
    rc, err = run(g, tmp_path / "s")
    assert rc == 0, err
    assert installed("hello") is None
    assert installed("tree") is None
    assert transactions()[count:] == ["packagekit role='remove-packages'"]
    rc, err = run(g, tmp_path / "s")
    assert rc == 0, err
    assert ": applied" not in err
