"""`evergraph setup systemd`: the unit it prints and installs (into a temporary root:
this machine runs no systemd), checked by `systemd-analyze verify` when present, and
its ExecStart run for real."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from evergraph.cli.setup import systemd_word
from tests.conftest import EVERGRAPH, REPO, run_cli
from tests.kit.machine import MACHINE_WIDE

pytestmark = MACHINE_WIDE

SCRIPT = Path(sys.executable).parent / "evergraph"
UNIT = "etc/systemd/system/evergraph.service"


def sections(text: str) -> dict[str, dict[str, list[str]]]:
    """A unit file as {section: {key: [values]}} (comments and blank lines skipped)."""
    out: dict[str, dict[str, list[str]]] = {}
    here: dict[str, list[str]] = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        if line.startswith("["):
            here = out.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        here.setdefault(key, []).append(value)
    return out


def exec_start(text: str) -> list[str]:
    """The ExecStart words as the service gets them (systemd's quoting undone)."""
    (line,) = sections(text)["Service"]["ExecStart"]
    return [w.replace("%%", "%").replace("$$", "$") for w in shlex.split(line)]


@pytest.fixture
def site(tmp_path: Path) -> Path:
    f = tmp_path / "site.yaml"
    f.write_text(
        f"graph: svc\nresources:\n  file:\n  - name: out\n    path: {tmp_path}/out\n"
        '    content: "made by the service\\n"\n'
    )
    return f


def one_line_error(r: subprocess.CompletedProcess[str], status: int, needle: str) -> None:
    assert r.returncode == status, (r.returncode, r.stdout, r.stderr)
    err = r.stderr.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert needle in err, err


def test_print_shows_a_unit_that_runs_this_evergraph(site: Path) -> None:
    r = subprocess.run(
        [SCRIPT, "setup", "systemd", "--print", site], capture_output=True, text=True, check=False
    )
    assert r.returncode == 0, r.stderr
    unit = sections(r.stdout)
    service = unit["Service"]
    assert exec_start(r.stdout) == [
        str(SCRIPT),
        "run",
        "--state-dir",
        "/var/lib/evergraph",
        "--http",
        "127.0.0.1:9233",
        str(site),
    ]
    assert service["Restart"] == ["on-failure"]
    # SIGTERM to evergraph only: it stops the commands it started itself
    assert service["KillMode"] == ["mixed"]
    assert service["StateDirectory"] == ["evergraph"]
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]
    # nothing that would stop a root agent from writing /etc, /home, /tmp or
    # running setuid tools (sudo, passwd) and package scripts
    for key in ("ProtectSystem", "ProtectHome", "PrivateTmp", "NoNewPrivileges", "User"):
        assert key not in service, key
    assert not any(k.startswith("ReadOnly") for k in service)


