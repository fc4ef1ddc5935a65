"""The join protocol: how a new host gets the cluster's certificates (SPEC 4.8).

Every embedded member serves it (`JoinServer`) on its **join port**, its client
URL's port + 2 (2381 by default), over TLS with its node certificate. A joining
agent (`request_join`) holding a join token (cluster/jointokens.py):

1. connects without verifying the certificate (it has no CA yet) and reads the
   hello line `{"v":1,"ca":PEM}`; the CA's fingerprint must be the token's
   (else the seed is of another cluster) and the server's own certificate must
   be issued by that CA (else the server is not a member): only then does the
   secret leave the joiner;
2. sends one request line: the token's id and secret, its name, URLs, node
   public key and host keys;
3. reads one answer line: the CA certificate and key (any member may become
   the curator, which certifies the next ones), a node certificate for its URLs'
   addresses, a host certificate for its host keys, the revocation list and the
   cluster's client URLs; or `{"ok":false,"error":"one line"}`.

Nothing is written to the member list by a join: the joiner then starts as a
standby and the curator decides. Every connection is bounded (one line of at
most 64 KiB each way, 10 s in all), so a silent or hostile client holds one
connection task only and never the service. Neither side logs the secret.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from evergraph._util.clock import SYSTEM, Clock
from evergraph.cluster.ca import CAError, ClusterCA, fingerprint_pem, url_hosts
from evergraph.cluster.hostkeys import check_verify_key
from evergraph.cluster.jointokens import JoinToken, TokenError, another_cluster, check_token
from evergraph.world.kv import KV, WorldError
from evergraph.world.names import hostname_problem
from evergraph.world.open import is_loopback_url

log = logging.getLogger("evergraph.cluster.join")

JOIN_PORT_OFFSET = 2
PROTOCOL_VERSION = 1
#: the longest line either side reads
MAX_LINE = 64 * 1024
#: how long one connection may take, from accept to answer
CONNECTION_TIMEOUT = 10.0
#: connections served at once; more are closed at once (each costs a task)
MAX_CONNECTIONS = 64
#: how long a closing connection may take to say goodbye before it is cut
_CLOSE_GRACE = 2.0
#: the longest piece of a peer's text repeated in a message
_CLIP = 200


class JoinRefused(Exception):
    """The seed refused the join, or the joiner refused the seed; one line. Trying
    again will not help (exit 2)."""


class JoinUnreachable(Exception):
    """The join service could not be reached, the TLS handshake failed or the
    connection broke: trying again later may help."""


def join_port(client_url: str) -> int:
    """The join port of a member with this client URL: its port + 2."""
    try:
        port = urlsplit(client_url).port
    except ValueError:
        port = None
    if port is None:
        raise ValueError(f"{_clip(client_url)!r} is not http(s)://host:port")
    return port + JOIN_PORT_OFFSET


class Hello(msgspec.Struct):
    v: int
    ca: str


class JoinRequest(msgspec.Struct):
    """What a joiner sends. Its repr leaves the secret out."""

    token_id: str
    secret: str
    name: str
    peer_url: str
    client_url: str
    #: the joiner's node public key (EC P-256, PEM)
    node_key: str
    #: the joiner's host keys (x25519 box key, ed25519 verify key; base64)
    public: str
    verify: str

    def __repr__(self) -> str:
        return (
            f"JoinRequest(token_id={self.token_id!r}, name={self.name!r}, "
            f"peer_url={self.peer_url!r}, client_url={self.client_url!r})"
        )


class JoinGrant(msgspec.Struct):
    """What a granted joiner receives (PEM texts). Its repr leaves the CA key out."""

    ca: str
    ca_key: str
    node_cert: str
    host_cert: str
    crl: str
    #: the cluster's client URLs
    endpoints: list[str]

    def __repr__(self) -> str:
        return f"JoinGrant(endpoints={self.endpoints!r})"


class _Answer(msgspec.Struct, omit_defaults=True):
    ok: bool
    error: str = ""
    #: the refusal is the seed's trouble (its World unreadable): try again later
    retry: bool = False
    ca: str = ""
    ca_key: str = ""
    node_cert: str = ""
    host_cert: str = ""
    crl: str = ""
    endpoints: list[str] = msgspec.field(default_factory=list)


class _Refuse(Exception):
    def __init__(self, why: str, retry: bool = False) -> None:
        super().__init__(why)
        self.retry = retry


def _clip(text: str) -> str:
    one = " ".join(text.split())
    return one if len(one) <= _CLIP else one[:_CLIP] + "…"


def _line(struct: msgspec.Struct) -> bytes:
    return msgspec.json.encode(struct) + b"\n"


def _url_problem(what: str, url: str) -> str | None:
    u = urlsplit(url)
    try:
        port = u.port
    except ValueError:
        port = None
    if (
        u.scheme not in ("http", "https")
        or not u.hostname
        or port is None
        or u.path not in ("", "/")
        or u.query
        or u.fragment
        or u.username is not None
    ):
        return f"{what} {_clip(url)!r} is not http(s)://host:port"
    return None


def _node_key(pem: str) -> bytes:
    try:
        key = serialization.load_pem_public_key(pem.encode())
    except (ValueError, TypeError, UnsupportedAlgorithm):
        key = None
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP256R1):
        raise _Refuse("the node key is not an EC P-256 public key (PEM)")
    return pem.encode()


class JoinServer:
    """A member's join service: checks join requests and certifies the joiners.

    `endpoints()` and `crl()` are asked at each grant (they change as members come
    and go); `on_grant(request)` is awaited before a grant is sent (a refusal if
    it fails). `scheme` is the cluster's URL scheme (http only on loopback)."""

    def __init__(
        self,
        kv: KV,
        ca: ClusterCA,
        cert: Path,
        key: Path,
        host: str,
        port: int,
        scheme: str,
        endpoints: Callable[[], list[str]],
        crl: Callable[[], bytes],
        on_grant: Callable[[JoinRequest], Awaitable[None]] | None = None,
        clock: Clock = SYSTEM,
    ) -> None:
        self._kv = kv
        self._ca = ca
        self._cert = Path(cert)
        self._key = Path(key)
        self._host = host
        self._want_port = port
        self._scheme = scheme
        self._endpoints = endpoints
        self._crl = crl
        self._on_grant = on_grant
        self._clock = clock
        self._bound: int | None = None
        self._conns: set[asyncio.Task[Any]] = set()
        self._active = 0
        #: set once the service listens (`port` is then the bound one)
        self.ready = asyncio.Event()

    @property
    def port(self) -> int:
        if self._bound is None:
            raise RuntimeError("the join service is not listening yet")
        return self._bound

    def _ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(self._cert, self._key)
        except (OSError, ssl.SSLError) as e:
            raise WorldError(
                f"join service: cannot load {self._cert} and {self._key}: {e.strerror or e}"
            ) from None
        return ctx

    async def run(self) -> None:
        """Serve until cancelled; WorldError (one line) if it cannot listen."""
        ctx = self._ssl_context()
        where = f"{self._host}:{self._want_port}"
        try:
            server = await asyncio.start_server(
                self._connection,
                self._host,
                self._want_port,
                ssl=ctx,
                limit=MAX_LINE,
                ssl_handshake_timeout=CONNECTION_TIMEOUT,
            )
        except OSError as e:
            raise WorldError(f"join service: cannot listen on {where}: {e.strerror}") from None
        try:
            self._bound = server.sockets[0].getsockname()[1]
            log.info("join service listening on %s:%d", self._host, self._bound)
            self.ready.set()
            await asyncio.get_running_loop().create_future()  # until cancelled
        finally:
            server.close()
            for task in self._conns:
                task.cancel()
            await asyncio.gather(*self._conns, return_exceptions=True)
            await server.wait_closed()
            self.ready.clear()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        addr = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "?"
        if self._active >= MAX_CONNECTIONS:
            log.warning("join service: %d connections already, closing %s", MAX_CONNECTIONS, addr)
            writer.transport.abort()
            return
        # the task asyncio made for this connection is ours: run() cancels and
        # awaits it when the service stops
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        self._active += 1
        try:
            try:
                async with self._clock.timeout(CONNECTION_TIMEOUT):
                    await self._converse(reader, writer, addr)
            except TimeoutError:
                limit = CONNECTION_TIMEOUT
                log.warning("join from %s: no request within %g s: closed", addr, limit)
            except (OSError, asyncio.IncompleteReadError) as e:
                why = _clip(str(e)) or type(e).__name__
                log.info("join from %s: connection lost (%s)", addr, why)
            finally:
                # done with: room for another, even while the goodbye lasts
                self._active -= 1
                await _close(writer, self._clock)
        finally:
            self._conns.discard(task)

    async def _converse(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, addr: str
    ) -> None:
        writer.write(_line(Hello(PROTOCOL_VERSION, self._ca.cert_pem.decode())))
        await writer.drain()
        try:
            line = await reader.readline()
        except ValueError:  # longer than MAX_LINE
            answer = self._refusal("?", addr, _Refuse(f"join request longer than {MAX_LINE} bytes"))
        else:
            if not line.endswith(b"\n"):
                log.info("join from %s: closed before sending a request", addr)
                return
            try:
                req = msgspec.json.decode(line, type=JoinRequest)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                why = _Refuse(f"malformed join request: {_clip(str(e))}")
                answer = self._refusal("?", addr, why)
            else:
                answer = await self._answer(req, addr)
        writer.write(_line(answer))
        await writer.drain()

    def _refusal(self, name: str, addr: str, why: _Refuse) -> _Answer:
        log.warning("join of %s from %s refused: %s", name, addr, why)
        return _Answer(ok=False, error=str(why), retry=why.retry)

    async def _answer(self, req: JoinRequest, addr: str) -> _Answer:
        name = _clip(repr(req.name))
        try:
            grant = await self._grant(req)
            if self._on_grant is not None:
                try:
                    await self._on_grant(req)
                except Exception as e:  # the caller's hook: a refusal, never a crash
                    log.exception("join of %s from %s: recording the grant failed", name, addr)
                    why = f"the seed could not record the join: {_clip(str(e))}"
                    raise _Refuse(why, retry=True) from e
        except _Refuse as why:
            return self._refusal(name, addr, why)
        log.info("join of %s from %s granted (node certificate for %s)", name, addr, req.peer_url)
        return grant

    async def _grant(self, req: JoinRequest) -> _Answer:
        """The answer to a request that passes every check, in order: the token, the
        name, the URLs, the node key, the host keys."""
        token = JoinToken(self._ca.fingerprint, req.token_id, req.secret)
        try:
            await check_token(self._kv, self._ca, token, self._clock)
        except TokenError as e:
            raise _Refuse(str(e)) from None
        except WorldError as e:
            raise _Refuse(f"the seed cannot read its World now ({_clip(str(e))})", True) from None
        why = hostname_problem(req.name)
        if why:
            raise _Refuse(_clip(why))
        self._check_urls(req)
        node_key = _node_key(req.node_key)
        try:
            verify = check_verify_key(req.verify)
        except ValueError as e:
            raise _Refuse(f"the host verify key is not an ed25519 key: {e}") from None
        try:
            public = check_verify_key(req.public)
        except ValueError as e:
            raise _Refuse(f"the host public key is not an x25519 key: {e}") from None
        try:
            hosts = url_hosts([req.peer_url, req.client_url])
            node_cert = self._ca.issue_node(req.name, node_key, hosts)
            host_cert = self._ca.issue_host(req.name, public, verify)
            ca_key = self._ca.key_pem
            crl = self._crl()
        except CAError as e:
            raise _Refuse(_clip(str(e))) from None
        return _Answer(
            ok=True,
            ca=self._ca.cert_pem.decode(),
            ca_key=ca_key.decode(),
            node_cert=node_cert.decode(),
            host_cert=host_cert.decode(),
            crl=crl.decode(),
            endpoints=list(self._endpoints()),
        )

    def _check_urls(self, req: JoinRequest) -> None:
        mine = {"peer URL": req.peer_url, "client URL": req.client_url}
        for what, url in mine.items():
            why = _url_problem(what, url)
            if why:
                raise _Refuse(why)
        every = [*mine.values(), *self._endpoints()]
        plain = self._scheme == "http" or any(urlsplit(u).scheme == "http" for u in every)
        if plain and not all(is_loopback_url(u) for u in every):
            raise _Refuse("joining over a network needs TLS: use https:// URLs")
        for what, url in mine.items():
            scheme = urlsplit(url).scheme
            if scheme != self._scheme:
                raise _Refuse(f"the cluster uses {self._scheme}:// URLs; the {what} is {scheme}://")


