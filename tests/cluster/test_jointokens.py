"""Join tokens: made, checked, revoked and expired against the World's signed
records; forged records refused; the secret kept out of the World and the errors."""

from __future__ import annotations

import asyncio
import base64
import hashlib
from pathlib import Path

import msgspec
import pytest

from evergraph._util.clock import SYSTEM
from evergraph.cluster.ca import ClusterCA
from evergraph.cluster.jointokens import (
    TOKENS,
    JoinToken,
    TokenError,
    TokenRecord,
    check_token,
    create_token,
    list_tokens,
    need_token,
    parse_token,
    read_token_source,
    revoke_token,
)
from evergraph.testing.clock import FakeClock
from evergraph.world.memory import MemoryKV, MemoryStore

CA = ClusterCA.new("c1")
OTHER = ClusterCA.new("c2")


def _refusal(kv: MemoryKV, token: JoinToken, clock: FakeClock | None = None) -> str:
    async def go() -> str:
        with pytest.raises(TokenError) as e:
            await check_token(kv, CA, token, clock or SYSTEM)
        return str(e.value)

    why = asyncio.run(go())
    assert "\n" not in why
    assert token.secret not in why
    return why


def _world_holds(store: MemoryStore, needle: str) -> bool:
    return any(needle.encode() in kv.value or needle in kv.key for kv in store.data.values())


def test_a_new_token_checks_and_its_secret_stays_out_of_the_world() -> None:
    store = MemoryStore()
    kv = MemoryKV(store)

    async def go() -> JoinToken:
        token = await create_token(kv, CA, 3600)
        await check_token(kv, CA, token)
        await check_token(kv, CA, parse_token(token.text()))
        return token

    token = asyncio.run(go())
    text = token.text()
    fp, tid, secret = text.split(".")[1:]
    assert text.startswith("egj1.")
    assert (fp, tid) == (CA.fingerprint, token.id)
    assert len(tid) == 12
    assert len(secret) == 43
    assert len(base64.urlsafe_b64decode(secret + "=")) == 32
    assert secret not in repr(token)
    assert not _world_holds(store, secret)
    record = msgspec.json.decode(store.data[TOKENS + tid].value, type=TokenRecord)
    assert record.hash == hashlib.sha256(secret.encode()).hexdigest()
    assert not record.revoked
    assert record.expires - record.created == 3600
    assert [r.id for r in asyncio.run(list_tokens(kv, CA))] == [tid]


def test_each_bad_token_is_refused_with_one_line_saying_why() -> None:
    clock = FakeClock()
    kv = MemoryKV(MemoryStore(clock))
    token = asyncio.run(create_token(kv, CA, 60, clock))
    wrong = JoinToken(CA.fingerprint, token.id, "A" * 43)
    assert _refusal(kv, wrong) == f"wrong secret for join token {token.id}"
    unknown = JoinToken(CA.fingerprint, "0123456789ab", token.secret)
    assert _refusal(kv, unknown) == "unknown join token id 0123456789ab"
    foreign = JoinToken(OTHER.fingerprint, token.id, token.secret)
    why = _refusal(kv, foreign)
    assert why == (
        f"this token is for another cluster (CA {OTHER.fingerprint[:16]}…), "
        f"this cluster's CA is {CA.fingerprint[:16]}…"
    )
    # an id that is no id never reaches the World as a key
    assert "malformed" in _refusal(kv, JoinToken(CA.fingerprint, "../members", token.secret))
    assert str(need_token("https://10.0.0.1:2379")) == (
        "joining cluster at https://10.0.0.1:2379 needs a join token: "
        "--join-token-file F or EVERGRAPH_JOIN_TOKEN"
    )


