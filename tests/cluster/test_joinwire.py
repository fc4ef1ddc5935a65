"""The join protocol over real TLS on 127.0.0.1: a good join's certificates, each
refusal in one line, hostile clients that leave the service serving, a seed of
another cluster refused by the joiner, and the secret in no log."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from evergraph._util.clock import SYSTEM, Clock
from evergraph.cluster import joinwire
from evergraph.cluster.ca import ClusterCA, new_node_key, read_host_cert, serial_of
from evergraph.cluster.hostkeys import HostKeys
from evergraph.cluster.jointokens import JoinToken, create_token, revoke_token
from evergraph.cluster.joinwire import (
    JoinGrant,
    JoinRefused,
    JoinRequest,
    JoinServer,
    JoinUnreachable,
    join_port,
    request_join,
)
from evergraph.testing.clock import FakeClock
from evergraph.world.kv import WorldError
from evergraph.world.memory import MemoryKV

CA = ClusterCA.new("c1")
OTHER = ClusterCA.new("c2")


@dataclass
class Seed:
    kv: MemoryKV
    ca: ClusterCA
    cert: Path
    key: Path
    granted: list[JoinRequest]

    def server(
        self,
        scheme: str = "https",
        endpoints: list[str] | None = None,
        clock: Clock = SYSTEM,
        port: int = 0,
        cert: Path | None = None,
        on_grant: Callable[[JoinRequest], Awaitable[None]] | None = None,
    ) -> JoinServer:
        async def record(req: JoinRequest) -> None:
            self.granted.append(req)

        urls = endpoints or [f"{scheme}://127.0.0.1:2379"]
        return JoinServer(
            self.kv,
            self.ca,
            cert or self.cert,
            self.key,
            "127.0.0.1",
            port,
            scheme,
            lambda: urls,
            lambda: self.ca.crl([7]),
            on_grant or record,
            clock,
        )


def _seed(tmp: Path, ca: ClusterCA = CA, cert_ca: ClusterCA | None = None) -> Seed:
    """A member's state: its node key and a node certificate (from `cert_ca`,
    normally its own CA)."""
    d = tmp / "seed"
    d.mkdir(exist_ok=True)
    public = new_node_key(d / "node.key")
    (d / "node.crt").write_bytes((cert_ca or ca).issue_node("seed", public, ["127.0.0.1"]))
    return Seed(MemoryKV(), ca, d / "node.crt", d / "node.key", [])


@contextlib.asynccontextmanager
async def _serving(server: JoinServer) -> AsyncIterator[str]:
    """Run `server`; yields the client URL whose join port it listens on."""
    task = asyncio.create_task(server.run())
    ready = asyncio.create_task(server.ready.wait())
    await asyncio.wait([task, ready], return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        ready.cancel()
        task.result()
    try:
        yield f"https://127.0.0.1:{server.port - 2}"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@dataclass
class Joiner:
    keys: HostKeys
    node_key: bytes
    key_path: Path

    def fields(self, **over: Any) -> dict[str, Any]:
        f: dict[str, Any] = {
            "name": "joiner",
            "peer_url": "https://127.0.0.1:12380",
            "client_url": "https://127.0.0.1:12379",
            "node_key": self.node_key,
            "public": self.keys.public,
            "verify": self.keys.verify,
        }
        f.update(over)
        return f


def _joiner(tmp: Path) -> Joiner:
    d = tmp / "joiner"
    d.mkdir(exist_ok=True)
    return Joiner(HostKeys(d), new_node_key(d / "node.key"), d / "node.key")


async def _refused(seed_url: str, token: JoinToken, joiner: Joiner, **over: Any) -> str:
    with pytest.raises(JoinRefused) as e:
        await request_join(seed_url, token, **joiner.fields(**over))
    why = str(e.value)
    assert "\n" not in why
    assert token.secret not in why
    return why


def _tls_client() -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


@contextlib.asynccontextmanager
async def _raw(
    server: JoinServer, tls: bool = True
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", server.port, ssl=_tls_client() if tls else None, limit=2**21
    )
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


def test_join_port_is_the_client_port_plus_two() -> None:
    assert join_port("https://10.0.0.1:2379") == 2381
    with pytest.raises(ValueError, match="is not http"):
        join_port("https://10.0.0.1")


def test_a_good_join_gets_certificates_that_verify_against_the_ca(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    seed = _seed(tmp_path)
    joiner = _joiner(tmp_path)
    out = tmp_path / "granted"
    out.mkdir()

    async def go() -> tuple[JoinToken, JoinGrant]:
        token = await create_token(seed.kv, CA, 600)
        async with _serving(seed.server()) as url:
            grant = await request_join(url, token, **joiner.fields())
        (out / "ca.crt").write_text(grant.ca)
        (out / "node.crt").write_text(grant.node_cert)
        # the granted node certificate serves TLS that a client verifying against
        # the CA (and the address 127.0.0.1) accepts
        granted = Seed(seed.kv, CA, out / "node.crt", joiner.key_path, [])
        async with _serving(granted.server()) as url2:
            verifying = ssl.create_default_context(cafile=out / "ca.crt")
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", join_port(url2), ssl=verifying, server_hostname="127.0.0.1"
            )
            assert b'"ca"' in await reader.readline()
            writer.close()
            await writer.wait_closed()
        return token, grant

    token, grant = asyncio.run(go())
    node = x509.load_pem_x509_certificate(grant.node_cert.encode())
    assert CA.issued(node) is None
    san = node.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "127.0.0.1" in [str(ip) for ip in san.get_values_for_type(x509.IPAddress)]
    hc = read_host_cert(grant.host_cert.encode())
    assert (hc.hostname, hc.public, hc.verify) == ("joiner", joiner.keys.public, joiner.keys.verify)
    assert CA.check_host_cert(grant.host_cert.encode(), "joiner", hc.public, hc.verify) is None
    assert ClusterCA.from_pem(grant.ca.encode(), grant.ca_key.encode()).can_sign
    crl = x509.load_pem_x509_crl(grant.crl.encode())
    assert crl.get_revoked_certificate_by_serial_number(7) is not None
    assert grant.endpoints == ["https://127.0.0.1:2379"]
    assert [r.name for r in seed.granted] == ["joiner"]
    assert serial_of(grant.node_cert.encode()) != serial_of(grant.host_cert.encode())
    assert "BEGIN" not in repr(grant)
    assert token.secret not in repr(seed.granted[0])
    assert token.secret not in caplog.text
    assert "join of 'joiner' from 127.0.0.1:" in caplog.text


def test_each_refusal_is_one_line_and_the_secret_is_in_no_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    clock = FakeClock(epoch=1_800_000_000.0)
    seed = _seed(tmp_path)
    joiner = _joiner(tmp_path)
    p384 = ec.generate_private_key(ec.SECP384R1()).public_key()
    ed = ed25519.Ed25519PrivateKey.generate().public_key()
    pem = serialization.Encoding.PEM
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    secrets: list[str] = []

    async def go() -> dict[str, str]:
        token = await create_token(seed.kv, CA, 600, clock)
        secrets.append(token.secret)
        refusals: dict[str, str] = {}
        async with _serving(seed.server(clock=clock)) as url:

            async def why(tok: JoinToken = token, **over: Any) -> str:
                return await _refused(url, tok, joiner, **over)

            refusals["wrong secret"] = await why(JoinToken(CA.fingerprint, token.id, "A" * 43))
            refusals["unknown"] = await why(JoinToken(CA.fingerprint, "0123456789ab", "A" * 43))
            refusals["another cluster"] = await why(
                JoinToken(OTHER.fingerprint, token.id, "A" * 43)
            )
            refusals["bad name"] = await why(name="Bad_Name")
            refusals["name with a slash"] = await why(name="../members")
            refusals["http on a network"] = await why(peer_url="http://10.1.2.3:2380")
            refusals["http to an https cluster"] = await why(peer_url="http://127.0.0.1:2380")
            refusals["no port"] = await why(client_url="https://127.0.0.1")
            refusals["a path"] = await why(client_url="https://127.0.0.1:1/x")
            refusals["not http"] = await why(peer_url="ftp://127.0.0.1:21")
            refusals["garbage node key"] = await why(node_key="garbage")
            refusals["P-384 node key"] = await why(node_key=p384.public_bytes(pem, spki))
            refusals["ed25519 node key"] = await why(node_key=ed.public_bytes(pem, spki))
            refusals["bad verify key"] = await why(verify="not base64!")
            refusals["short public key"] = await why(public="AAAA")
            await request_join(url, token, **joiner.fields())  # still good
            await clock.advance(600)
            refusals["expired"] = await why()
            fresh = await create_token(seed.kv, CA, 600, clock)
            secrets.append(fresh.secret)
            await revoke_token(seed.kv, CA, fresh.id)
            refusals["revoked"] = await why(fresh)
        return refusals

    refusals = asyncio.run(go())
    seed_says = "the join service of https://127.0.0.1:"
    expected = {
        "wrong secret": "refused the join: wrong secret for join token",
        "unknown": "refused the join: unknown join token id 0123456789ab",
        "another cluster": (
            f"this token is for another cluster (CA {OTHER.fingerprint[:16]}…), "
            f"the seed's CA is {CA.fingerprint[:16]}…"
        ),
        "bad name": "refused the join: 'Bad_Name' is not a valid hostname",
        "name with a slash": "refused the join: '../members' is not a valid hostname",
        "http on a network": (
            "refused the join: joining over a network needs TLS: use https:// URLs"
        ),
        "http to an https cluster": (
            "refused the join: the cluster uses https:// URLs; the peer URL is http://"
        ),
        "no port": "refused the join: client URL 'https://127.0.0.1' is not http(s)://host:port",
        "a path": "is not http(s)://host:port",
        "not http": "peer URL 'ftp://127.0.0.1:21' is not http(s)://host:port",
        "garbage node key": "refused the join: the node key is not an EC P-256 public key",
        "P-384 node key": "the node key is not an EC P-256 public key",
        "ed25519 node key": "the node key is not an EC P-256 public key",
        "bad verify key": "refused the join: the host verify key is not an ed25519 key: not base64",
        "short public key": "the host public key is not an x25519 key: 3 bytes; a key is 32",
        "expired": "expired at 2027-01-15 08:10:00 UTC",
        "revoked": "was revoked",
    }
    assert set(refusals) == set(expected)
    for case, why in refusals.items():
        assert expected[case] in why, case
        if case != "another cluster":  # the joiner's own check
            assert why.startswith(seed_says), case
    assert [r.name for r in seed.granted] == ["joiner"]
    for secret in secrets:
        assert secret not in caplog.text
    assert "join of 'Bad_Name' from 127.0.0.1:" in caplog.text
    assert "refused: joining over a network needs TLS" in caplog.text


def test_http_joins_only_on_loopback(tmp_path: Path) -> None:
    seed = _seed(tmp_path)
    joiner = _joiner(tmp_path)
    plain = {"peer_url": "http://127.0.0.1:12380", "client_url": "http://localhost:12379"}

    async def go() -> None:
        token = await create_token(seed.kv, CA, 600)
        async with _serving(seed.server("http")) as url:
            grant = await request_join(url, token, **joiner.fields(**plain))
            assert grant.endpoints == ["http://127.0.0.1:2379"]
            why = await _refused(url, token, joiner, client_url="http://10.1.2.3:2379")
            assert why.endswith("joining over a network needs TLS: use https:// URLs")
            why = await _refused(url, token, joiner, **{**plain, "peer_url": "https://127.0.0.1:1"})
            assert why.endswith("the cluster uses http:// URLs; the peer URL is https://")
        # the joiner is on loopback, but a member of the cluster is not
        lan = seed.server("http", endpoints=["http://127.0.0.1:2379", "http://10.0.0.2:2379"])
        async with _serving(lan) as url:
            why = await _refused(url, token, joiner, **plain)
            assert why.endswith("joining over a network needs TLS: use https:// URLs")

    asyncio.run(go())


def test_hostile_clients_leave_the_service_serving(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    clock = FakeClock()
    seed = _seed(tmp_path)
    joiner = _joiner(tmp_path)

    async def go() -> None:
        token = await create_token(seed.kv, CA, 600, clock)
        server = seed.server(clock=clock)

        async def join_ok() -> None:
            await request_join(url, token, **joiner.fields())

        async with _serving(server) as url:
            # a garbage line: one refusal line back
            async with _raw(server) as (reader, writer):
                assert b'"ca"' in await reader.readline()
                writer.write(b"garbage\n")
                answer = await reader.readline()
                assert b'"ok":false' in answer
                assert b"malformed join request" in answer
                assert answer.count(b"\n") == 1
            # a 1 MB line: refused (or cut off), never read whole
            async with _raw(server) as (reader, writer):
                await reader.readline()
                writer.write(b"x" * 1_000_000 + b"\n")
                with contextlib.suppress(ConnectionError):
                    answer = await reader.readline()
                    assert answer == b"" or b"longer than 65536 bytes" in answer
            await join_ok()
            # clients that send nothing (over TLS, or not even a TLS handshake) do
            # not hold up the others; the silent TLS one is cut off after 10 s
            async with _raw(server) as (silent, _), _raw(server, tls=False):
                assert b'"ca"' in await silent.readline()
                await join_ok()
                await clock.advance(10)
                assert await silent.read() == b""
            assert "no request within 10 s: closed" in caplog.text
            assert "refused: join request longer than 65536 bytes" in caplog.text
            # clients that close early: before the hello, and half-way through a line
            async with _raw(server):
                pass
            async with _raw(server) as (reader, writer):
                await reader.readline()
                writer.write(b'{"token_id":')
            await join_ok()
        assert len(seed.granted) == 3

    asyncio.run(go())


def test_connections_beyond_the_limit_are_closed_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(joinwire, "MAX_CONNECTIONS", 1)
    clock = FakeClock()
    seed = _seed(tmp_path)
    joiner = _joiner(tmp_path)

    async def go() -> None:
        token = await create_token(seed.kv, CA, 600, clock)
        server = seed.server(clock=clock)
        async with _serving(server) as url:
            async with _raw(server) as (silent, _):
                assert b'"ca"' in await silent.readline()
                with pytest.raises(JoinUnreachable):
                    await request_join(url, token, **joiner.fields())
                await clock.advance(10)  # the silent one is cut off: room again
                assert await silent.read() == b""
            await request_join(url, token, **joiner.fields())

    asyncio.run(go())


def test_a_seed_of_another_cluster_is_refused_before_the_secret_leaves(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    joiner = _joiner(tmp_path)
    token_kv = MemoryKV()

    async def go() -> tuple[str, str]:
        token = await create_token(token_kv, CA, 600)
        # an impostor: says it is of CA's cluster (the CA certificate is public)
        # but its own certificate is from another CA
        impostor = _seed(tmp_path / "impostor", CA, cert_ca=OTHER)
        async with _serving(impostor.server()) as url:
            not_member = await _refused(url, token, joiner)
        # a member of another cluster altogether
        other = _seed(tmp_path / "other", OTHER)
        async with _serving(other.server()) as url:
            other_cluster = await _refused(url, token, joiner)
        assert "secret" not in caplog.text
        assert "closed before sending a request" in caplog.text
        assert impostor.granted == other.granted == []
        return not_member, other_cluster

    (tmp_path / "impostor").mkdir()
    (tmp_path / "other").mkdir()
    not_member, other_cluster = asyncio.run(go())
    assert not_member.endswith(
        "is not a member of the token's cluster: its certificate is issued by another CA"
    )
    assert other_cluster == (
        f"this token is for another cluster (CA {CA.fingerprint[:16]}…), "
        f"the seed's CA is {OTHER.fingerprint[:16]}…"
    )


def test_an_unreachable_seed_is_retryable_and_a_busy_port_one_line(tmp_path: Path) -> None:
    seed = _seed(tmp_path)
    joiner = _joiner(tmp_path)
    token = JoinToken(CA.fingerprint, "0123456789ab", "x" * 43)

    async def go() -> str:
        # a port bound but not listening: connections to it are refused
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            url = f"https://127.0.0.1:{s.getsockname()[1] - 2}"
            with pytest.raises(JoinUnreachable, match="cannot reach the join service of"):
                await request_join(url, token, **joiner.fields())
        async with _serving(seed.server()) as url:
            with pytest.raises(WorldError) as e:
                await seed.server(port=join_port(url)).run()
        return str(e.value)

    why = asyncio.run(go())
    assert why.startswith("join service: cannot listen on 127.0.0.1:")
    assert "\n" not in why


def test_a_server_without_its_certificate_says_so(tmp_path: Path) -> None:
    seed = _seed(tmp_path)
    with pytest.raises(WorldError, match="join service: cannot load"):
        asyncio.run(seed.server(cert=tmp_path / "none.crt").run())


def test_a_seed_that_cannot_read_its_world_or_record_the_grant_asks_to_retry(
    tmp_path: Path,
) -> None:
    seed = _seed(tmp_path)
    joiner = _joiner(tmp_path)

    async def failing(req: JoinRequest) -> None:
        raise WorldError("the World connection is closed")

    async def go() -> tuple[str, str]:
        token = await create_token(seed.kv, CA, 600)
        async with _serving(seed.server(on_grant=failing)) as url:
            with pytest.raises(JoinUnreachable) as hook:
                await request_join(url, token, **joiner.fields())
        await seed.kv.close()
        async with _serving(seed.server()) as url:
            with pytest.raises(JoinUnreachable) as world:
                await request_join(url, token, **joiner.fields())
        return str(hook.value), str(world.value)

    hook, world = asyncio.run(go())
    assert hook.endswith("the seed could not record the join: the World connection is closed")
    assert world.endswith("the seed cannot read its World now (the World connection is closed)")
