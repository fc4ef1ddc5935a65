"""Members that join a running etcd cluster: MemberAdd as a learner, an EtcdServer
started with cluster_state="existing", catching up, promotion, removal (the
removed process exits and says so), and a removed member that wipes its data
and joins again on the same name and ports; over TLS with client certificates
and a CRL too. Real etcd processes on loopback, data on /dev/shm."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from evergraph.world.etcd import EtcdKV
from evergraph.world.etcd_cluster import (
    EtcdMember,
    LearnerNotReady,
    MemberBusy,
    NoSuchMember,
    initial_cluster,
    member_add,
    member_list,
    member_promote,
    member_remove,
    member_status,
)
from evergraph.world.etcd_server import (
    FAST_TIMING,
    EtcdServer,
    MemberRemoved,
    ServerTLS,
    free_port,
)
from evergraph.world.kv import WorldError
from tests.conftest import wait_for

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd-server not installed")

T = TypeVar("T")


def run(body: Callable[[], Awaitable[None]], timeout: float = 90) -> None:
    async def main() -> None:
        await asyncio.wait_for(body(), timeout)

    asyncio.run(main())


async def retrying(
    step: Callable[[], Awaitable[T]], *errors: type[Exception], timeout: float = 20
) -> T:
    """`step()` again while it raises one of `errors` (a state etcd leaves in time)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await step()
        except errors:
            if time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.05)


async def caught_up(kv: EtcdKV, leader: EtcdServer, member: EtcdServer) -> None:
    """Until the member's raft index has reached the leader's (as it was when asked)."""
    target = await member_status(kv, leader.client_url)
    assert target is not None
    deadline = time.monotonic() + 20
    while True:
        st = await member_status(kv, member.client_url)
        if st is not None and st.raft_index >= target.raft_index:
            return
        assert time.monotonic() < deadline, f"{member.name} did not catch up: {st}"
        await asyncio.sleep(0.02)


async def started(server: EtcdServer) -> None:
    """Spawn from the loop's thread (etcd's parent-death signal follows the thread
    that started it), wait for health in another."""
    server.spawn()
    await asyncio.to_thread(server.wait_healthy)


def joiner(base: Path, name: str, members: list[EtcdMember], **kw: object) -> EtcdServer:
    """An EtcdServer for the member MemberAdd just added at kw["peer_url"]."""
    peer_url = str(kw["peer_url"])
    return EtcdServer(
        base / name,
        name=name,
        timing=FAST_TIMING,
        cluster_state="existing",
        initial_cluster=initial_cluster(members, name, peer_url),
        **kw,  # type: ignore[arg-type]
    )


def loopback_urls(scheme: str = "http") -> tuple[str, str]:
    return f"{scheme}://127.0.0.1:{free_port()}", f"{scheme}://127.0.0.1:{free_port()}"


