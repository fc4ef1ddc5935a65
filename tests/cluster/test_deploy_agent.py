"""Agents started without FILE follow the newest deploy signed by a trusted deployer and
swap to it live; unsigned, forged and untrusted deploys are refused (logged once) while
the running graph goes on; bundles never carry a state dir's bytes; `run FILE`
publishes nothing."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import shutil
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import msgspec
import nacl.signing
import pytest

from evergraph.cluster import deploys as dp
from evergraph.cluster.hostkeys import fingerprint
from evergraph.world.etcd_server import EtcdServer
from evergraph.world.kv import KV
from evergraph.world.sqlite import SQLiteKV
from tests.conftest import Agent, run_cli, wait_for
from tests.kit.git import git

T = TypeVar("T")


def yaml_graph(out: Path, name: str, content: str) -> str:
    return (
        f"graph: g-{name}\nresources:\n  file:\n"
        f"  - {{name: {name}, path: {out / name}, content: {json.dumps(content)}}}\n"
    )


def deploy(state: Path, entry: Path, *extra: str | Path) -> str:
    r = run_cli("deploy", entry, "--no-git", "--state-dir", state, *extra)
    assert r.returncode == 0, r.stderr
    return r.stdout


def new_key(path: Path) -> str:
    """A fresh signing key file (as STATE/keys/sign.key); returns its verify key."""
    key = nacl.signing.SigningKey.generate()
    path.write_bytes(base64.b64encode(bytes(key)) + b"\n")
    return dp.verify_key_of(key)


def in_world(state: Path, body: Callable[[KV], Awaitable[T]]) -> T:
    """Run `body` on the sqlite World in `state` (shared with the running agent)."""

    async def main() -> T:
        kv = SQLiteKV(state / "world.sqlite")
        try:
            return await asyncio.wait_for(body(kv), 30)
        finally:
            await kv.close()

    return asyncio.run(main())


def put_record(state: Path, n: int, value: bytes) -> None:
    """Write a record and the head straight into the World, as any World writer can."""

    async def body(kv: KV) -> None:
        await kv.put(dp.record_key(n), value)
        await kv.put(dp.HEAD, value)

    in_world(state, body)


def log_has(a: Agent, text: str) -> Callable[[], bool]:
    return lambda: text in a.log.read_text()


def repairs_drift(path: Path, content: str) -> None:
    path.write_text("drift\n")
    wait_for(lambda: path.read_text() == content, what=f"{path} repaired")


def test_agent_without_file_follows_deploys_live(tmp_path: Path, agents) -> None:  # type: ignore[no-untyped-def]
    state, out = tmp_path / "st", tmp_path / "out"
    a: Agent = agents(None, state, "-v")
    wait_for(log_has(a, "no deploy in the World yet"), what="waiting message")
    assert "no deployer pinned yet" in a.log.read_text()

    # deploy 1: YAML, with a file it references next to it
    src1 = tmp_path / "src1"
    src1.mkdir()
    (src1 / "main.yaml").write_text(yaml_graph(out, "a", "one\n"))
    assert deploy(state, src1 / "main.yaml").startswith("deploy 1 ")
    wait_for(lambda: (out / "a").exists() and (out / "a").read_text() == "one\n", what="deploy 1")
    # the first signer (the deployer's state dir key, here the agent's own) is pinned
    signer = dp.verify_key_of(dp.read_signing_key(state / "keys" / "sign.key"))
    assert json.loads((state / "pins.json").read_text())["deployers"] == [signer]
    wait_for(log_has(a, f"pinned deployer {signer}"), what="the pin logged")

    # deploy 2: a Python module importing a helper shipped in the same deploy
    src2 = tmp_path / "src2"
    src2.mkdir()
    (src2 / "helper.py").write_text("TEXT = 'two\\n'\n")
    (src2 / "site.py").write_text(
        "from helper import TEXT\n\n"
        f"def graph(g, world):\n    g.add('file', 'b', path={str(out / 'b')!r}, content=TEXT)\n"
    )
    assert deploy(state, src2 / "site.py").startswith("deploy 2 ")
    wait_for(lambda: (out / "b").exists() and (out / "b").read_text() == "two\n", what="deploy 2")
    wait_for(log_has(a, "running deploy 2"), what="log")

    # deploy 3 does not load: logged, skipped, deploy 2 keeps running (and repairing)
    src3 = tmp_path / "src3"
    src3.mkdir()
    (src3 / "site.py").write_text("def graph(g, world)\n")
    assert deploy(state, src3 / "site.py").startswith("deploy 3 ")
    wait_for(log_has(a, "deploy 3: "), what="deploy 3 rejected")
    assert "Python syntax error" in a.log.read_text()
    repairs_drift(out / "b", "two\n")

    # deploy 4 loads again; old materialised deploys are pruned
    (src1 / "main.yaml").write_text(yaml_graph(out, "c", "four\n"))
    assert deploy(state, src1 / "main.yaml").startswith("deploy 4 ")
    wait_for(lambda: (out / "c").exists(), what="deploy 4")
    assert sorted(p.name.split("-")[0] for p in (state / "deploys").iterdir()) == [
        "2",
        "3",
        "4",
    ]  # 1 is pruned
    # deploy 5: deploy 2's code with an edited helper module: imported afresh
    (src2 / "helper.py").write_text("TEXT = 'five\\n'\n")
    assert deploy(state, src2 / "site.py").startswith("deploy 5 ")
    wait_for(lambda: (out / "b").read_text() == "five\n", what="deploy 5's helper used")
    assert a.proc.poll() is None
    assert "Traceback" not in a.log.read_text()


def test_refused_deploys_keep_the_running_graph(tmp_path: Path, agents) -> None:  # type: ignore[no-untyped-def]
    state, out = tmp_path / "st", tmp_path / "out"
    key_a, key_b = tmp_path / "a.key", tmp_path / "b.key"
    mine, theirs = new_key(key_a), new_key(key_b)
    a: Agent = agents(None, state)
    src = tmp_path / "src"
    src.mkdir()
    (src / "main.yaml").write_text(yaml_graph(out, "f", "one\n"))
    assert deploy(state, src / "main.yaml", "--key", key_a).startswith("deploy 1 ")
    wait_for(lambda: (out / "f").exists() and (out / "f").read_text() == "one\n", what="deploy 1")
    wait_for(log_has(a, f"pinned deployer {mine}"), what="the first signer pinned")

    # another key's deploy: refused, deploy 1 keeps running and repairing
    (src / "main.yaml").write_text(yaml_graph(out, "f", "evil\n"))
    assert deploy(state, src / "main.yaml", "--key", key_b).startswith("deploy 2 ")
    refused_b = f"deploy 2 is signed by {fingerprint(theirs)}"
    wait_for(log_has(a, refused_b), what="deploy 2 refused")
    repairs_drift(out / "f", "one\n")

    d1, d2 = in_world(state, dp.history)
    evil = dict(d2.files)
    # records written straight into the World: unsigned (the old schema, and the new one
    # with an empty signature), a forged signature, a tampered hash, garbage
    nosig = {k: v for k, v in msgspec.to_builtins(d2).items() if k not in ("signer", "signature")}
    nosig.update(n=3, parent=d2.hash)
    old = {**nosig, "files": {p: f.sha for p, f in evil.items()}}  # schema 1: no signature
    unsigned = msgspec.structs.replace(d2, n=3, parent=d2.hash, signer="", signature="")
    unsigned = msgspec.structs.replace(unsigned, hash=dp._hash_of(unsigned))
    forged = msgspec.structs.replace(d1, n=3, parent=d2.hash, files=evil)  # d1's signature
    forged = msgspec.structs.replace(forged, hash=dp._hash_of(forged))
    tampered = msgspec.structs.replace(d1, files=evil)  # hash and signature of d1
    tampered = msgspec.structs.replace(tampered, n=3, parent=d2.hash)
    bad = {
        "deploys/head: not a deploy record: Expected `object`, got `str`": (
            msgspec.json.encode(old)
        ),
        "deploys/head: not a deploy record: Object missing required field `signer`": (
            msgspec.json.encode(nosig)
        ),
        "deploys/head: signer is not a verify key": msgspec.json.encode(unsigned),
        "deploys/head: bad signature: deploy 3 is not signed by the key it names": (
            msgspec.json.encode(forged)
        ),
        "deploys/head: the record's hash does not match its content": (
            msgspec.json.encode(tampered)
        ),
        "deploys/head: not a deploy record: JSON is malformed": b'{"n": 3, garbage',
    }
    for why, value in bad.items():
        put_record(state, 3, value)
        wait_for(log_has(a, why), what=why)
    # seen again (the same head written again): not logged again
    for _ in range(3):
        put_record(state, 3, b'{"n": 3, garbage')
    put_record(state, 3, msgspec.json.encode(forged))
    repairs_drift(out / "f", "one\n")

    # the pinned deployer deploys again (after the junk record is cleared): it runs
    in_world(state, lambda kv: kv.delete(dp.record_key(3)))
    (src / "main.yaml").write_text(yaml_graph(out, "f", "two\n"))
    assert deploy(state, src / "main.yaml", "--key", key_a).startswith("deploy 3 ")
    wait_for(lambda: (out / "f").read_text() == "two\n", what="deploy 3 runs")
    wait_for(log_has(a, "running deploy 3"), what="log")
    text = a.log.read_text()
    assert text.count(refused_b) == 1, text
    for why in bad:
        assert text.count(why) == 1, (why, text)
    assert "running deploy 2" not in text
    assert a.proc.poll() is None
    assert "Traceback" not in text

    # a restart keeps the pin: a newer deploy by the other key is passed over (logged
    # once), and the agent runs the newest deploy of its pinned deployer
    assert a.stop() == 0
    (src / "main.yaml").write_text(yaml_graph(out, "f", "evil again\n"))
    assert deploy(state, src / "main.yaml", "--key", key_b).startswith("deploy 4 ")
    again: Agent = agents(None, state)
    wait_for(log_has(again, "running deploy 3"), what="the restarted agent on deploy 3")
    repairs_drift(out / "f", "two\n")
    text = again.log.read_text()
    assert text.count("deploy 4 is signed by") == 1, text
    assert "pinned deployer" not in text


def test_deployer_flag_accepts_only_the_named_keys(tmp_path: Path, agents) -> None:  # type: ignore[no-untyped-def]
    state, out = tmp_path / "st", tmp_path / "out"
    keys = {n: tmp_path / f"{n}.key" for n in "abc"}
    verify = {n: new_key(p) for n, p in keys.items()}
    a: Agent = agents(None, state, "--deployer", verify["a"], "--deployer", verify["c"])
    wait_for(log_has(a, "following deploys signed by"), what="start")
    src = tmp_path / "src"
    src.mkdir()

    def ship(key: str, content: str) -> int:
        (src / "main.yaml").write_text(yaml_graph(out, "f", content))
        line = deploy(state, src / "main.yaml", *(("--key", keys[key]) if key else ()))
        return int(line.split()[1])

    # b is not named, nor is the deployer's default key (the state dir's, here the agent's)
    n = ship("b", "from b\n")
    wait_for(log_has(a, f"deploy {n} is signed by {fingerprint(verify['b'])}"), what="b")
    n = ship("", "from the state dir key\n")
    wait_for(log_has(a, f"deploy {n} is signed by"), what="default key refused")
    assert not (out / "f").exists()
    ship("a", "from a\n")
    wait_for(lambda: (out / "f").exists() and (out / "f").read_text() == "from a\n", what="a")
    ship("c", "from c\n")
    wait_for(lambda: (out / "f").read_text() == "from c\n", what="c")
    n = ship("b", "from b again\n")
    wait_for(log_has(a, f"deploy {n} is signed by"), what="b again")
    repairs_drift(out / "f", "from c\n")
    # named deployers are not pinned: nothing learnt on first use
    pins = state / "pins.json"
    assert not pins.exists() or json.loads(pins.read_text())["deployers"] == []
    assert "pinned deployer" not in a.log.read_text()

    # a bad --deployer: one line naming the flag, exit 2, nothing run
    short = base64.b64encode(b"\1" * 31).decode()
    for bad in ("not-a-key!", short, ""):
        r = run_cli("run", "--state-dir", tmp_path / "st2", "--deployer", bad, "--max-runtime", "5")
        assert r.returncode == 2, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert r.stderr.startswith("evergraph: --deployer: "), r.stderr
    r = run_cli(
        "run", src / "main.yaml", "--state-dir", tmp_path / "st2", "--deployer", verify["a"]
    )
    assert r.returncode == 2
    assert r.stderr.startswith("evergraph: --deployer: "), r.stderr
    assert "give no FILE" in r.stderr
    # the same through the embedding API
    from evergraph.agent.api import run

    assert run(None, state_dir=tmp_path / "st3", deployers=["nope"]) == 2
    assert not (tmp_path / "st3" / "world.sqlite").exists()


def test_bundle_next_to_a_state_dir_carries_none_of_its_bytes(tmp_path: Path, agents) -> None:  # type: ignore[no-untyped-def]
    site, out = tmp_path / "site", tmp_path / "out"
    state = site / "state"  # the agent's state dir, inside the graph's directory
    (site / "bin").mkdir(parents=True)
    out.mkdir()

    def write_graph(marker: str) -> None:
        (site / "bin" / "run.sh").write_text(f"#!/bin/sh\necho {marker} > {out / marker}\n")
        (site / "bin" / "run.sh").chmod(0o755)
        (site / "main.py").write_text(
            "import os\n\n"
            "HERE = os.path.dirname(__file__)\n\n\n"
            "def graph(g, world):\n"
            f"    g.add('exec', 'run', cmd=os.path.join(HERE, 'bin', 'run.sh'),"
            f" creates={str(out / marker)!r})\n"
        )

    write_graph("one")
    a: Agent = agents(None, state)
    wait_for(log_has(a, "no deploy in the World yet"), what="agent up")
    r = run_cli("deploy", site / "main.py", "--no-git", "--state-dir", state)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("deploy 1 ")
    assert "left out state/: an evergraph state dir" in r.stderr
    # the script ran from the fetched deploy, so it kept its exec bit
    wait_for(lambda: (out / "one").exists(), what="deploy 1's script ran")
    assert (out / "one").read_text() == "one\n"
    (script,) = state.glob("deploys/1-*/bin/run.sh")
    assert stat.S_IMODE(script.stat().st_mode) == 0o755

    # git: the state dir is untracked, so it is not even looked at
    write_graph("two")
    git(site, "init", "-q")
    git(site, "add", "main.py", "bin/run.sh")
    git(site, "commit", "-q", "-m", "site")
    r = run_cli("deploy", site / "main.py", "--state-dir", state)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("deploy 2 ")
    wait_for(lambda: (out / "two").exists(), what="deploy 2's script ran")

    secrets = {
        p.name: p.read_bytes()
        for p in [*state.glob("keys/*"), state / "pins.json"]
        if p.is_file() and p.stat().st_size
    }
    assert {"box.key", "sign.key", "pins.json"} <= set(secrets)

    async def read(kv: KV) -> tuple[list[dp.Deploy], list[bytes]]:
        items, _ = await kv.range(dp.FILES)
        return await dp.history(kv), [i.value for i in items]

    hist, blobs = in_world(state, read)
    assert [sorted(d.files) for d in hist] == [["bin/run.sh", "main.py"]] * 2
    assert hist[1].git is not None
    for name, secret in secrets.items():
        key = secret.strip()
        assert not any(key in b for b in blobs), name
        assert not any(base64.b64decode(key) in b for b in blobs if name != "pins.json"), name
    assert not any(b.startswith(b"SQLite format 3") for b in blobs)


@pytest.mark.slow
def test_deploys_on_etcd_are_signed_and_run_file_publishes_nothing(  # type: ignore[no-untyped-def]
    tmp_path: Path, shm: Path, servers: list[EtcdServer], agents
) -> None:
    server = EtcdServer.single(shm)
    servers.append(server)
    server.start()
    seeds = ("--seeds", server.client_url)
    out = tmp_path / "out"
    src = tmp_path / "src"
    src.mkdir()
    (src / "local.yaml").write_text(yaml_graph(out, "local", "only on h1\n"))
    # `run FILE` runs FILE on this host and publishes nothing
    h1: Agent = agents(src / "local.yaml", tmp_path / "s1", "--hostname", "h1", *seeds)
    h1.wait_converged()
    deployer = tmp_path / "deployer"
    r = run_cli("deploys", "--state-dir", deployer, *seeds)
    assert (r.returncode, r.stdout) == (0, ""), r.stderr

    follower: Agent = agents(None, tmp_path / "s2", "--hostname", "h2", *seeds)
    wait_for(log_has(follower, "no deploy in the World yet"), what="follower up")
    (src / "site.yaml").write_text(yaml_graph(out, "shared", "deploy 1\n"))

    def ship(*extra: str | Path) -> str:
        r = run_cli(
            "deploy", src / "site.yaml", "--no-git", "--state-dir", deployer, *seeds, *extra
        )
        assert r.returncode == 0, r.stderr
        return r.stdout

    line = ship()
    assert line.startswith("deploy 1 ")
    signer = line.split("signed by ")[1].split()[0]
    wait_for(lambda: (out / "shared").exists(), what="follower runs deploy 1")
    wait_for(log_has(follower, f"pinned deployer {signer}"), what="pinned")
    # another key: refused on the follower, which keeps deploy 1 running
    (src / "site.yaml").write_text(yaml_graph(out, "shared", "intruder\n"))
    other = new_key(tmp_path / "other.key")
    assert ship("--key", tmp_path / "other.key").startswith("deploy 2 ")
    wait_for(log_has(follower, f"signed by {fingerprint(other)}"), what="refused")
    repairs_drift(out / "shared", "deploy 1\n")
    # the pinned deployer again: the follower swaps live
    (src / "site.yaml").write_text(yaml_graph(out, "shared", "deploy 3\n"))
    assert ship().startswith("deploy 3 ")
    wait_for(lambda: (out / "shared").read_text() == "deploy 3\n", what="follower on deploy 3")
    wait_for(log_has(follower, "running deploy 3"), what="follower log")
    r = run_cli("deploys", "--state-dir", deployer, *seeds)
    assert r.returncode == 0, r.stderr
    assert [line.split("\t")[0] for line in r.stdout.splitlines()] == ["1", "2", "3"]
    assert (out / "local").read_text() == "only on h1\n"


def test_a_restarted_follower_never_goes_back(tmp_path: Path, agents) -> None:  # type: ignore[no-untyped-def]
    """An attacker who can write the World deletes the newest deploy's records and
    points the head back: a restarted follower keeps running the newest deploy it ran
    (its high-water mark); with that deploy gone from disk and the World too, it runs
    nothing, says why, and runs the next genuine deploy."""
    state, out, src = tmp_path / "st", tmp_path / "out", tmp_path / "src"
    src.mkdir()
    a: Agent = agents(None, state)
    wait_for(log_has(a, "no deploy in the World yet"), what="waiting message")
    for n, text in ((1, "one\n"), (2, "two\n")):
        (src / "main.yaml").write_text(yaml_graph(out, "a", text))
        assert deploy(state, src / "main.yaml").startswith(f"deploy {n} ")
        wait_for(lambda t=text: (out / "a").exists() and (out / "a").read_text() == t, what="run")
    assert a.stop() == 0
    mark = in_world(state, lambda kv: dp.get(kv, 2))

    async def roll_back(kv: KV) -> None:
        one = await kv.get(dp.record_key(1))
        assert one is not None
        await kv.delete(dp.record_key(2))
        # the signer's own record (deploys/by/<sha256 of its key>) pointed back too
        by = "deploys/by/" + hashlib.sha256(base64.b64decode(mark.signer)).hexdigest()
        await kv.put(by, one.value)
        await kv.put(dp.HEAD, one.value)

    in_world(state, roll_back)
    b: Agent = agents(None, state)
    b.wait_converged()
    repairs_drift(out / "a", "two\n")  # deploy 2 runs, from its materialised copy
    older = f"is older than deploy 2 ({mark.hash[:12]})"
    wait_for(log_has(b, older), what="the rollback refused")
    assert b.stop() == 0
    log = b.log.read_text()
    assert log.count(older) == 1
    assert "running deploy 2" in log
    assert "running deploy 1" not in log
    kept = dp.decode_record((state / "deploy-high-water.json").read_bytes(), "the mark")
    assert kept == mark

    # its signer no longer trusted: deploy 2 does not run again either (nor deploy 1)
    other = new_key(tmp_path / "other.key")
    o: Agent = agents(None, state, "--deployer", other)
    wait_for(log_has(o, "not a trusted deployer now"), what="the mark not run again")
    assert o.stop() == 0
    assert "running deploy" not in o.log.read_text()

    # deploy 2 gone from disk and from the World (its blob too): nothing runs, and why
    for d in (state / "deploys").glob("2-*"):
        shutil.rmtree(d)

    async def lose_blob(kv: KV) -> None:
        await kv.delete(dp.blob_key(mark.files["main.yaml"].sha))

    in_world(state, lose_blob)
    c: Agent = agents(None, state)
    wait_for(log_has(c, "deploy 2 (the high-water mark) cannot run again"), what="why")
    wait_for(log_has(c, older), what="the rollback refused")
    (src / "main.yaml").write_text(yaml_graph(out, "a", "three\n"))
    assert deploy(state, src / "main.yaml").startswith("deploy 2 ")  # numbered after 1
    wait_for(lambda: (out / "a").read_text() == "three\n", what="the genuine deploy")
    assert c.stop() == 0
    assert "running deploy 1" not in c.log.read_text()


def test_spam_deploys_cannot_hide_the_trusted_one(tmp_path: Path, agents) -> None:  # type: ignore[no-untyped-def]
    """120 deploys signed by keys of an attacker's, after the trusted one: a follower
    started afterwards still finds and runs the trusted deploy."""
    state, out, src = tmp_path / "st", tmp_path / "out", tmp_path / "src"
    src.mkdir()
    (src / "main.yaml").write_text(yaml_graph(out, "a", "trusted\n"))
    deploy(state, src / "main.yaml")
    me = dp.verify_key_of(dp.read_signing_key(state / "keys" / "sign.key"))

    async def spam(kv: KV) -> None:
        content = {"main.yaml": dp.Content(yaml_graph(out, "a", "spam\n").encode(), 0o644)}
        for i in range(120):
            key = nacl.signing.SigningKey(bytes([i + 1]) * 32)
            await dp.publish(kv, "main.yaml", content, key=key, git=None, by="mallory@x")

    in_world(state, spam)
    a: Agent = agents(None, state, "--deployer", me)
    a.wait_converged()
    assert (out / "a").read_text() == "trusted\n"
    assert "running deploy 1 " in a.log.read_text()
    assert a.stop() == 0


def test_a_deployer_pinned_by_another_process_reaches_a_running_follower(  # type: ignore[no-untyped-def]
    tmp_path: Path, agents
) -> None:
    """pins.json is live for deploys too: its trusted deployers edited by another
    process (the operator) reach a running follower within a second; the newly
    trusted deployer's newest deploy runs without a restart (issue 22 item 8)."""
    from evergraph.cluster.pins import Pins

    state, out = tmp_path / "st", tmp_path / "out"
    key_a, key_b = tmp_path / "a.key", tmp_path / "b.key"
    mine, theirs = new_key(key_a), new_key(key_b)
    a: Agent = agents(None, state)
    src = tmp_path / "src"
    src.mkdir()
    (src / "main.yaml").write_text(yaml_graph(out, "f", "one\n"))
    assert deploy(state, src / "main.yaml", "--key", key_a).startswith("deploy 1 ")
    wait_for(lambda: (out / "f").exists() and (out / "f").read_text() == "one\n", what="deploy 1")
    (src / "main.yaml").write_text(yaml_graph(out, "f", "two\n"))
    assert deploy(state, src / "main.yaml", "--key", key_b).startswith("deploy 2 ")
    wait_for(log_has(a, f"deploy 2 is signed by {fingerprint(theirs)}"), what="refused")
    # the operator trusts B instead of A (pins.json, edited by other processes)
    r = run_cli("hosts", "trust-deployer", theirs, "--state-dir", state)
    assert r.returncode == 0, r.stderr
    r = run_cli("hosts", "forget-deployer", mine, "--state-dir", state)
    assert r.returncode == 0, r.stderr
    assert Pins(state).trusted_deployers() == [theirs]
    wait_for(
        lambda: (out / "f").read_text() == "two\n", timeout=5, what="deploy 2 runs, no restart"
    )
    wait_for(log_has(a, "the trusted deployers changed (pins.json)"), what="logged")
    assert a.proc.poll() is None