async def _close(writer: asyncio.StreamWriter, clock: Clock) -> None:
    """Close a connection; cut it if the peer does not take part in the goodbye."""
    writer.close()
    try:
        async with clock.timeout(_CLOSE_GRACE):
            await writer.wait_closed()
    except (TimeoutError, OSError):
        writer.transport.abort()


def _client_context() -> ssl.SSLContext:
    # the joiner has no CA yet: it checks the server's certificate itself, against
    # the CA the token names (see _converse)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


async def request_join(
    seed_client_url: str,
    token: JoinToken,
    *,
    name: str,
    peer_url: str,
    client_url: str,
    node_key: bytes | str,
    public: str,
    verify: str,
    timeout: float = CONNECTION_TIMEOUT,
) -> JoinGrant:
    """Ask the member at `seed_client_url` (its join port) to certify this host.

    JoinRefused (one line) if the seed or the token is not good, JoinUnreachable
    if the seed could not be reached or the connection broke."""
    try:
        port = join_port(seed_client_url)
    except ValueError as e:
        raise JoinRefused(f"seed {e}") from None
    host = urlsplit(seed_client_url).hostname or ""
    where = f"the join service of {seed_client_url} ({host}:{port})"
    req = JoinRequest(
        token_id=token.id,
        secret=token.secret,
        name=name,
        peer_url=peer_url,
        client_url=client_url,
        node_key=node_key.decode() if isinstance(node_key, bytes) else node_key,
        public=public,
        verify=verify,
    )
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout):
            try:
                reader, writer = await asyncio.open_connection(
                    host, port, ssl=_client_context(), limit=MAX_LINE
                )
            except OSError as e:
                raise JoinUnreachable(f"cannot reach {where}: {e.strerror or e}") from None
            return await _ask(reader, writer, where, token, req)
    except TimeoutError:
        raise JoinUnreachable(f"{where} did not answer within {timeout:g} s") from None
    except (OSError, asyncio.IncompleteReadError) as e:
        raise JoinUnreachable(f"{where}: connection lost ({e})") from None
    finally:
        if writer is not None:
            await _close(writer, SYSTEM)


