"""Benchmark: docker:container drift repair on a real Docker engine (issue 27).

The engine is tests/kit/dockerbed.py's own (`DockerBed`: a private dockerd with
its own data root, exec root and socket, vfs, no bridge; the busybox image
imported from a local tarball, never pulled). The kit takes no machine lock
(the engine is private), nor does the bench.

Measured: an agent (`evergraph run`, one running container, `network: none`,
whose command ends at once on SIGTERM: `CMD`)
and out-of-band `docker stop` (then `docker rm -f`), TRIALS times each: the
time from the command's launch and from its return to the container running
again (the engine's `start` event for it, seen by an observer of the bench's
own on the engine's event stream). The peer: a 1 s polling loop with the
Docker SDK for Python (docker-py) in a process of its own: every second the
container's status; started if not running, created and started if missing.
Before each drift a random pause of 0-1 s (uniform), so the drift falls at any
phase of the poller's second. The agent's repairs are counted in its log.

`python -m bench.containers [--trials N] [--json F]` runs it alone;
`scripts/bench --only docker` with the defaults (`--quick`: 5 trials). Needs
root, dockerd (docker.io) and busybox-static. At the end the agent and the
poller are stopped by their pids, the containers removed, and dockerd stopped
by its pid (its containerd goes with it), its directory removed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.common import PYTHON, REPO, machine, spawn, stop, table
from bench.virt import Agent, Events, drift_rows, env, ratio_rows, wait

TRIALS = 50
POLL = 1.0
NAME = "eg-bench"
#: the container's command: PID 1 ends on SIGTERM at once (`wait` is interrupted by
#: the trap; the kit's IMAGE_CMD waits out its `sleep 1` first, so a `docker stop`
#: would end on the container's own second, phase-locked to the poller's ticks)
CMD = ["/bin/sh", "-c", "trap 'exit 0' TERM; while :; do sleep 1 & wait $!; done"]


@contextlib.contextmanager
def docker_bed() -> Iterator[Any]:
    """The kit's engine, as its `dockerbed` fixture makes and ends it."""
    from tests.kit.dockerbed import docker_engine

    with docker_engine("evergraph-docker-bench-") as bed:
        yield bed


class Observer:
    """The engine's `start` events for containers: (monotonic time, name)."""

    def __init__(self, host: str) -> None:
        import docker

        self.client = docker.DockerClient(base_url=host)
        #: (monotonic time, container name, action: start, die, destroy...)
        self.events = Events()
        self.stream = self.client.events(decode=True, filters={"type": "container"})
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with contextlib.suppress(Exception):
            for ev in self.stream:
                name = ev.get("Actor", {}).get("Attributes", {}).get("name", "")
                self.events.add(name, ev.get("Action", ""))

    def wait(self, name: str, action: str, since: float, timeout: float) -> float:
        return self.events.wait(name, (action,), since, timeout)

    def running(self, name: str) -> bool:
        import docker

        try:
            c = self.client.containers.get(name)
        except docker.errors.NotFound:
            return False
        return bool(c.status == "running")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stream.close()
        self.client.close()


def poll_main(argv: list[str]) -> int:
    """`python -m bench.containers poll HOST NAME IMAGE`: every POLL s, NAME running."""

    import docker

    host, name, image = argv
    client = docker.DockerClient(base_url=host)
    tick = time.monotonic()
    while True:
        with contextlib.suppress(docker.errors.APIError):
            try:
                c = client.containers.get(name)
            except docker.errors.NotFound:
                client.containers.run(image, CMD, name=name, network_mode="none", detach=True)
            else:
                if c.status == "paused":
                    c.unpause()
                elif c.status != "running":
                    c.start()
        tick += POLL
        time.sleep(max(0.0, tick - time.monotonic()))