def test_a_token_expires_on_the_clock() -> None:
    clock = FakeClock(epoch=1_800_000_000.0)
    kv = MemoryKV(MemoryStore(clock))

    async def go() -> JoinToken:
        token = await create_token(kv, CA, 60, clock)
        await clock.advance(59)
        await check_token(kv, CA, token, clock)
        await clock.advance(1)
        return token

    token = asyncio.run(go())
    assert _refusal(kv, token, clock) == (
        f"join token {token.id} expired at 2027-01-15 08:01:00 UTC"
    )


def test_revocation_by_id_and_by_whole_token() -> None:
    kv = MemoryKV()

    async def go() -> tuple[JoinToken, JoinToken]:
        a = await create_token(kv, CA, 600)
        b = await create_token(kv, CA, 600)
        assert await revoke_token(kv, CA, a.id) == a.id
        assert await revoke_token(kv, CA, f" {b.text()}\n") == b.id
        assert await revoke_token(kv, CA, a.id) == a.id  # again: no error
        return a, b

    a, b = asyncio.run(go())
    assert _refusal(kv, a) == f"join token {a.id} was revoked"
    assert _refusal(kv, b) == f"join token {b.id} was revoked"
    # the wrong secret of a revoked token tells nothing of the revocation
    assert "wrong secret" in _refusal(kv, JoinToken(CA.fingerprint, a.id, "B" * 43))
    assert all(r.revoked for r in asyncio.run(list_tokens(kv, CA)))
    with pytest.raises(TokenError, match=r"^unknown join token id 0123456789ab$"):
        asyncio.run(revoke_token(kv, CA, "0123456789ab"))
    foreign = JoinToken(OTHER.fingerprint, a.id, a.secret)
    with pytest.raises(TokenError, match="another cluster") as e:
        asyncio.run(revoke_token(kv, CA, foreign.text()))
    assert a.secret not in str(e.value)
    with pytest.raises(TokenError, match="malformed"):
        asyncio.run(revoke_token(kv, CA, "nonsense"))


def test_a_record_the_ca_did_not_sign_is_an_unknown_token() -> None:
    """Who can write the World but lacks the CA key cannot mint a token: a record
    with the right hash but no signature, a signature of another CA, or the
    signature of another record counts as unknown (and is not listed)."""
    kv = MemoryKV()
    secret = "S" * 43
    good_hash = hashlib.sha256(secret.encode()).hexdigest()

    async def go() -> None:
        real = await create_token(kv, CA, 600)
        real_sig = msgspec.json.decode((await kv.get(TOKENS + real.id)).value, type=TokenRecord).sig  # type: ignore[union-attr]
        forged = {
            "aaaaaaaaaaa1": "",  # no signature
            "aaaaaaaaaaa2": base64.b64encode(
                OTHER.sign(TokenRecord("aaaaaaaaaaa2", good_hash, 0, 2e9).signed_bytes())
            ).decode(),
            "aaaaaaaaaaa3": real_sig,  # a signature of another record
            "aaaaaaaaaaa4": "%%% not base64",
        }
        for tid, sig in forged.items():
            record = TokenRecord(tid, good_hash, 0, 2e9, sig=sig)
            await kv.put(TOKENS + tid, msgspec.json.encode(record))
        # a genuine record copied under another id is not that id's record
        await kv.put(TOKENS + "aaaaaaaaaaa5", (await kv.get(TOKENS + real.id)).value)  # type: ignore[union-attr]
        await kv.put(TOKENS + "aaaaaaaaaaa6", b"garbage")
        assert [r.id for r in await list_tokens(kv, CA)] == [real.id]
        for tid in [*forged, "aaaaaaaaaaa5", "aaaaaaaaaaa6"]:
            with pytest.raises(TokenError, match=f"^unknown join token id {tid}$"):
                await check_token(kv, CA, JoinToken(CA.fingerprint, tid, secret))
        with pytest.raises(TokenError, match="unknown"):
            await revoke_token(kv, CA, "aaaaaaaaaaa1")

    asyncio.run(go())


