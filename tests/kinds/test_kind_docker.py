"""docker:container and docker:image against a real Docker engine (`tests/kit/dockerbed.py`:
a private dockerd per test session, vfs, no bridge; the one image imported from a
busybox-static rootfs tarball, never pulled).

In process (`run_steps`): the timeline of each kind (create, clean, drift by the
docker CLI, repair; stop, remove; force; the image from a tarball, removed), and the
watch (the engine's events, and its restart). End to end (`evergraph run`): a graph
converges, a second run changes nothing, out-of-band `docker stop` / `docker rm -f`
are each repaired by one apply, dockerd restarted is recovered from, and `meta:
reverse` removes what the graph created. Bad input: one line naming the field,
exit 2, nothing created.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

import evergraph.resources  # noqa: F401  (declares the built-in kinds)
from evergraph.engine.build import build
from evergraph.engine.contract import Resource, default_registry
from evergraph.errors import InputError
from evergraph.testing.kinds import (
    Apply,
    Call,
    Check,
    ExpectClean,
    FakeHandle,
    Start,
    arun_steps,
    run_steps,
)
from tests.conftest import EVERGRAPH, Agent, run_cli, wait_for
from tests.kit.dockerbed import IMAGE, DockerBed, busybox_rootfs, docker, dockerbed, needs_dockerd

__all__ = ["docker", "dockerbed"]  # the kit's fixtures, used here

pytestmark = needs_dockerd()


def container(name: str, **params: Any) -> Resource:
    params.setdefault("image", IMAGE)
    params.setdefault("network", "none")
    return build(default_registry, "docker:container", {"name": name, **params})


def image(name: str, **params: Any) -> Resource:
    return build(default_registry, "docker:image", {"name": name, **params})


@pytest.fixture
def engine(docker: DockerBed, monkeypatch: pytest.MonkeyPatch) -> DockerBed:
    """The private engine, as this process's (and its agents') DOCKER_HOST."""
    monkeypatch.setenv("DOCKER_HOST", docker.host)
    return docker


def inspect(bed: DockerBed, name: str, fmt: str) -> str:
    return bed.cli("inspect", "-f", fmt, name).stdout.strip()


# -- bad input (no engine needed) ------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "params", "field", "why"),
    [
        ("docker:container", {"name": "web", "image": IMAGE, "state": "gone"}, "state", "running"),
        ("docker:container", {"name": "w"}, "name", "container name"),
        ("docker:container", {"name": "web"}, "image", "an image is needed"),
        ("docker:container", {"name": "web", "image": "Bad Image"}, "image", "image reference"),
        ("docker:container", {"name": "web", "image": IMAGE, "env": ["A B"]}, "env", "VAR=value"),
        (
            "docker:container",
            {"name": "web", "image": IMAGE, "ports": {"icmp": {80: 8080}}},
            "ports",
            "tcp, udp or sctp",
        ),
        (
            "docker:container",
            {"name": "web", "image": IMAGE, "ports": {"tcp": {80: 70000}}},
            "ports",
            "1 to 65535",
        ),
        (
            "docker:container",
            {"name": "web", "image": IMAGE, "apiversion": "1.41"},
            "apiversion",
            "vX.Y",
        ),
        ("docker:image", {"name": "x:1", "state": "present"}, "state", "exists"),
        ("docker:image", {"name": "x:1", "source": "rel.tar"}, "source", "absolute"),
    ],
)
def test_bad_input_names_the_field(kind: str, params: dict[str, Any], field: str, why: str) -> None:
    with pytest.raises(InputError) as e:
        build(default_registry, kind, params).validate()
    assert f"{kind}[{params['name']}].{field}" in str(e.value)
    assert why in str(e.value)


def test_bad_input_in_a_graph_is_one_line_exit_2_nothing_created(
    engine: DockerBed, tmp_path: Path
) -> None:
    g = tmp_path / "g.yaml"
    g.write_text(
        "graph: d\nresources:\n  docker:container:\n"
        f"  - {{name: good, image: '{IMAGE}', network: none}}\n"
        f"  - {{name: bad, image: '{IMAGE}', state: paused}}\n"
    )
    run = ("run", str(g), "--state-dir", str(tmp_path / "s"), "--converged-exit")
    for args in (("check", str(g)), run):
        r = subprocess.run(
            [*EVERGRAPH, *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2, r.stderr
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert len(lines) == 1, r.stderr
        assert "docker:container[bad].state" in lines[0]
    assert engine.state("good") is None
    assert engine.state("bad") is None


def test_mgmt_docker_kinds_are_known_now(tmp_path: Path) -> None:
    g = tmp_path / "g.yaml"
    g.write_text(
        "graph: d\nresources:\n  docker:image:\n  - name: ubuntu\n"
        "  docker:container:\n  - name: web\n    image: ubuntu\n    state: stopped\n"
        "    cmd: [sleep, '9']\n    env: [A=b]\n    ports: {tcp: {80: 8080}}\n    force: true\n"
    )
    r = run_cli("check", g)
    assert r.returncode == 0, r.stderr


# -- docker:container in process --------------------------------------------------------


def test_container_timeline_create_clean_drift_repair(engine: DockerBed) -> None:
    res = container("eg-run", env=["GREETING=hi"], ports={"tcp": {80: 8080}})
    run_steps(
        res,
        [
            Start(),
            Check(ok=False, changes=["state"]),
            Apply(changes=["state"]),
            ExpectClean(),
            Call(lambda: engine.cli("stop", "eg-run")),  # out of band
            Check(ok=False, changes=["state"]),
            Apply(changes=["state"]),
            ExpectClean(),
            Call(lambda: engine.cli("rm", "-f", "eg-run")),
            Apply(changes=["state"]),
            ExpectClean(),
        ],
    )
    assert engine.state("eg-run") == "running"
    assert "GREETING=hi" in inspect(engine, "eg-run", "{{json .Config.Env}}")
    assert inspect(engine, "eg-run", "{{json .HostConfig.PortBindings}}") == (
        '{"80/tcp":[{"HostIp":"0.0.0.0","HostPort":"8080"}]}'
    )
    assert inspect(engine, "eg-run", '{{index .Config.Labels "evergraph.resource"}}') == (
        "docker:container[eg-run]"
    )


def test_container_stopped_then_removed(engine: DockerBed) -> None:
    run_steps(
        container("eg-stop", state="stopped", cmd=["/bin/sleep", "600"]),
        [Start(), Apply(changes=["state"]), ExpectClean()],
    )
    assert engine.state("eg-stop") == "created"
    assert inspect(engine, "eg-stop", "{{json .Config.Cmd}}") == '["/bin/sleep","600"]'
    engine.cli("start", "eg-stop")
    run_steps(
        container("eg-stop", state="stopped", cmd=["/bin/sleep", "600"], stoptimeout=1),
        [Start(), Apply(changes=["state"]), ExpectClean()],
    )
    assert engine.state("eg-stop") == "exited"
    run_steps(
        container("eg-stop", state="removed"), [Start(), Apply(changes=["state"]), ExpectClean()]
    )
    assert engine.state("eg-stop") is None


def test_container_paused_is_unpaused(engine: DockerBed) -> None:
    engine.cli("run", "-d", "--name", "eg-pause", "--network", "none", IMAGE)
    engine.cli("pause", "eg-pause")
    run_steps(container("eg-pause"), [Start(), Apply(changes=["state"]), ExpectClean()])
    assert inspect(engine, "eg-pause", "{{.State.Paused}}") == "false"
    assert engine.state("eg-pause") == "running"


def test_another_definition_is_an_error_unless_force(engine: DockerBed) -> None:
    engine.cli("create", "--name", "eg-old", "--network", "none", IMAGE)
    before = inspect(engine, "eg-old", "{{.Id}}")
    run_steps(
        container("eg-old", env=["NEW=1"]),
        [
            Start(),
            Check(raises=r"^the container exists with env .*force"),
        ],
    )
    assert inspect(engine, "eg-old", "{{.Id}}") == before  # untouched
    run_steps(
        container("eg-old", env=["NEW=1"], force=True),
        [Start(), Check(ok=False, changes=["env", "state"]), Apply(), ExpectClean()],
    )
    assert inspect(engine, "eg-old", "{{.Id}}") != before
    assert "NEW=1" in inspect(engine, "eg-old", "{{json .Config.Env}}")


def test_a_missing_image_that_cannot_be_pulled_is_one_line(engine: DockerBed) -> None:
    run_steps(
        container("eg-nopull", image="127.0.0.1:1/nothing:1"),
        [Start(), Apply(raises=r"image 127\.0\.0\.1:1/nothing:1 is not here and cannot be pulled")],
    )
    assert engine.state("eg-nopull") is None


def test_no_engine_is_a_clear_failure(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no.sock")
    run_steps(
        container("eg-none"), [Start(), Check(raises=r"Docker engine at unix://.* does not answer")]
    )


# -- docker:image in process ------------------------------------------------------------


def test_image_from_a_tarball_then_absent(engine: DockerBed, tmp_path: Path) -> None:
    tarball = tmp_path / "rootfs.tar"
    tarball.write_bytes(busybox_rootfs())
    ref = "evergraph-test/fromtar:2"
    run_steps(
        image(ref, source=str(tarball)),
        [Start(), Check(ok=False, changes=["state"]), Apply(changes=["state"]), ExpectClean()],
    )
    assert engine.cli("image", "inspect", ref, check=False).returncode == 0
    saved = tmp_path / "saved.tar"
    engine.cli("save", "-o", str(saved), ref)
    run_steps(image(ref, state="absent"), [Start(), Apply(changes=["state"]), ExpectClean()])
    assert engine.cli("image", "inspect", ref, check=False).returncode != 0
    run_steps(image(ref, source=str(saved)), [Start(), Apply(changes=["state"]), ExpectClean()])
    assert engine.cli("image", "inspect", ref, check=False).returncode == 0
    run_steps(image(ref, state="absent"), [Start(), Apply(changes=["state"]), ExpectClean()])


def test_image_present_is_clean(engine: DockerBed) -> None:
    run_steps(image(IMAGE), [Start(), ExpectClean()])
    run_steps(image("evergraph-test/never-here:1", state="absent"), [Start(), ExpectClean()])


# -- the watch ---------------------------------------------------------------------------


async def _until(pred: Callable[[], bool], what: str, timeout: float = 30) -> None:
    """Await a condition the watch's thread brings about (polled in the loop)."""
    async with asyncio.timeout(timeout):
        while not pred():
            await asyncio.sleep(0.01)
    assert pred(), what