def drift_trials(
    obs: Observer,
    cli: Callable[..., Any],
    drift: list[str],
    trials: int,
    ready: Callable[[], bool],
) -> dict[str, list[float]]:
    from_launch: list[float] = []
    from_done: list[float] = []
    from_event: list[float] = []
    for _ in range(trials):
        wait(lambda: obs.running(NAME) and ready(), 120, f"{NAME} running and settled")
        time.sleep(random.uniform(0, 1))
        began = time.monotonic()
        cli(*drift, NAME)
        done = time.monotonic()
        t = obs.wait(NAME, "start", began, 60)
        from_launch.append(t - began)
        from_done.append(t - done)
        from_event.append(t - obs.wait(NAME, "die", began, 1))
    return {"from_launch": from_launch, "from_done": from_done, "from_event": from_event}


DRIFTS = {"stop": ["stop"], "rm": ["rm", "-f"]}


def repair_latency(bed: Any, tmp: Path, trials: int) -> dict[str, Any]:
    from tests.kit.dockerbed import IMAGE

    graph = tmp / "one.yaml"
    graph.write_text(
        "graph: d\nresources:\n  docker:container:\n"
        f"  - {{name: {NAME}, image: '{IMAGE}', network: none, cmd: {json.dumps(CMD)}}}\n"
    )
    obs = Observer(bed.host)
    out: dict[str, Any] = {}
    try:
        agent = Agent(graph, tmp / "agent", {"DOCKER_HOST": bed.host})
        try:
            agent.wait_converged(120)
            mark = (agent.count(": started"), agent.count(": created"))
            for drift, argv in DRIFTS.items():
                print(f"docker: evergraph, {drift} x {trials}", file=sys.stderr, flush=True)
                out[f"evergraph_{drift}"] = drift_trials(
                    obs, bed.cli, argv, trials, agent.converged
                )
                time.sleep(0.5)
            out["evergraph_repairs"] = {
                "started": agent.count(f"docker:container[{NAME}]: started") - mark[0],
                "created": agent.count(f"docker:container[{NAME}]: created") - mark[1],
                "errors": agent.count(" error: "),
            }
        finally:
            agent.stop()
        with open(tmp / "poll.log", "ab") as log:
            poller = spawn(
                [PYTHON, "-m", "bench.containers", "poll", bed.host, NAME, IMAGE],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env(),
                cwd=REPO,
            )
        try:
            for drift, argv in DRIFTS.items():
                print(f"docker: 1 s poller, {drift} x {trials}", file=sys.stderr, flush=True)
                out[f"poll_{drift}"] = drift_trials(
                    obs, bed.cli, argv, trials, lambda: poller.poll() is None
                )
        finally:
            stop(poller)
    finally:
        obs.close()
    return out


def report(res: dict[str, Any]) -> str:
    header = ["what", "n", "p50", "p99", "min", "max"]
    tools = [("evergraph", "evergraph agent"), ("poll", "1 s poller")]
    rep = res.get("repair", {})
    rows = drift_rows(rep, tools, list(DRIFTS))
    text = table(
        "docker: drift repair, out-of-band docker -> running again (issue 27)", header, rows
    )
    notes = ratio_rows(rep, "poll", list(DRIFTS))
    r = rep.get("evergraph_repairs")
    if r:
        notes.append(
            f"agent's repairs counted in its log: {r['started']} starts "
            f"({r['created']} of them after a create); {r['errors']} error lines"
        )
    return text + "\n" + "\n".join(notes)


def run(quick: bool, trials: int | None = None) -> tuple[dict[str, Any], str]:
    import tempfile

    trials = trials or (5 if quick else TRIALS)
    res: dict[str, Any] = {
        "machine": machine(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "load_before": os.getloadavg(),
        "trials": trials,
    }
    tmp = Path(tempfile.mkdtemp(prefix="bench-docker-", dir="/var/tmp"))
    try:
        with docker_bed() as bed:
            res["repair"] = repair_latency(bed, tmp, trials)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res["load_after"] = os.getloadavg()
    return res, report(res)


def main(argv: list[str]) -> int:
    if argv and argv[0] == "poll":
        return poll_main(argv[1:])
    ap = argparse.ArgumentParser(
        prog="python -m bench.containers", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--trials", type=int, default=TRIALS)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    from bench.common import standalone

    return standalone(lambda: run(False, a.trials), a.json)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