# -- no process ----------------------------------------------------------------------
def test_advertised_urls_are_checked_against_tls(tmp_path: Path) -> None:
    tls = ServerTLS(tmp_path / "c", tmp_path / "k", tmp_path / "ca")
    with pytest.raises(WorldError, match=r"client URL 'http://h:1' must be https:// \(TLS is"):
        EtcdServer(tmp_path, client_url="http://h:1", tls=tls)
    with pytest.raises(WorldError, match=r"peer URL 'https://h:1' must be http:// \(no TLS"):
        EtcdServer(tmp_path, peer_url="https://h:1")
    with pytest.raises(WorldError, match=r"bad etcd client URL 'h:1'"):
        EtcdServer(tmp_path, client_url="h:1")
    with pytest.raises(WorldError, match="an etcd CRL needs TLS"):
        EtcdServer(tmp_path, crl=tmp_path / "crl.pem")
    with pytest.raises(WorldError, match="cluster state 'old': expected new or existing"):
        EtcdServer(tmp_path, cluster_state="old")
    s = EtcdServer.embedded(
        tmp_path,
        name="n1",
        client_url="https://node1.example:2379",
        peer_url="https://10.1.2.3:2390",
        tls=tls,
        crl=tmp_path / "crl.pem",
        cluster_state="existing",
        initial_cluster="n0=https://10.1.2.2:2380,n1=https://10.1.2.3:2390",
    )
    assert (s.client_url, s.peer_url) == ("https://node1.example:2379", "https://10.1.2.3:2390")
    argv = s._argv()
    # a DNS name listens on every address (etcd binds IPs only); an IP on itself
    assert "--listen-client-urls=https://0.0.0.0:2379" in argv
    assert "--listen-peer-urls=https://10.1.2.3:2390" in argv
    assert "--initial-cluster-state=existing" in argv
    assert "--initial-cluster=n0=https://10.1.2.2:2380,n1=https://10.1.2.3:2390" in argv
    assert f"--client-crl-file={tmp_path / 'crl.pem'}" in argv
    assert f"--peer-crl-file={tmp_path / 'crl.pem'}" in argv
    assert not s.has_member_data()
    # today's embedded member: unchanged
    plain = EtcdServer.embedded(tmp_path)
    assert (plain.name, plain.client_url, plain.peer_url) == (
        "evergraph",
        "http://127.0.0.1:2379",
        "http://127.0.0.1:2380",
    )
    assert "--initial-cluster-state=new" in plain._argv()


# -- real members ----------------------------------------------------------------------
def test_wait_started_needs_no_quorum_and_a_failed_join_is_an_error(
    shm: Path, servers: list[EtcdServer]
) -> None:
    """A member restarting while most of its cluster is down is up, not healthy;
    a member that cannot reach the cluster it should join exits, and says why."""
    a, b = EtcdServer.cluster(2, shm)
    servers += [a, b]
    a.spawn()
    a.wait_started(10)
    with pytest.raises(WorldError, match=r"not healthy within 0.2 s \(HTTP 503\)"):
        a.wait_healthy(0.2)
    a.stop()
    lonely = EtcdServer(shm / "j", name="j", timing=FAST_TIMING, cluster_state="existing")
    servers.append(lonely)
    lonely.initial_cluster = f"x=http://127.0.0.1:{free_port()},j={lonely.peer_url}"
    lonely.spawn()
    failed = r"(?s)etcd j exited with status 1.*cannot fetch cluster info"
    with pytest.raises(WorldError, match=failed):
        lonely.wait_started(10)
    assert not lonely.removed()


@pytest.mark.slow
def test_a_learner_joins_catches_up_is_promoted_and_removed(
    shm: Path, servers: list[EtcdServer]
) -> None:
    m0 = EtcdServer.single(shm / "m0", name="m0")
    servers.append(m0)
    m0.start()

    async def body() -> None:
        kv = EtcdKV([m0.client_url], timeout=5)
        for i in range(50):  # a log for the learner to catch up with
            await kv.put(f"k{i}", b"v" * 1000)
        client_url, peer_url = loopback_urls()
        new, members = await member_add(kv, [peer_url], learner=True)
        assert (new.name, new.peer_urls, new.is_learner) == ("", (peer_url,), True)
        assert {m.id for m in members} == {new.id, *(m.id for m in await member_list(kv))}
        # etcd admits one learner at a time
        with pytest.raises(MemberBusy, match="too many learner members"):
            await member_add(kv, [f"http://127.0.0.1:{free_port()}"], learner=True)
        assert initial_cluster(members, "m1", peer_url) == f"m0={m0.peer_url},m1={peer_url}"
        m1 = joiner(shm, "m1", members, client_url=client_url, peer_url=peer_url)
        servers.append(m1)
        await started(m1)  # a learner is healthy as soon as it has a leader
        assert m1.has_member_data()
        await caught_up(kv, m0, m1)
        st = await member_status(kv, m1.client_url)
        assert st is not None
        assert (st.id, st.is_learner) == (new.id, True)
        assert st.leader == (await member_status(kv, m0.client_url) or st).id
        listed = await member_list(kv)
        assert [(m.name, m.is_learner) for m in listed] == [("m0", False), ("m1", True)]
        assert next(m for m in listed if m.name == "m1").client_urls == (client_url,)

        after = await retrying(lambda: member_promote(kv, new.id), LearnerNotReady)
        assert [(m.name, m.is_learner) for m in after] == [("m0", False), ("m1", False)]
        assert [(m.name, m.is_learner) for m in await member_list(kv)] == [
            ("m0", False),
            ("m1", False),
        ]
        # a promotion asked again (its answer lost) finds the voter: no error
        assert await member_promote(kv, new.id) == after
        with pytest.raises(NoSuchMember, match="member not found"):
            await member_remove(kv, 0x1234)
        with pytest.raises(NoSuchMember):
            await member_promote(kv, 0x1234)

        # a voter is removed once both have been connected a while (etcd: 5 s)
        left = await retrying(lambda: member_remove(kv, new.id), MemberBusy)
        assert [m.name for m in left] == ["m0"]
        await asyncio.to_thread(wait_for, lambda: not m1.running, 15, "m1 to exit")
        assert m1.removed()
        assert not m0.removed()
        # restarted on its stale data it is told again, and says so
        with pytest.raises(MemberRemoved, match="m1 was removed from its cluster"):
            await started(m1)
        assert m1.removed()
        await kv.put("still", b"writable")
        await kv.close()

    run(body)


