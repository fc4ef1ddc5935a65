"""Host keys rooted in the cluster CA (issue 25, SPEC 4.7): with a CA, a host's key is
trusted only with the CA's certificate for that hostname and those keys, so a host
that starts while another is away is not fooled by keys an attacker wrote into
`hostkeys/` meanwhile; nothing is pinned on first use; a revoked certificate's key
is dropped. (Without a CA, trust on first use: tests/cluster/test_identity.py.)

The attacker here writes the World directly and holds keys of its own, and in one
case a valid certificate of the same CA for its own hostname (a member gone bad)."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from evergraph.cluster.ca import HOST_CERT, ClusterCA, cluster_dir, serial_of
from evergraph.cluster.exports import (
    HostKeyRecord,
    decode_hostkeys,
    entry_name,
    export_key,
    index_key,
    make_index,
    make_record,
    publish_hostkeys,
    record_digest,
)
from evergraph.cluster.hostbook import load_cluster_trust
from evergraph.cluster.hostkeys import HostKeys, KeyError_, identity
from evergraph.cluster.pins import fingerprint_of
from evergraph.world.kv import KV, KeyValue, Put
from evergraph.world.memory import MemoryKV, MemoryStore
from tests.conftest import run_cli
from tests.kit.exports import Host, file_params

CLUSTER = "c1"


class CAHost(Host):
    """One host of a World with a cluster CA (tests/kit/exports.py's Host with a CA);
    `told` hears the book's listeners."""

    def __init__(self, kv: KV, state: Path, name: str, ca: ClusterCA) -> None:
        super().__init__(kv, state, name, ca)
        self.told = asyncio.Queue[str]()
        self.book.listen(self.told.put_nowait)

    async def told_of(self, host: str) -> None:
        """Until the book tells its listeners about `host`."""
        async with asyncio.timeout(10):
            while await self.told.get() != host:
                pass

    async def next_change(self) -> list[Any]:
        return await asyncio.wait_for(self.changes.get(), 10)


def record(host: str, keys: HostKeys, cert: bytes = b"") -> bytes:
    return msgspec.json.encode(
        HostKeyRecord(host=host, public=keys.public, verify=keys.verify, cert=cert.decode())
    )


def refusals(caplog: pytest.LogCaptureFixture, host: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.ERROR and r.getMessage().startswith(f"hostkeys/{host}: key ")
    ]


async def put_export(
    kv: KV, keys: HostKeys, src: str, to: str, name: str, content: str, public: str
) -> None:
    """An export record and the index naming it, as an exporter's publisher writes
    them (in one txn), signed with `keys`, whoever's they are."""
    seq = 1000
    key = export_key(to, src, "file", name)
    rec = make_record(keys, src, to, "file", name, file_params(content), public, seq)
    index = make_index(keys, src, to, seq + 1, {entry_name(key): (seq, record_digest(rec))})
    await kv.txn([], [Put(key, rec), Put(index_key(to, src), index)])


# the forged `hostkeys/hostb` records: (what the attacker writes, why it is refused)
FORGERIES = [
    "no-cert",
    "another-ca",
    "another-ca-same-name",
    "b-cert-attacker-keys",
    "attacker-own-valid-cert",
]


def forge(how: str, ca: ClusterCA, b: HostKeys, b_cert: bytes, m: HostKeys) -> tuple[bytes, str]:
    if how == "no-cert":
        return record("hostb", m), "no certificate"
    if how == "another-ca":
        other = ClusterCA.new("evil")
        return record("hostb", m, other.issue_host("hostb", m.public, m.verify)), (
            "issued by another CA"
        )
    if how == "another-ca-same-name":  # same issuer name, another key
        other = ClusterCA.new(CLUSTER)
        return record("hostb", m, other.issue_host("hostb", m.public, m.verify)), (
            "not signed by this cluster's CA"
        )
    if how == "b-cert-attacker-keys":
        return record("hostb", m, b_cert), "the certificate is for another key"
    assert how == "attacker-own-valid-cert"  # a member of the cluster gone bad
    return record("hostb", m, ca.issue_host("hostm", m.public, m.verify)), (
        "the certificate is for host 'hostm'"
    )


@pytest.mark.parametrize("how", FORGERIES)
def test_a_host_starting_while_another_is_away_trusts_no_forged_key(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    """hostb published its real record, then stopped; the attacker rewrote
    `hostkeys/hostb`. hosta, starting afterwards, trusts nothing for hostb, pins
    nothing, and says why in one line naming hostb and the attacker's key."""
    ca = ClusterCA.new(CLUSTER)
    b_keys, m_keys = HostKeys(tmp_path / "b"), HostKeys(tmp_path / "m")
    b_cert = ca.issue_host("hostb", b_keys.public, b_keys.verify)
    forged, why = forge(how, ca, b_keys, b_cert, m_keys)

    async def main() -> None:
        store = MemoryStore()
        kv = MemoryKV(store)
        await publish_hostkeys(kv, b_keys, "hostb", cert=b_cert)  # hostb, before it stopped
        await kv.put("hostkeys/hostb", forged)
        a = CAHost(MemoryKV(store), tmp_path / "a", "hosta", ca)
        async with a.running():
            assert a.book.trusted("hostb") is None
            assert a.book.trusted("hosta") == a.keys.pair()

    asyncio.run(main())
    lines = refusals(caplog, "hostb")
    assert len(lines) == 1, lines
    assert fingerprint_of(identity(m_keys.public, m_keys.verify)) in lines[0]
    assert why in lines[0]
    assert not (tmp_path / "a" / "pins.json").exists()  # no trust on first use


def test_forged_keys_and_exports_are_refused_until_the_real_host_returns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """hosta runs while the attacker rewrites `hostkeys/hostb` again and again (one
    error line per change, nothing trusted) and forges an export "from hostb" signed
    with its own key: never applied. hostb comes back with its certificate: hosta
    trusts it, refuses the forged export (bad signature) and applies hostb's own."""
    ca = ClusterCA.new(CLUSTER)
    m_keys = HostKeys(tmp_path / "m")

    async def main() -> None:
        store = MemoryStore()
        kv = MemoryKV(store)
        b = CAHost(MemoryKV(store), tmp_path / "b", "hostb", ca)
        await publish_hostkeys(kv, b.keys, "hostb", cert=b.cert)  # before it stopped
        first, *others = [forge(how, ca, b.keys, b.cert, m_keys)[0] for how in FORGERIES]
        await kv.put("hostkeys/hostb", first)
        a = CAHost(MemoryKV(store), tmp_path / "a", "hosta", ca)
        async with a.running():
            assert a.book.trusted("hostb") is None
            for forged in others:
                await kv.put("hostkeys/hostb", forged)
                await a.told_of("hostb")
                assert a.book.trusted("hostb") is None
            assert len(refusals(caplog, "hostb")) == len(FORGERIES)
            # the same forged record written again is no change: no more lines
            await kv.put("hostkeys/hostb", others[-1])
            # a forged export "from hostb" to hosta, signed by the attacker
            await put_export(kv, m_keys, "hostb", "hosta", "evil", "pwn\n", a.keys.public)
            async with asyncio.timeout(10):
                while "hostb" not in a.collector._pending:
                    await asyncio.sleep(0)
            assert a.collector.current() == []
            # hostb returns: its own record (with its certificate) replaces the forgery
            async with b.running():
                await a.told_of("hostb")
                assert a.book.trusted("hostb") == b.keys.pair()
                b.publisher.set([("hosta", "file", "conf", file_params("real\n"))])
                found = await a.next_change()
                while [e.name for e in found] != ["conf"]:
                    found = await a.next_change()
                assert [(e.src, e.params["content"]) for e in found] == [("hostb", "real\n")]
                # and hostb, now up, trusts hosta by its certificate too
                assert b.book.trusted("hosta") == a.keys.pair()
        assert not (tmp_path / "a" / "pins.json").exists()

    caplog.set_level(logging.DEBUG, logger="evergraph.exports")
    asyncio.run(main())
    assert len(refusals(caplog, "hostb")) == len(FORGERIES)
    assert "rejected export" in caplog.text
    assert "bad signature" in caplog.text
    assert "trusting the key of host hostb" in caplog.text


def test_a_revoked_certificate_drops_its_key_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`cluster remove hostb` revokes hostb's certificate: on `recheck()` hosta drops
    hostb's key (and so its exports) at once, though the record is unchanged; a
    host that starts with the revocation known never trusts it."""
    ca = ClusterCA.new(CLUSTER)

    async def main() -> None:
        store = MemoryStore()
        a = CAHost(MemoryKV(store), tmp_path / "a", "hosta", ca)
        b = CAHost(MemoryKV(store), tmp_path / "b", "hostb", ca)
        async with a.running(), b.running():
            await a.told_of("hostb")
            assert a.book.trusted("hostb") == b.keys.pair()
            b.publisher.set([("hosta", "file", "conf", file_params("v1\n"))])
            while [e.name for e in await a.next_change()] != ["conf"]:
                pass
            a.book.recheck()  # nothing revoked: nothing changes
            assert a.book.trusted("hostb") == b.keys.pair()
            a.revoked.add(serial_of(b.cert))
            a.book.recheck()
            assert a.book.trusted("hostb") is None
            assert await a.next_change() == []  # its export is no longer applied
            c = CAHost(MemoryKV(store), tmp_path / "c", "hostc", ca)
            c.revoked.add(serial_of(b.cert))
            async with c.running():
                assert c.book.trusted("hostb") is None
                assert c.book.trusted("hosta") == a.keys.pair()

    asyncio.run(main())
    dropped = [r.getMessage() for r in caplog.records if "no longer trusted" in r.getMessage()]
    assert len(dropped) == 1
    assert "hostb" in dropped[0]
    assert any("revoked" in line for line in refusals(caplog, "hostb"))


def test_an_explicit_pin_still_wins_over_the_world_with_a_ca(tmp_path: Path) -> None:
    """`hosts trust NAME KEY` is the operator's word: it holds with a CA too, even for
    a key without a certificate (a host from outside the cluster); a pin made on
    first use does not."""
    ca = ClusterCA.new(CLUSTER)
    x_keys = HostKeys(tmp_path / "x")

    async def main() -> None:
        store = MemoryStore()
        kv = MemoryKV(store)
        await kv.put("hostkeys/hostx", record("hostx", x_keys))
        a = CAHost(MemoryKV(store), tmp_path / "a", "hosta", ca)
        async with a.running():
            assert a.book.trusted("hostx") is None
            # a pin made on first use (before the World had a CA) is not the CA's word
            a.pins.check("hostx", x_keys.public, x_keys.verify)
            assert a.book.trusted("hostx") is None
            a.pins.trust("hostx", identity(x_keys.public, x_keys.verify))
            assert a.book.trusted("hostx") == x_keys.pair()

    asyncio.run(main())


def test_the_book_puts_back_its_own_record_with_its_certificate(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A record of ours that lost its certificate (same keys) counts as changed: the
    book puts it back with the certificate, with one ALARM line."""
    ca = ClusterCA.new(CLUSTER)

    async def main() -> None:
        store = MemoryStore()
        kv = MemoryKV(store)
        a = CAHost(MemoryKV(store), tmp_path / "a", "hosta", ca)
        async with a.running():
            await kv.put("hostkeys/hosta", record("hosta", a.keys))  # the certificate stripped
            # (seen: the stripped record, then ours put back)
            while a.book.alarms == 0 or a.book.seen["hosta"].cert != a.cert.decode():
                await a.told_of("hosta")
            assert a.book.alarms == 1

    asyncio.run(main())
    alarms = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ALARM")]
    assert len(alarms) == 1
    assert "without its certificate" in alarms[0]


def test_a_record_without_a_certificate_is_what_it_was() -> None:
    """Records of a World without a CA keep their bytes (no `cert` field), and records
    written before the field existed still decode."""
    old = b'{"host":"h","public":"cA==","verify":"dg=="}'
    rec = decode_hostkeys(KeyValue("hostkeys/h", old, 1, 1))
    assert rec == HostKeyRecord(host="h", public="cA==", verify="dg==")
    assert rec.cert == ""
    assert msgspec.json.encode(rec) == old
    with_cert = HostKeyRecord(host="h", public="cA==", verify="dg==", cert="PEM")
    assert decode_hostkeys(KeyValue("hostkeys/h", msgspec.json.encode(with_cert), 1, 1)) == (
        with_cert
    )


def test_the_agent_loads_the_ca_and_its_host_certificate_from_its_state_dir(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    assert load_cluster_trust(state) == (None, None)  # no CA: trust on first use
    ca = ClusterCA.new(CLUSTER)
    directory = cluster_dir(state)
    directory.mkdir(parents=True)
    ca.save(directory)
    got, cert = load_cluster_trust(state)
    assert got is not None
    assert got.fingerprint == ca.fingerprint
    assert cert is None  # not certified yet
    keys = HostKeys(state)
    pem = ca.issue_host("h", keys.public, keys.verify)
    (directory / HOST_CERT).write_bytes(pem)
    assert load_cluster_trust(state)[1] == pem
    (directory / "ca.crt").write_bytes(b"garbage")
    with pytest.raises(KeyError_, match="cluster CA"):
        load_cluster_trust(state)


def test_a_cluster_ca_without_cryptography_is_one_line_naming_the_file(tmp_path: Path) -> None:
    """A remote agent's lean bundle has no cryptography: a state dir with a cluster
    CA is then one line naming the CA file and what to do, not an ImportError."""
    state = tmp_path / "state"
    directory = cluster_dir(state)
    directory.mkdir(parents=True)
    ClusterCA.new(CLUSTER).save(directory)
    code = (
        "import sys; sys.modules['cryptography'] = None\n"  # what a lean bundle lacks
        "from pathlib import Path\n"
        "from evergraph.cluster.hostbook import load_cluster_trust\n"
        "from evergraph.cluster.hostkeys import KeyError_\n"
        "try:\n"
        f"    load_cluster_trust(Path({str(state)!r}))\n"
        "except KeyError_ as e:\n"
        "    print(e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip()
    assert "\n" not in line
    assert line.startswith(f"{directory / 'ca.crt'}: a cluster CA needs the cryptography package")
    assert "remote --install" in line


def test_an_agent_with_a_cluster_ca_publishes_its_key_with_its_certificate(
    tmp_path: Path,
) -> None:
    """The agent's join reads `<state>/cluster/` (ca.crt, host.crt) and writes its
    certificate into `hostkeys/<me>`; a damaged CA file is one line and exit 2."""
    from evergraph.world.sqlite import SQLiteKV

    ca = ClusterCA.new(CLUSTER)
    state, db = tmp_path / "state", tmp_path / "world.sqlite"
    directory = cluster_dir(state)
    directory.mkdir(parents=True)
    ca.save(directory)
    keys = HostKeys(state)
    pem = ca.issue_host("hosta", keys.public, keys.verify)
    (directory / HOST_CERT).write_bytes(pem)
    g = tmp_path / "g.yaml"
    g.write_text("resources:\n  noop:\n  - name: n\n")
    argv = ("run", g, "--converged-exit", "--state-dir", state, "--world-db", db)
    r = run_cli(*argv, "--hostname", "hosta")
    assert r.returncode == 0, r.stderr

    async def read() -> KeyValue | None:
        kv = SQLiteKV(db)
        try:
            return await kv.get("hostkeys/hosta")
        finally:
            await kv.close()

    got = asyncio.run(read())
    assert got is not None
    rec = decode_hostkeys(got)
    assert (rec.public, rec.verify, rec.cert) == (keys.public, keys.verify, pem.decode())
    (directory / "ca.crt").write_bytes(b"garbage")
    r = run_cli(*argv, "--hostname", "hosta")
    assert r.returncode == 2
    assert "cluster CA" in r.stderr
    assert "Traceback" not in r.stderr