@pytest.mark.slow
def test_watch_follows_events_and_the_engine_restarting(engine: DockerBed) -> None:
    res = container("eg-watch")
    handle = FakeHandle()

    async def scenario() -> None:
        await arun_steps(res, [Start(), Apply()], handle)  # (closes the services: new handle below)
        h = FakeHandle()
        await res.init(h)
        task = asyncio.create_task(res.watch())
        try:
            await _until(lambda: h.readies == 1, "ready")
            seen = h.events
            await asyncio.to_thread(engine.cli, "stop", "eg-watch")
            await _until(lambda: h.events > seen, "an event for the stop")
            # another container's events are not this one's
            quiet = h.events
            await asyncio.to_thread(
                engine.cli, "run", "-d", "--name", "eg-other", "--network", "none", IMAGE
            )
            await asyncio.to_thread(engine.cli, "rm", "-f", "eg-other")
            await asyncio.to_thread(engine.cli, "start", "eg-watch")
            await _until(lambda: h.events > quiet, "an event for the start")
            # dockerd restarts: the stream ends, reconnects, and says "look again"
            await asyncio.to_thread(engine.restart)
            await asyncio.to_thread(engine.cli, "start", "eg-watch")
            seen = h.events
            await asyncio.to_thread(engine.cli, "stop", "eg-watch")
            await _until(lambda: h.events > seen, "an event after the reconnect", 60)
            assert h.readies == 1
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await res.cleanup()
            await h.services.aclose()

    asyncio.run(scenario())
    assert not re.search("Traceback", "\n".join(handle.logs))