def test_a_removed_member_wipes_its_data_and_joins_again_on_the_same_ports(
    shm: Path, servers: list[EtcdServer]
) -> None:
    m0 = EtcdServer.single(shm / "m0", name="m0")
    servers.append(m0)
    m0.start()
    client_url, peer_url = loopback_urls()
    m1 = EtcdServer(
        shm / "m1",
        name="m1",
        timing=FAST_TIMING,
        client_url=client_url,
        peer_url=peer_url,
        cluster_state="existing",
    )
    servers.append(m1)

    async def body() -> None:
        kv = EtcdKV([m0.client_url], timeout=5)
        for round in range(3):
            await kv.put("round", str(round).encode())
            # (within a second of the last removal etcd would give the removed id)
            new, members = await retrying(
                lambda: member_add(kv, [peer_url], learner=True), MemberBusy
            )
            m1.initial_cluster = initial_cluster(members, "m1", peer_url)
            assert not m1.has_member_data()
            await started(m1)
            assert not m1.removed()
            await caught_up(kv, m0, m1)
            listed = await member_list(kv)
            assert [(m.name, m.id, m.is_learner) for m in listed] == [
                ("m0", listed[0].id, False),
                ("m1", new.id, True),
            ]
            # a learner goes at once (no quorum to keep)
            assert [m.name for m in await member_remove(kv, new.id)] == ["m0"]
            await asyncio.to_thread(wait_for, lambda: not m1.running, 15, "m1 to exit")
            assert m1.removed(), m1.log_tail()
            assert m1.has_member_data()
            with pytest.raises(WorldError, match="etcd is running"):
                m0.wipe()
            m1.wipe()
            assert not m1.has_member_data()
            m1.wipe()  # nothing to remove: fine
        await kv.close()

    run(body)