@pytest.mark.parametrize(
    ("text", "part"),
    [
        ("", "expected egj1"),
        ("egj2.{fp}.0123456789ab.{s}", "expected egj1"),
        ("egj1.{fp}.0123456789ab", "expected egj1"),
        ("egj1.{fp}.0123456789ab.{s}.x", "expected egj1"),
        ("egj1.{fp}0.0123456789ab.{s}", "fingerprint"),
        ("egj1.{FP}.0123456789ab.{s}", "fingerprint"),
        ("egj1.{fp}.0123456789a.{s}", "the id"),
        ("egj1.{fp}.0123456789ab.{s}x", "the secret"),
        ("egj1.{fp}.0123456789ab.{s_bad}", "the secret"),
    ],
)
def test_a_malformed_token_is_refused_without_echoing_it(text: str, part: str) -> None:
    secret = "q" * 42 + "Z"
    text = text.format(fp=CA.fingerprint, FP=CA.fingerprint.upper(), s=secret, s_bad="q" * 42 + "+")
    with pytest.raises(TokenError) as e:
        parse_token(text)
    why = str(e.value)
    assert why.startswith("malformed join token: ")
    assert part in why
    assert secret[:20] not in why
    assert "\n" not in why


def test_a_token_is_read_from_a_file_or_else_the_environment(tmp_path: Path) -> None:
    token = JoinToken(CA.fingerprint, "0123456789ab", "x" * 43)
    other = JoinToken(CA.fingerprint, "ba9876543210", "y" * 43)
    env = {"EVERGRAPH_JOIN_TOKEN": other.text()}
    f = tmp_path / "token"
    f.write_text(f"\n  \n{token.text()}\nsomething else\n")
    assert read_token_source(f, env) == token
    assert read_token_source(None, env) == other
    assert read_token_source(None, {}) is None
    assert read_token_source(None, {"EVERGRAPH_JOIN_TOKEN": "  "}) is None
    with pytest.raises(TokenError, match=r"^join token file .*: No such file"):
        read_token_source(tmp_path / "none", env)
    (tmp_path / "blank").write_text("\n \n")
    with pytest.raises(TokenError, match="no token in it"):
        read_token_source(tmp_path / "blank", env)
    (tmp_path / "bad").write_text("egj1.zz\n")
    with pytest.raises(TokenError, match=r"^join token file .*bad: malformed join token"):
        read_token_source(tmp_path / "bad", env)
    with pytest.raises(TokenError, match=r"^EVERGRAPH_JOIN_TOKEN: malformed join token"):
        read_token_source(None, {"EVERGRAPH_JOIN_TOKEN": "egj1.zz"})


def test_a_record_signs_the_same_whether_its_times_were_ints_or_floats() -> None:
    record = TokenRecord("0123456789ab", "h" * 64, 5, 65)
    back = msgspec.json.decode(msgspec.json.encode(record), type=TokenRecord)
    assert back.signed_bytes() == record.signed_bytes()


def test_a_token_needs_a_positive_lifetime() -> None:
    with pytest.raises(TokenError, match="positive"):
        asyncio.run(create_token(MemoryKV(), CA, 0))


def test_dead_token_records_are_pruned_when_a_token_is_made() -> None:
    """Records of tokens expired for a week go when the next token is made (they
    would pile up, one per join, forever); younger ones stay listed."""
    clock = FakeClock(epoch=1_800_000_000.0)
    kv = MemoryKV(MemoryStore(clock))

    async def main() -> tuple[list[str], list[str]]:
        await create_token(kv, CA, 60, clock)  # the one to go
        await clock.advance(86400)
        young = await create_token(kv, CA, 60, clock)
        await clock.advance(7 * 86400)  # old expired 8 days ago, young 7 days less 60 s
        new = await create_token(kv, CA, 60, clock)
        return [r.id for r in await list_tokens(kv, CA)], [young.id, new.id]

    listed, expected = asyncio.run(main())
    assert listed == expected
