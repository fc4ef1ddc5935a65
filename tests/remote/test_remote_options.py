"""`evergraph remote`'s own options over real sshds (tests/kit/sshbed.py): a YAML
inventory's per-host hostname and key, `--seeds` (the hosts use a cluster the test
runs, none of the initiator's), `--diff`, `--log-format json`, and the live table
on a terminal (a pty) against plain lines in a pipe."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from evergraph.world.etcd_server import EtcdServer
from tests.kit.sshbed import SshBed
from tests.remote.test_remote import (
    EVERGRAPH,
    graph_file,
    hosts_of,
    pytestmark,  # noqa: F401  (the same skips: root, ip, sshd, ...)
    remote,
    remote_argv,
)


def test_inventory_hostnames_keys_diff_and_json_output(
    sshbed: Callable[[int], SshBed], tmp_path: Path
) -> None:
    bed = sshbed(2)
    h0, h1 = bed.hosts
    file = graph_file(tmp_path, bed.files)
    inventory = bed.client_key.parent / "hosts.yaml"
    # no --ssh-key: each host's key comes from the inventory (relative to it)
    inventory.write_text(
        "hosts:\n"
        f"  alpha: {{host: {h0.addr}, user: root, key: {bed.client_key.name}}}\n"
        "  beta:\n"
        f"    host: {h1.addr}\n"
        "    user: root\n"
        "    port: 22\n"
        f"    key: {bed.client_key}\n"
    )
    argv = [
        *EVERGRAPH,
        "remote",
        str(file),
        "--inventory",
        str(inventory),
        "--known-hosts",
        str(bed.known_hosts),
        "--diff",
        "--log-format",
        "json",
    ]
    out = remote(argv, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    records = [json.loads(line) for line in out.stdout.splitlines()]
    # the agent's hostname is the inventory's: the graph's file is named by it
    assert (h0.files / "alpha").read_text() == "alpha\n"
    assert (h1.files / "beta").read_text() == "beta\n"
    assert not (h0.files / h0.addr).exists()
    logs = [r for r in records if "msg" in r]
    # each host is named in the output by its inventory name
    assert {r["host"] for r in logs} == {"alpha", "beta"}
    assert all({"ts", "level", "msg"} <= r.keys() for r in logs)
    # --diff: the new file's content as a diff, in each host's agent's record
    for name in ("alpha", "beta"):
        diffs = [
            c.get("diff") or ""
            for r in logs
            if r["host"] == name and r.get("event") == "changed"
            for c in r["changes"]
        ]
        assert any(f"\n+{name}" in d for d in diffs), diffs
    recaps = [r for r in records if "recap" in r]
    assert recaps == [
        {"host": "alpha", "recap": "converged", "reason": ""},
        {"host": "beta", "recap": "converged", "reason": ""},
    ]
    assert records[-1] == {"total": {"hosts": 2, "converged": 2}, "exit": 0}


def test_seeds_use_the_given_cluster_and_plain_lines_in_a_pipe(
    sshbed: Callable[[int], SshBed], tmp_path: Path
) -> None:
    bed = sshbed(2)
    file = graph_file(tmp_path, bed.files)
    # the initiator's etcd would fail here: a shim first in its PATH (marks a call)
    shims = tmp_path / "shims"
    shims.mkdir()
    (shims / "etcd").write_text(f"#!/bin/sh\ntouch {shims}/called\nexit 1\n")
    (shims / "etcd").chmod(0o755)
    # a cluster the hosts reach on the uplink (the test's own address on the bed)
    with (
        tempfile.TemporaryDirectory(prefix="seeds-etcd-") as etcd_dir,
        EtcdServer(Path(etcd_dir) / "etcd", name="seeds", host=bed.client_addr) as etcd,
    ):
        url = etcd.client_url
        argv = [*remote_argv(bed, file, *hosts_of(bed)), "--seeds", url, "--diff"]
        env = {
            **os.environ,
            "SSH_AUTH_SOCK": "",
            "HOME": str(tmp_path),
            "TMPDIR": str(tmp_path),
            "PATH": f"{shims}:{os.environ['PATH']}",
        }
        out = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
        assert out.returncode == 0, out.stdout + out.stderr
        keys = subprocess.run(
            ["etcdctl", "--endpoints", url, "get", "", "--prefix", "--keys-only"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    for h in bed.hosts:
        assert (h.files / h.addr).read_text() == f"{h.addr}\n"
        assert f"{h.addr}: converged" in out.stdout
        # the agents wrote their World keys (their host key, ...) in the given cluster
        assert h.addr in keys, keys
        # --diff in text: the diff line, prefixed by the host
        assert any(
            line.startswith(f"{h.addr} | ") and f"+{h.addr}" in line
            for line in out.stdout.splitlines()
        ), out.stdout
    # no World of the initiator's: its etcd was never started
    assert not (shims / "called").exists()
    # in a pipe: plain lines only, no terminal control
    assert "\x1b" not in out.stdout
    assert out.stdout.splitlines()[-1] == "total: 2 host(s): 2 converged"


def test_a_terminal_shows_a_row_per_host_then_the_recap(
    sshbed: Callable[[int], SshBed], tmp_path: Path
) -> None:
    bed = sshbed(2)
    file = graph_file(tmp_path, bed.files)
    master, slave = pty.openpty()
    env = {
        **os.environ,
        "SSH_AUTH_SOCK": "",
        "HOME": str(tmp_path),
        "TMPDIR": str(tmp_path),
        "TERM": "xterm-256color",
        "COLUMNS": "120",
        "LINES": "40",
    }
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen(
        remote_argv(bed, file, *hosts_of(bed)),
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=subprocess.PIPE,
        env=env,
    )
    os.close(slave)
    seen = b""
    try:
        deadline = time.monotonic() + 300
        while b"total: " not in seen or not seen.endswith(b"\n"):
            left = deadline - time.monotonic()
            assert left > 0, seen[-2000:]
            ready, _, _ = select.select([master], [], [], left)
            if not ready:
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the initiator closed its end
                break
            if not chunk:
                break
            seen += chunk
        assert proc.wait(timeout=60) == 0, seen.decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
        assert proc.stderr is not None
        proc.stderr.close()
    text = seen.decode(errors="replace")
    assert "\x1b[" in text  # a terminal: the table was drawn and redrawn
    for h in bed.hosts:
        # the host's row in the table, with a state on the way
        rows = [
            ln
            for ln in text.replace("\r", "\n").splitlines()
            if h.addr in ln and " | " not in ln and ": converged" not in ln
        ]
        assert any("running" in ln or "installing" in ln for ln in rows), rows
        assert f"{h.addr}: converged" in text
        assert f"{h.addr} | " in text  # its log lines above the table
    # it ends with the recap: the total is the last line
    assert text.rstrip().splitlines()[-1].endswith("total: 2 host(s): 2 converged"), text[-500:]