# -- end to end -------------------------------------------------------------------------


def _graph(path: Path, containers: str) -> Path:
    path.write_text(f"graph: d\nresources:\n  docker:container:\n{containers}")
    return path


def _starts(agent: Agent) -> int:
    return agent.log.read_text().count("docker:container[eg-e2e]: started")


@pytest.mark.slow
def test_agent_converges_repairs_drift_survives_restart_and_reverses(
    engine: DockerBed, tmp_path: Path
) -> None:
    one = f"  - {{name: eg-e2e, image: '{IMAGE}', network: none, meta: {{reverse: true}}}}\n"
    g = _graph(tmp_path / "g.yaml", one)
    state = tmp_path / "state"
    agent = Agent(g, state)
    try:
        agent.wait_converged(1, timeout=60)
        assert engine.state("eg-e2e") == "running"
        assert _starts(agent) == 1
        n = agent.converged_count()
        engine.cli("stop", "eg-e2e")  # out of band
        wait_for(lambda: _starts(agent) == 2, 30, "the stopped container started again")
        agent.wait_converged(n + 1, timeout=30)
        assert engine.state("eg-e2e") == "running"
        n = agent.converged_count()
        engine.cli("rm", "-f", "eg-e2e")
        wait_for(lambda: _starts(agent) == 3, 30, "the removed container created again")
        agent.wait_converged(n + 1, timeout=30)
        assert engine.state("eg-e2e") == "running"
        # each repair was one apply: one create per removal, one start per stop
        assert agent.log.read_text().count("docker:container[eg-e2e]: created") == 2
        assert " error: " not in agent.log.read_text()  # no failed try on the way
        # dockerd restarted (its containers stop with it): recovered by the agent itself
        engine.restart()
        wait_for(lambda: engine.state("eg-e2e") == "running", 60, "the container running again")
        # the graph without it: reversed (removed, as the graph created it)
        n = agent.converged_count()
        g.write_text("graph: d\nresources:\n  noop:\n  - name: left\n")
        wait_for(lambda: engine.state("eg-e2e") is None, 60, "the container removed")
    finally:
        assert agent.stop() in (0, -15), agent.log.read_text()
    assert "Traceback" not in agent.log.read_text()


