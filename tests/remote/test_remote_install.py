"""`evergraph remote FILE HOST... --install` / `--uninstall` (issue 26 item 7): bare
hosts become a self-formed TLS cluster of agents that stay, follow FILE deployed
signed by the initiator, and go again with --uninstall. The sshbed has no systemd:
the unit's ExecStart is started directly (remote/install.py)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from evergraph.cli.setup import unit_text
from evergraph.cluster.deploy_record import read_signing_key, verify_key_of
from evergraph.remote.install import LAUNCHER, NO_SYSTEMD_ROOT, STATE, UNIT, exec_start
from tests.conftest import wait_for
from tests.kit.machine import ONE_CLUSTER
from tests.kit.selfform import cluster_timeout
from tests.kit.sshbed import SSHD, SshBed, SshHost
from tests.remote.test_remote import (
    EVERGRAPH,
    graph_file,
    host_cmdlines,
    hosts_of,
    remote,
    remote_argv,
)
from tests.remote.test_sshbed import run_on

#: what the bed test needs (it carries the cluster marks: one at a time, slow)
NEEDS = pytest.mark.skipif(
    os.geteuid() != 0
    or not all(map(shutil.which, ("ip", "nsenter", "unshare", "nft", "ssh-keygen", "etcd")))
    or not os.access(SSHD, os.X_OK),
    reason="needs root, ip, nsenter, unshare, nft, etcd and Debian's openssh-server",
)


def test_exec_start_reads_back_what_setup_systemd_writes() -> None:
    argv = ["/opt/a b/evergraph", "run", "--x", '50% "q" $HOME\\n', "--y", "plain"]
    text = unit_text(None, Path("/var/lib/evergraph/state"), None, argv[2:], command=argv[:1])
    assert exec_start(text) == [
        argv[0],
        "run",
        "--state-dir",
        "/var/lib/evergraph/state",
        *argv[2:],
    ]
    with pytest.raises(ValueError, match="ExecStart"):
        exec_start("[Service]\nType=exec\n")


def test_install_and_uninstall_together_is_bad_input(tmp_path: Path) -> None:
    file = tmp_path / "site.yaml"
    file.write_text("resources: []\n")
    for extra in (["--install", "--uninstall"], ["--purge"]):
        r = subprocess.run(
            [*EVERGRAPH, "remote", str(file), "h1", *extra],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2, r.stdout + r.stderr
        assert len(r.stderr.splitlines()) == 1, r.stderr
        assert r.stdout == ""


def _rows(bed: SshBed, h: SshHost) -> list[dict[str, Any]]:
    command = f"{LAUNCHER} cluster --json --state-dir {STATE}"
    try:
        out = asyncio.run(run_on(bed, h, command, bed.known_hosts))
    except Exception:  # not up yet (the command fails, or SSH does)
        return []
    rows: list[dict[str, Any]] = json.loads(out)
    return rows


def _evergraph_left(h: SshHost) -> list[bytes]:
    return [c for c in host_cmdlines(h) if b"evergraph" in c]


def _nothing_left(h: SshHost) -> bool:
    return not _evergraph_left(h)


@pytest.mark.slow
@cluster_timeout(900)
@ONE_CLUSTER
@NEEDS
def test_install_forms_a_cluster_that_runs_file_and_uninstall_removes_it(
    sshbed: Callable[[int], SshBed], tmp_path: Path
) -> None:
    bed = sshbed(3)
    file = graph_file(tmp_path, bed.files)
    key = tmp_path / "deployer.key"
    key.write_text(base64.b64encode(os.urandom(32)).decode() + "\n")
    out = remote(
        [*remote_argv(bed, file, *hosts_of(bed)), "--install", "--key", str(key)], tmp_path
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "total: 3 host(s): 3 installed" in out.stdout, out.stdout
    h0 = bed.hosts[0]
    assert f"{h0.addr} | cluster formed" in out.stdout
    assert f"{h0.addr} | deployed site.py as deploy 1" in out.stdout

    def three_voters() -> bool:
        return sorted(r["role"] for r in _rows(bed, h0)) == ["voter"] * 3

    wait_for(three_voters, timeout=300, what="three voters in h0's `cluster --json`")
    rows = _rows(bed, h0)
    assert {r["client_url"] for r in rows} == {f"https://{h.addr}:2379" for h in bed.hosts}

    def converged() -> bool:
        return all((h.files / h.addr).is_file() and (h.files / "ran").is_file() for h in bed.hosts)

    wait_for(converged, timeout=300, what="FILE's resources on every host")
    signer = verify_key_of(read_signing_key(key))
    for h in bed.hosts:
        assert (h.files / h.addr).read_text() == f"{h.addr}\n"
        trusted = f"{LAUNCHER} hosts deployers --state-dir {STATE}"
        assert asyncio.run(run_on(bed, h, trusted, bed.known_hosts)).split()[0] == signer
        token = h.var_lib / "join.token"
        assert (token.stat().st_mode & 0o777 == 0o600) if h is not h0 else not token.exists()
        assert (h.var_lib / "remote/agent.pid").is_file()
        assert _evergraph_left(h)

    # --uninstall: nothing of evergraph left running, the unit, launcher and token gone,
    # the state kept; and a second --uninstall finds nothing to do
    for _attempt in range(2):
        out = remote([*remote_argv(bed, file, *hosts_of(bed)), "--uninstall"], tmp_path)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "total: 3 host(s): 3 uninstalled" in out.stdout, out.stdout
        for h in bed.hosts:
            wait_for(partial(_nothing_left, h), timeout=60, what=f"no agent on {h.name}")
            var_lib = h.var_lib
            assert not (
                var_lib / NO_SYSTEMD_ROOT.removeprefix("/var/lib/evergraph/") / UNIT
            ).exists()
            assert not (var_lib / LAUNCHER.removeprefix("/var/lib/evergraph/")).exists()
            assert not (var_lib / "join.token").exists()
            assert not (var_lib / "remote/agent.pid").exists()
            assert (var_lib / "state").is_dir()