def test_run_through_python_m_names_this_python(site: Path, tmp_path: Path) -> None:
    r = subprocess.run(
        [*EVERGRAPH, "setup", "systemd", "--print", "--no-http", "--state-dir", "/srv/eg", site],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert exec_start(r.stdout) == [
        sys.executable,
        "-m",
        "evergraph.cli.main",
        "run",
        "--state-dir",
        "/srv/eg",
        str(site),
    ]
    # systemd creates only /var/lib/<name> itself
    assert "StateDirectory" not in sections(r.stdout)["Service"]


def test_a_relative_file_is_made_absolute(site: Path) -> None:
    r = subprocess.run(
        [*EVERGRAPH, "setup", "systemd", "--print", site.name],
        capture_output=True,
        text=True,
        check=False,
        cwd=site.parent,
    )
    assert r.returncode == 0, r.stderr
    assert exec_start(r.stdout)[-1] == str(site)


def test_the_exec_start_runs_the_graph(site: Path, tmp_path: Path) -> None:
    """The command line of the unit, as systemd would split it, converges the graph
    (with a temporary state dir and port, and one-shot flags added)."""
    r = run_cli("setup", "systemd", "--print", site, "--", "--converged-timeout", "0", "-v")
    assert r.returncode == 0, r.stderr
    argv = exec_start(r.stdout)
    state = tmp_path / "state"
    argv[argv.index("--state-dir") + 1] = str(state)
    argv[argv.index("--http") + 1] = "127.0.0.1:0"
    done = subprocess.run(
        [*argv, "--converged-exit", "--world", "memory"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out").read_text() == "made by the service\n"
    assert state.is_dir()


def test_install_into_a_root_is_atomic_and_idempotent(site: Path, tmp_path: Path) -> None:
    root = tmp_path / "root"
    printed = run_cli("setup", "systemd", "--print", site).stdout
    r = run_cli("setup", "systemd", "--root", root, site)
    assert r.returncode == 0, r.stderr
    unit = root / UNIT
    assert unit.read_text() == printed
    assert unit.stat().st_mode & 0o777 == 0o644
    assert (root / "etc/systemd/system").stat().st_mode & 0o777 == 0o755
    assert f"wrote {unit}" in r.stdout
    assert "systemctl enable --now evergraph" in r.stdout
    first = unit.stat()

    again = run_cli("setup", "systemd", "--root", root, site)
    assert again.returncode == 0, again.stderr
    assert "unchanged" in again.stdout
    assert unit.stat().st_ino == first.st_ino
    assert unit.stat().st_mtime_ns == first.st_mtime_ns

    other = run_cli("setup", "systemd", "--root", root, "--http", "0.0.0.0:9233", site)
    assert other.returncode == 0, other.stderr
    assert f"replaced {unit}" in other.stdout
    assert unit.stat().st_ino != first.st_ino  # a rename: never a half-written unit
    assert "--http 0.0.0.0:9233" in unit.read_text()
    assert sorted(p.name for p in unit.parent.iterdir()) == ["evergraph.service"]


def test_with_a_root_file_is_a_path_of_that_system(tmp_path: Path) -> None:
    root = tmp_path / "image"
    r = run_cli("setup", "systemd", "--root", root, "/etc/evergraph/site.yaml")
    assert r.returncode == 0, r.stderr
    assert exec_start((root / UNIT).read_text())[-1] == "/etc/evergraph/site.yaml"
    one_line_error(
        run_cli("setup", "systemd", "--root", root, "site.yaml"), 2, "FILE: site.yaml: with --root"
    )


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    # a path that needs every kind of quoting: a space, a quote, `%` and `$`
    weird = tmp_path / 'my "odd" %h $HOME dir' / "site.yaml"
    weird.parent.mkdir()
    weird.write_text("graph: g\nresources: {}\n")
    root = tmp_path / "root"
    r = subprocess.run(
        [SCRIPT, "setup", "systemd", "--root", root, weird, "--", "--cap", "x=1", "--worker"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    v = subprocess.run(
        ["systemd-analyze", "verify", str(root / UNIT)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "SYSTEMD_LOG_LEVEL": "notice"},
    )
    assert v.returncode == 0, v.stderr
    assert v.stdout + v.stderr == "", v.stdout + v.stderr
    assert exec_start((root / UNIT).read_text())[-3:] == ["x=1", "--worker", str(weird)]


def test_systemd_word_quotes_what_systemd_would_expand() -> None:
    assert systemd_word("/usr/bin/evergraph") == "/usr/bin/evergraph"
    assert systemd_word("127.0.0.1:9233") == "127.0.0.1:9233"
    assert systemd_word("a b") == '"a b"'
    assert systemd_word("100%") == '"100%%"'
    assert systemd_word("$HOME") == '"$$HOME"'
    assert systemd_word('say "hi"\\') == '"say \\"hi\\"\\\\"'
    assert systemd_word("") == '""'


@pytest.mark.parametrize(
    ("args", "status", "needle"),
    [
        (["--state-dir", "relative"], 2, "--state-dir: relative is not an absolute path"),
        (["--http", "nowhere"], 2, "--http: 'nowhere' is not HOST:PORT"),
        ([str(REPO / "README.md")], 2, "expected a .yaml, .yml or .py graph"),
        (["--", "--bogus"], 2, "--: not a run option: No such option '--bogus'"),
        (["--", "--sema", "many"], 2, "--: not a run option: Invalid value for '--sema'"),
        (["--", "--state-dir", "/x"], 2, "give --state-dir to `evergraph setup systemd` itself"),
        (["--", "--http", "127.0.0.1:1"], 2, "give --http to `evergraph setup systemd` itself"),
        (["--", "--worker", "x.yaml"], 2, "give FILE to `evergraph setup systemd` itself"),
        (["--", "--etcd-ca", "ca.pem"], 2, "--etcd-ca: ca.pem is relative"),
        (["--", "--help"], 2, "`--help` is not a run option"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(
    tmp_path: Path, args: list[str], status: int, needle: str
) -> None:
    root = tmp_path / "root"
    one_line_error(run_cli("setup", "systemd", "--root", root, *args), status, needle)
    assert not root.exists()


def test_an_unwritable_root_is_a_runtime_failure(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    r = run_cli("setup", "systemd", "--root", blocker / "root", "--no-http")
    one_line_error(r, 1, f"cannot write {blocker}/root/{UNIT}")


def test_a_missing_graph_file_is_bad_input(tmp_path: Path) -> None:
    missing = tmp_path / "site.yaml"
    r = run_cli("setup", "systemd", "--print", missing)
    one_line_error(r, 2, f"FILE: no such file: {missing}")
    assert r.stdout == ""