@pytest.mark.slow
def test_second_run_changes_nothing(engine: DockerBed, tmp_path: Path) -> None:
    g = tmp_path / "g.yaml"
    tarball = tmp_path / "rootfs.tar"
    tarball.write_bytes(busybox_rootfs())
    g.write_text(
        "graph: d\nresources:\n  docker:image:\n"
        f"  - {{name: 'evergraph-test/e2e:3', source: '{tarball}'}}\n"
        "  docker:container:\n"
        "  - {name: eg-twice, image: 'evergraph-test/e2e:3', network: none,"
        f" cmd: {_cmd()}, env: [A=1]}}\n"
    )
    runs = []
    for _ in range(2):
        r = subprocess.run(
            [*EVERGRAPH, "run", str(g), "--state-dir", str(tmp_path / "s"), "--converged-exit"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        runs.append(r.stderr)
    assert "docker:image[evergraph-test/e2e:3]: taken from" in runs[0]
    assert "docker:container[eg-twice]: started" in runs[0]
    assert " error: " not in runs[0]  # the image first (autoedge), no failed try
    assert "recap: nothing changed or failed, 2 clean" in runs[1], runs[1]
    assert "changed docker:" not in runs[1]
    assert engine.state("eg-twice") == "running"
    engine.cli("rm", "-f", "eg-twice")
    engine.cli("rmi", "evergraph-test/e2e:3")


def _cmd() -> str:
    return "['/bin/sh', '-c', 'trap \"exit 0\" TERM; while :; do sleep 1; done']"


def test_reversal_is_what_was_found(engine: DockerBed) -> None:
    async def reversals() -> list[dict[str, Any] | None]:
        out = []
        for res in (
            container("eg-rev"),  # none there: reversed by removing it
            container("eg-rev", state="removed"),  # none there, none wanted: nothing
            image("evergraph-test/rev:1"),  # not there: reversed by removing it
            image(IMAGE, state="absent"),  # there: reversed by getting it back
        ):
            h = FakeHandle()
            await Start().run(res, h)
            rev = res.reversal()
            out.append(None if rev is None else {"kind": rev.kind, **msgspec.to_builtins(rev)})
            await res.cleanup()
            await h.services.aclose()
        return out

    got = asyncio.run(reversals())
    assert got[0] is not None
    assert (got[0]["kind"], got[0]["state"], got[0]["image"]) == (
        "docker:container",
        "removed",
        IMAGE,
    )
    assert got[1] is None
    assert got[2] is not None
    assert (got[2]["kind"], got[2]["state"]) == ("docker:image", "absent")
    assert got[3] is not None
    assert (got[3]["kind"], got[3]["state"]) == ("docker:image", "exists")


def test_no_engine_fails_the_vertex_in_one_line_and_the_rest_runs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no.sock")
    other = tmp_path / "other"
    g = tmp_path / "g.yaml"
    g.write_text(
        "graph: d\nresources:\n  docker:container:\n"
        f"  - {{name: eg-nowhere, image: '{IMAGE}', network: none}}\n"
        f"  file:\n  - {{name: {other}, content: 'x'}}\n"
    )
    r = subprocess.run(
        [*EVERGRAPH, "run", str(g), "--state-dir", str(tmp_path / "s"), "--converged-exit"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1, r.stderr
    assert other.read_text() == "x"
    lines = [
        line for line in r.stderr.splitlines() if "error: docker:container[eg-nowhere]" in line
    ]
    assert lines, r.stderr
    assert "does not answer" in lines[0]
    assert "Traceback" not in r.stderr


def test_resources_of_an_agent_share_one_client_and_one_event_stream(engine: DockerBed) -> None:
    from evergraph.engine.services import Services
    from evergraph.resources._docker import DockerEngines

    async def scenario() -> None:
        services = Services()
        resources = [container(f"eg-share{i}") for i in range(5)] + [image(IMAGE)]
        handles = [FakeHandle(services=services) for _ in resources]
        tasks = []
        try:
            for res, h in zip(resources, handles, strict=True):
                await Start().run(res, h)
                tasks.append(asyncio.create_task(res.watch()))
            await _until(lambda: all(h.readies == 1 for h in handles), "every watch ready")
            engines = services.get(DockerEngines)._engines
            assert len(engines) == 1
            (shared,) = engines.values()
            await _until(shared.connected.is_set, "the stream open")
            for res in resources:
                assert res._engine is shared  # type: ignore[attr-defined]
            streams = [t for t in threading.enumerate() if t.name.startswith("docker events")]
            assert len(streams) == 1
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for res in resources:
                await res.cleanup()
            await services.aclose()
        assert not [t for t in threading.enumerate() if t.name.startswith("docker events")]

    asyncio.run(scenario())
