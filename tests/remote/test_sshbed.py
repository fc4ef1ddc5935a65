"""The SSH test bed itself (tests/kit/sshbed.py): asyncssh reaches every host's own
sshd from the test's namespace with the bed's client key and known_hosts, each host
has its own name, /var/lib/evergraph and managed-files dir, a host missing from
known_hosts is refused, and closing the bed leaves no sshd behind."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import asyncssh
import pytest

from tests.kit.sshbed import SSHD, SshBed, SshHost

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0
    or not all(map(shutil.which, ("ip", "nsenter", "unshare", "nft", "ssh-keygen")))
    or not os.access(SSHD, os.X_OK),
    reason="needs root, ip, nsenter, unshare, nft and Debian's openssh-server",
)


async def run_on(bed: SshBed, h: SshHost, command: str, known_hosts: Path) -> str:
    """`command` on `h` as root over SSH, its stdout."""
    async with asyncssh.connect(
        h.addr,
        port=h.ssh_port,
        username="root",
        client_keys=[str(bed.client_key)],
        known_hosts=str(known_hosts),
        agent_path=None,
        config=None,
        connect_timeout=10,
    ) as conn:
        r = await conn.run(command, check=True, timeout=30)
        assert isinstance(r.stdout, str)
        return r.stdout


def alive(pid: int) -> bool:
    """`pid` runs (a zombie waiting for its reaper does not count)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def sshd_pids(bed: SshBed) -> set[int]:
    """Processes on the machine that are an sshd of `bed` (by its config's path)."""
    mine = str(bed.tmp).encode()
    pids = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmdline = (d / "cmdline").read_bytes()
            except OSError:
                continue
            # the listener's title: `sshd: /usr/sbin/sshd -D -e -f CONFIG [listener] …`
            if b"sshd" in cmdline and mine in cmdline and alive(int(d.name)):
                pids.add(int(d.name))
    return pids


def test_each_host_answers_over_ssh_with_its_name_and_private_dirs(
    sshbed: Callable[[int], SshBed],
) -> None:
    bed = sshbed(3)
    for h in bed.hosts:
        (h.var_lib / "marker").write_text(f"state of {h.name}\n")
        (h.files / "marker").write_text(f"files of {h.name}\n")

    async def main() -> None:
        for h in bed.hosts:
            assert await run_on(bed, h, "hostname", bed.known_hosts) == f"{h.name}\n"
            marker = await run_on(bed, h, "cat /var/lib/evergraph/marker", bed.known_hosts)
            assert marker == f"state of {h.name}\n"
            files = await run_on(bed, h, f"cat {bed.files}/marker", bed.known_hosts)
            assert files == f"files of {h.name}\n"
            # a write on the host lands in its own dir, nowhere else
            await run_on(bed, h, f"echo {h.name} > /var/lib/evergraph/written", bed.known_hosts)

    asyncio.run(main())
    for h in bed.hosts:
        assert (h.var_lib / "written").read_text() == f"{h.name}\n"
    assert not (bed.files / "marker").exists()  # the test's side of the mount point


def test_known_hosts_holds_every_host_key_and_the_fingerprint_is_ssh_keygens(
    sshbed: Callable[[int], SshBed],
) -> None:
    bed = sshbed(2)
    lines = bed.known_hosts.read_text().splitlines()
    assert lines == [f"{h.addr} {h.host_key_line}" for h in bed.hosts]
    for h in bed.hosts:
        assert h.host_key_line.startswith("ssh-ed25519 AAAA")
        assert h.host_key_fingerprint.startswith("SHA256:")
        key = asyncssh.read_public_key(f"{h.host_key}.pub")
        assert key.get_fingerprint("sha256") == h.host_key_fingerprint
    assert bed.known_hosts_without(bed.hosts[0]).read_text().splitlines() == lines[1:]


def test_a_host_missing_from_known_hosts_is_refused(sshbed: Callable[[int], SshBed]) -> None:
    bed = sshbed(2)
    h0, h1 = bed.hosts
    known = bed.known_hosts_without(h0)

    async def main() -> None:
        with pytest.raises(asyncssh.HostKeyNotVerifiable):
            # the timeout only keeps a regression from hanging the test
            await asyncio.wait_for(run_on(bed, h0, "hostname", known), 30)
        assert await run_on(bed, h1, "hostname", known) == "h1\n"

    asyncio.run(main())


def test_bytes_received_counts_what_reaches_the_host(sshbed: Callable[[int], SshBed]) -> None:
    bed = sshbed(2)
    h0, h1 = bed.hosts
    before = h0.bytes_received(), h1.bytes_received()

    async def main() -> None:
        async with asyncssh.connect(
            h0.addr,
            username="root",
            client_keys=[str(bed.client_key)],
            known_hosts=str(bed.known_hosts),
            agent_path=None,
            config=None,
        ) as conn:
            r = await conn.run("cat > /dev/null; echo done", input="x" * 200_000, check=True)
            assert r.stdout == "done\n"

    asyncio.run(main())
    assert h0.bytes_received() - before[0] >= 200_000
    assert h1.bytes_received() - before[1] < 200_000  # h1 saw none of it


def test_closing_the_bed_leaves_no_sshd(tmp_path: Path) -> None:
    bed = SshBed(2, tmp=tmp_path / "bed")
    with bed:
        pids = sshd_pids(bed)
        assert len(pids) == 2
        assert {h.sshd.pid for h in bed.hosts if h.sshd} == pids

        async def hold_a_session() -> None:
            # a session left open when the bed closes: its sshd is not in the
            # listener's process group, the bed kills it all the same
            conn = await asyncssh.connect(
                bed.hosts[0].addr,
                username="root",
                client_keys=[str(bed.client_key)],
                known_hosts=str(bed.known_hosts),
                agent_path=None,
                config=None,
            )
            proc = await conn.create_process("echo $$; exec sleep 600")
            sleep = int(await proc.stdout.readline())
            assert alive(sleep)  # the session's shell, or the sleep it becomes
            bed.close()
            assert not alive(sleep)
            conn.abort()

        asyncio.run(hold_a_session())
    assert sshd_pids(bed) == set()
    assert not any(alive(p) for p in pids)
