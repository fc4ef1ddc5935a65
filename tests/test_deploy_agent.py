"""Agents started without FILE follow the newest deploy and swap to it live;
`run FILE` on an etcd cluster publishes FILE as a deploy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evergraph.world.etcd_server import EtcdServer

from .conftest import Agent, run_cli, wait_for


def yaml_graph(out: Path, name: str, content: str) -> str:
    return (
        f"graph: g-{name}\nresources:\n  file:\n"
        f"  - {{name: {name}, path: {out / name}, content: {json.dumps(content)}}}\n"
    )


def deploy(state: Path, entry: Path) -> str:
    r = run_cli("deploy", entry, "--no-git", "--state-dir", state)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_agent_without_file_follows_deploys_live(tmp_path: Path, agents) -> None:  # type: ignore[no-untyped-def]
    state, out = tmp_path / "st", tmp_path / "out"
    a: Agent = agents(None, state, "-v")
    wait_for(lambda: "no deploy in the World yet" in a.log.read_text(), what="waiting message")

    # deploy 1: YAML, with a file it references next to it
    src1 = tmp_path / "src1"
    src1.mkdir()
    (src1 / "main.yaml").write_text(yaml_graph(out, "a", "one\n"))
    assert deploy(state, src1 / "main.yaml").startswith("deploy 1 ")
    wait_for(lambda: (out / "a").exists() and (out / "a").read_text() == "one\n", what="deploy 1")

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
    wait_for(lambda: "running deploy 2" in a.log.read_text(), what="log")

    # deploy 3 does not load: logged, skipped, deploy 2 keeps running (and repairing)
    src3 = tmp_path / "src3"
    src3.mkdir()
    (src3 / "site.py").write_text("def graph(g, world)\n")
    assert deploy(state, src3 / "site.py").startswith("deploy 3 ")
    wait_for(lambda: "deploy 3: " in a.log.read_text(), what="deploy 3 rejected")
    assert "Python syntax error" in a.log.read_text()
    (out / "b").write_text("drift\n")
    wait_for(lambda: (out / "b").read_text() == "two\n", what="deploy 2 still repairs drift")

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


def test_following_deploys_needs_a_shared_world(tmp_path: Path) -> None:
    state = tmp_path / "st"
    r = run_cli("run", "--state-dir", state, "--world", "memory", "--converged-exit")
    assert r.returncode == 2, r.stderr
    assert "follows deploys from a shared World" in r.stderr
    # waiting for a first deploy honours --max-runtime (and signals)
    r = run_cli("run", "--state-dir", state, "--max-runtime", "0.3")
    assert r.returncode == 0, r.stderr
    assert "no deploy in the World yet" in r.stderr
    r = run_cli("check")
    assert r.returncode == 2


@pytest.mark.slow
def test_run_file_on_etcd_publishes_a_deploy_others_follow(
    tmp_path: Path, shm: Path, servers: list[EtcdServer], agents
) -> None:  # type: ignore[no-untyped-def]
    server = EtcdServer.single(shm)
    servers.append(server)
    server.start()
    seeds = ("--seeds", server.client_url)
    out = tmp_path / "out"
    src = tmp_path / "src"
    src.mkdir()
    (src / "site.yaml").write_text(yaml_graph(out, "shared", "from the first host\n"))
    first: Agent = agents(src / "site.yaml", tmp_path / "s1", "--hostname", "h1", *seeds, "-v")
    first.wait_converged()
    wait_for(lambda: "as deploy 1" in first.log.read_text(), what="published as deploy 1")
    (out / "shared").unlink()
    follower: Agent = agents(None, tmp_path / "s2", "--hostname", "h2", *seeds)
    follower.wait_converged()
    assert (out / "shared").read_text() == "from the first host\n"
    # saving FILE on the first host publishes deploy 2; the follower swaps to it
    (src / "site.yaml").write_text(yaml_graph(out, "shared", "edited\n"))
    wait_for(lambda: "as deploy 2" in first.log.read_text(), what="published as deploy 2")
    wait_for(lambda: (out / "shared").read_text() == "edited\n", what="follower on deploy 2")
    wait_for(lambda: "running deploy 2" in follower.log.read_text(), what="follower log")
    # a restart with the same files publishes nothing new
    assert first.stop() == 0
    again: Agent = agents(src / "site.yaml", tmp_path / "s1", "--hostname", "h1", *seeds)
    again.wait_converged()
    r = run_cli("deploys", *seeds)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("site.yaml") == 2, r.stdout