async def _read_line(reader: asyncio.StreamReader, where: str) -> bytes:
    try:
        line = await reader.readline()
    except ValueError:
        raise JoinRefused(f"{where} sent a line longer than {MAX_LINE} bytes") from None
    if not line.endswith(b"\n"):
        raise JoinUnreachable(f"{where} closed the connection")
    return line


async def _ask(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    where: str,
    token: JoinToken,
    req: JoinRequest,
) -> JoinGrant:
    not_join = f"{where} is not an evergraph join service"
    try:
        hello = msgspec.json.decode(await _read_line(reader, where), type=Hello)
        fp = fingerprint_pem(hello.ca.encode())
        ca = ClusterCA.from_pem(hello.ca.encode())
    except (msgspec.DecodeError, msgspec.ValidationError, CAError):
        raise JoinRefused(not_join) from None
    if hello.v != PROTOCOL_VERSION:
        raise JoinRefused(f"{where} speaks join protocol v{hello.v}, this evergraph v1")
    if fp != token.ca_fingerprint:
        raise JoinRefused(str(another_cluster(token.ca_fingerprint, fp, "the seed's")))
    sslobj = writer.get_extra_info("ssl_object")
    der = sslobj.getpeercert(binary_form=True) if sslobj is not None else None
    if not der:
        raise JoinRefused(f"{where} presented no certificate")
    why = ca.issued(x509.load_der_x509_certificate(der))
    if why:
        raise JoinRefused(
            f"{where} is not a member of the token's cluster: its certificate is {why}"
        )
    writer.write(_line(req))
    await writer.drain()
    try:
        answer = msgspec.json.decode(await _read_line(reader, where), type=_Answer)
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise JoinRefused(f"{where} sent a malformed answer") from None
    if not answer.ok:
        error = _clip(answer.error) or "no reason given"
        if answer.retry:
            raise JoinUnreachable(f"{where}: {error}")
        raise JoinRefused(f"{where} refused the join: {error}")
    try:
        granted_fp = fingerprint_pem(answer.ca.encode())
    except CAError:
        granted_fp = ""
    if granted_fp != token.ca_fingerprint:
        raise JoinRefused(f"{where} granted the join with another CA")
    return JoinGrant(
        ca=answer.ca,
        ca_key=answer.ca_key,
        node_cert=answer.node_cert,
        host_cert=answer.host_cert,
        crl=answer.crl,
        endpoints=answer.endpoints,
    )
