"""The self-forming etcd World, for real: agents in network namespaces of their
own (tests/kit/netbed.py) start real etcd members over TLS, join with tokens,
grow to the ideal size, heal after a kill -9, resize, and refuse bad tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.kit.netbed import NetBed
from tests.kit.selfform import CLUSTER_TEST, Member, formed, roles, settled, wait_until

pytestmark = CLUSTER_TEST


def test_five_agents_form_three_voters_and_two_standbys(netbed: Callable[[int], NetBed]) -> None:
    bed = netbed(5)
    members, _ = formed(bed, 5)
    wait_until(settled(members, 3, 2), 90, "3 voters and 2 standbys", members)
    # a write on any agent is read on all (each through every member's URL: a
    # standby's own port is closed, the client fails over to a voter)
    everyone = list(bed.hosts)
    members[3].world("put", "test/k", "v3", seeds=everyone)
    for m in members:
        assert m.world("get", "test/k", seeds=everyone).stdout.strip() == "v3"
    for m in members:
        assert "too many learner members" not in m.text()


def test_bad_tokens_are_refused_with_one_line_and_nothing_joins(
    netbed: Callable[[int], NetBed],
) -> None:
    bed = netbed(2)
    seed, joiner = Member(bed, bed.hosts[0]), Member(bed, bed.hosts[1])
    seed.start()
    wait_until(lambda: roles(seed.rows()) == {"h0": "voter"}, 60, "the seed's cluster", [seed])
    good = seed.token(bed.tmp / "good.token")
    h1 = bed.hosts[1]

    def refused(token: Path | None, *extra: str, env_token: str | None = None) -> str:
        argv = joiner.argv([bed.hosts[0]], token, "--converged-timeout", "1", *extra)
        from tests.kit.selfform import env

        e = env()
        if env_token is not None:
            e["EVERGRAPH_JOIN_TOKEN"] = env_token
        r = h1.run(*argv, env=e, check=False, timeout=60)
        assert r.returncode == 2, r.stderr + r.stdout
        # the agent's log line ("error: ...") or the command line's ("evergraph: ...")
        errors = [
            ln
            for ln in (r.stderr + r.stdout).splitlines()
            if "error" in ln.lower() or ln.startswith("evergraph:")
        ]
        assert len(errors) == 1, errors
        return errors[0]

    assert "needs a join token" in refused(None)
    bad = bed.tmp / "bad.token"
    bad.write_text("egj1.zz\n")
    assert "malformed" in refused(bad)
    text = good.read_text().strip()
    wrong = bed.tmp / "wrong.token"
    wrong.write_text(text[:-4] + ("AAAA" if not text.endswith("AAAA") else "BBBB") + "\n")
    assert "secret" in refused(wrong)
    other = bed.tmp / "other.token"
    other.write_text("egj1." + "ab" * 32 + text[len("egj1.") + 64 :] + "\n")
    assert "another cluster" in refused(other)
    expired = seed.token(bed.tmp / "short.token", "--ttl", "1m")
    revoked_id = expired.read_text().strip().split(".")[2]
    seed.cli("token", "revoke", revoked_id)
    assert "revoked" in refused(expired)
    # a joiner that would talk plain http over the network
    line = refused(
        good,
        "--etcd-client-url",
        f"http://{h1.addr}:2379",
        "--etcd-peer-url",
        f"http://{h1.addr}:2380",
    )
    assert "TLS" in line
    assert roles(seed.rows()) == {"h0": "voter"}
    # without a certificate of the cluster's CA, a host can neither read nor write
    from tests.kit.selfform import EVERGRAPH, client_url, env

    ca = str(bed.hosts[0].state_dir / "cluster" / "ca.crt")
    for args in (("get", "members/h0"), ("put", "test/x", "1")):
        r = h1.run(
            *EVERGRAPH,
            "world",
            *args,
            "--seeds",
            client_url(bed.hosts[0]),
            "--etcd-ca",
            ca,
            env=env(),
            check=False,
        )
        assert r.returncode == 1, r.stdout
        assert "certificate" in r.stderr, r.stderr