# -- TLS -------------------------------------------------------------------------------
class _PKI:
    """A throwaway CA, certificates it signs for loopback, and its CRL."""

    def __init__(self, d: Path) -> None:
        self.d = d
        d.mkdir(parents=True)
        now = datetime.datetime.now(datetime.UTC)
        self.valid = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1))
        self.key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test cluster CA")])
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(self.valid[0])
            .not_valid_after(self.valid[1])
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.ca = d / "ca.crt"
        self.ca.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, cn: str) -> tuple[Path, Path, int]:
        """A node certificate (server + client auth, for 127.0.0.1): cert, key, serial."""
        key = ec.generate_private_key(ec.SECP256R1())
        usage = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        serial = x509.random_serial_number()
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(serial)
            .not_valid_before(self.valid[0])
            .not_valid_after(self.valid[1])
            .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
            .add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False,
            )
            .sign(self.key, hashes.SHA256())
        )
        (self.d / f"{cn}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (self.d / f"{cn}.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return self.d / f"{cn}.crt", self.d / f"{cn}.key", serial

    def crl(self, *revoked: int) -> Path:
        b = (
            x509.CertificateRevocationListBuilder()
            .issuer_name(self.cert.subject)
            .last_update(self.valid[0])
            .next_update(self.valid[1])
        )
        for serial in revoked:
            b = b.add_revoked_certificate(
                x509.RevokedCertificateBuilder()
                .serial_number(serial)
                .revocation_date(self.valid[0])
                .build()
            )
        path = self.d / "crl.pem"
        path.write_bytes(b.sign(self.key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
        return path


def test_a_member_joins_over_tls_with_client_certificates_and_a_crl(
    shm: Path, servers: list[EtcdServer]
) -> None:
    pki = _PKI(shm / "pki")
    n0_cert, n0_key, _ = pki.issue("n0")
    n1_cert, n1_key, _ = pki.issue("n1")
    gone_cert, gone_key, gone_serial = pki.issue("gone")
    crl = pki.crl()  # nothing revoked yet

    def tls(cert: Path, key: Path) -> ServerTLS:
        return ServerTLS(cert=cert, key=key, ca=pki.ca, client_cert_auth=True)

    c0, p0 = loopback_urls("https")
    m0 = EtcdServer(
        shm / "n0",
        name="n0",
        client_url=c0,
        peer_url=p0,
        tls=tls(n0_cert, n0_key),
        crl=crl,
        timing=FAST_TIMING,
    )
    servers.append(m0)
    m0.start()

    async def body() -> None:
        kv = EtcdKV([m0.client_url], ca=pki.ca, cert=n0_cert, key=n0_key, timeout=5)
        await kv.put("k", b"v")
        c1, p1 = loopback_urls("https")
        new, members = await member_add(kv, [p1], learner=True)
        m1 = EtcdServer.embedded(
            shm / "n1",
            name="n1",
            client_url=c1,
            peer_url=p1,
            tls=tls(n1_cert, n1_key),
            crl=crl,
            cluster_state="existing",
            initial_cluster=initial_cluster(members, "n1", p1),
        )
        servers.append(m1)
        await started(m1)
        await caught_up(kv, m0, m1)
        st = await member_status(kv, c1)
        assert st is not None
        assert (st.id, st.is_learner) == (new.id, True)
        after = await retrying(lambda: member_promote(kv, new.id), LearnerNotReady)
        assert [(m.name, m.is_learner) for m in after] == [("n0", False), ("n1", False)]
        # the new voter serves the World to a client that knows only it
        only_n1 = EtcdKV([c1], ca=pki.ca, cert=n1_cert, key=n1_key, timeout=5)
        got = await only_n1.get("k")
        assert got is not None
        assert got.value == b"v"
        await only_n1.close()
        # etcd reads the CRL at each connection: a certificate revoked now is
        # refused from the next one on, without a restart
        gone = EtcdKV([c1], ca=pki.ca, cert=gone_cert, key=gone_key, timeout=2)
        assert await gone.get("k") is not None
        await gone.close()
        pki.crl(gone_serial)
        revoked = EtcdKV([c1], ca=pki.ca, cert=gone_cert, key=gone_key, timeout=2)
        with pytest.raises(WorldError, match=f"etcd at {c1} is not reachable"):
            await revoked.get("k")
        assert await member_status(revoked, c1) is None  # (etcd just drops it)
        await revoked.close()
        assert any("revoked" in line for line in m1.log_tail())
        anonymous = EtcdKV([c1], ca=pki.ca, timeout=2)
        with pytest.raises(WorldError, match="TLS handshake failed"):
            await member_status(anonymous, c1)
        await anonymous.close()
        # a member that is down has no status
        m1.kill()
        assert await member_status(kv, c1) is None
        await kv.close()

    run(body)
