"""Exports between remote hosts during an `evergraph remote` session, over real
sshds (tests/kit/sshbed.py): the agents share the World the initiator owns, so a
file host 1 exports to host 2 is applied on host 2 while the session runs."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

from tests.conftest import wait_for
from tests.kit.sshbed import SshBed
from tests.remote.test_remote import hosts_of, pytestmark, remote_argv

__all__ = ["pytestmark"]


def exporting_graph(tmp: Path, files: Path, exporter: str, collector: str) -> Path:
    """`exporter` exports a file to `collector`, which collects files; both write
    their own name file too."""
    path = tmp / "exports.py"
    path.write_text(
        "def graph(g, world):\n"
        f"    g.add('file', 'name', path='{files}/' + world.host, content=world.host + '\\n')\n"
        f"    if world.host == '{exporter}':\n"
        f"        g.add('file', '{files}/from-exporter', content='from ' + world.host + '\\n',\n"
        f"              meta={{'export': ['{collector}'], 'hidden': True}})\n"
        f"    if world.host == '{collector}':\n"
        "        world.collect('file')\n"
    )
    return path


def test_a_file_exported_by_one_host_is_applied_on_another_during_the_session(
    sshbed: Callable[[int], SshBed], tmp_path: Path
) -> None:
    bed = sshbed(2)
    h0, h1 = bed.hosts
    file = exporting_graph(tmp_path, bed.files, h0.addr, h1.addr)
    env = {**os.environ, "SSH_AUTH_SOCK": "", "HOME": str(tmp_path), "TMPDIR": str(tmp_path)}
    # each agent stays until its graph has been still for 10 s (the last flag wins)
    argv = [*remote_argv(bed, file, *hosts_of(bed)), "--converged-timeout", "10"]
    initiator = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    try:
        arrived = h1.files / "from-exporter"

        def during_the_session() -> bool:
            if initiator.poll() is not None:
                raise AssertionError(f"the session ended first: {initiator.communicate()[0]}")
            return arrived.exists()

        wait_for(during_the_session, timeout=120, what="the export applied on h1")
        out, _ = initiator.communicate(timeout=120)
        assert initiator.returncode == 0, out
    finally:
        if initiator.poll() is None:
            initiator.kill()
            initiator.wait()
    assert arrived.read_text() == f"from {h0.addr}\n"
    assert not (h0.files / "from-exporter").exists()  # hidden: applied by its target only
    for h in bed.hosts:
        assert (h.files / h.addr).read_text() == f"{h.addr}\n"
        assert f"{h.addr}: converged" in out
