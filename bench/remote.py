"""Benchmark: `evergraph remote` against pyinfra and ansible-core (issue 26).

The same job for the three tools, over the same sshds (tests/kit/sshbed.py: one
network namespace per host, each with its own sshd, a client key and a
known_hosts file the bed makes): on every host, a file named after the host
holding its name, then an exec with `creates` (touch a marker once). Over 1, 8
and 32 hosts, a first run (nothing on the hosts: for evergraph, the remote
bundle store wiped; for all, the managed files and root's home emptied) and a
no-change second run. Measured: wall time of the tool's command and the bytes
sent to the hosts (the sum of the hosts' eth0 rx_bytes over the run).

- evergraph: `evergraph remote site.py HOST...` with the tests' own graph and
  argv (tests/remote/test_remote.py: graph_file, remote_argv): the CLI's default
  end (the session ends once every host converged and its World is quiet for
  0.5 s); `--converged-timeout S` measures the per-agent timeout instead (each
  agent exits after S s without change, as every run did before the coordinated
  end).
- pyinfra: an inventory (user, key, known_hosts, strict host key checking) and
  a deploy with files.put (content from memory) and server.shell guarded by
  `test -e MARK ||` (pyinfra has no `creates`), `-y --parallel 32`.
- ansible-core: an inventory and a playbook (copy content=, command creates=),
  `-f 32`, `gather_facts: false` (the job needs no facts), pipelining on (its
  documented speed-up), strict host key checking against the bed's known_hosts;
  each run opens its own SSH connections (the ControlPersist masters of a run
  are closed after it).

The comparison tools live in their own venv, `bench/.venv-compare` (gitignored),
made from bench/compare-requirements.txt with pip on first use (never in the
project's .venv); the bench says when it makes it and which versions ran.

`python -m bench.remote [--hosts 1,8,32] [--tools evergraph,pyinfra,ansible]
[--converged-timeout S] [--json F]` runs it alone; `--profile N` instead times
the phases of one first and one second evergraph run on N hosts (in-process:
bundle hash, etcd, SSH connect, bundle install and within it the build of the
shared gzip'd plan (a thread; ~0.2 s when the initiator kept it from an earlier
run: delete ~/.cache/evergraph/plans for a cold one), graph copy, agent start-up,
the converged wait); `scripts/bench --only remote` runs it over 1, 8 and
32 hosts (`--quick`: 1 and 8). Needs root, iproute2, nft, ssh-keygen and
Debian's openssh-server (as the remote tests do). While it runs it holds the
tests' one-cluster lock (tests/kit/machine.py), so no multi-host cluster test
shares the cores with it. Bench code imports the bed and the graph from tests/
here (the brief of issue 26 asks for the same sshds as the tests).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import REPO, machine, table, temp_dir, tool_venv

SIZES = (1, 8, 32)
QUICK_SIZES = (1, 8)
TOOLS = ("evergraph", "pyinfra", "ansible")
RUNS = ("first", "second")
FORKS = 32
#: evergraph's --converged-timeout: None, the CLI's default (the coordinated end)
CONVERGED_TIMEOUT: float | None = None
#: a run that takes longer than this is a failure of the run, not a number
RUN_TIMEOUT = 900.0
REQUIREMENTS = REPO / "bench" / "compare-requirements.txt"
COMPARE_VENV = REPO / "bench" / ".venv-compare"
#: the python the hosts run the competitors' modules with (evergraph finds python3)
HOST_PYTHON = "/usr/bin/python3"
CLUSTER_LOCK = Path("/tmp/evergraph-tests-one-cluster.lock")


@dataclass
class Result:
    tool: str
    hosts: int
    run: str
    wall_s: float
    bytes: int
    ok: bool
    note: str = ""


# -- the comparison tools' venv -------------------------------------------------------
def compare_venv() -> tuple[Path, dict[str, str]]:
    """bench/.venv-compare (`tool_venv`): its bin dir and the versions of the tools."""
    return tool_venv(COMPARE_VENV, REQUIREMENTS, ("pyinfra", "ansible-core"), "remote")


# -- the job, written for each tool -----------------------------------------------------
def _env(tmp: Path, **extra: str) -> dict[str, str]:
    import evergraph

    src = str(Path(evergraph.__file__).resolve().parent.parent)
    env = {
        **os.environ,
        "SSH_AUTH_SOCK": "",
        "HOME": str(tmp),
        "TMPDIR": str(tmp),
        "PYTHONPATH": os.pathsep.join([src, str(REPO)]),
        **extra,
    }
    env.pop("VIRTUAL_ENV", None)
    return env


def _addrs(bed: Any) -> list[str]:
    return [h.addr for h in bed.hosts]


def evergraph_job(
    bed: Any, work: Path, converged_timeout: float | None
) -> tuple[list[str], dict[str, str]]:
    from tests.remote.test_remote import graph_file, remote_argv

    d = work / "evergraph"
    d.mkdir(exist_ok=True)
    site = graph_file(d, bed.files)
    argv = remote_argv(
        bed, site, *(f"root@{a}" for a in _addrs(bed)), converged_timeout=converged_timeout
    )
    return argv, _env(d)


def pyinfra_job(bed: Any, work: Path, bin_dir: Path) -> tuple[list[str], dict[str, str]]:
    d = work / "pyinfra"
    d.mkdir(exist_ok=True)
    data = {
        "ssh_user": "root",
        "ssh_key": str(bed.client_key),
        "ssh_known_hosts_file": str(bed.known_hosts),
        "ssh_strict_host_key_checking": "yes",
        "ssh_allow_agent": False,
        "ssh_look_for_keys": False,
    }
    hosts = [(a, data) for a in _addrs(bed)]
    (d / "inventory.py").write_text(f"bench = {hosts!r}\n")
    files = bed.files
    (d / "deploy.py").write_text(
        "from io import StringIO\n"
        "from pyinfra import host\n"
        "from pyinfra.operations import files, server\n\n"
        "files.put(\n"
        "    name='a file named after the host',\n"
        "    src=StringIO(host.name + '\\n'),\n"
        f"    dest='{files}/' + host.name,\n"
        ")\n"
        "server.shell(\n"
        "    name='an exec with creates',\n"
        f"    commands=['test -e {files}/ran || touch {files}/ran'],\n"
        ")\n"
    )
    argv = [
        str(bin_dir / "pyinfra"),
        "-y",
        "--parallel",
        str(FORKS),
        str(d / "inventory.py"),
        str(d / "deploy.py"),
    ]
    return argv, _env(d, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def ansible_job(bed: Any, work: Path, bin_dir: Path) -> tuple[list[str], dict[str, str]]:
    d = work / "ansible"
    d.mkdir(exist_ok=True)
    ssh_args = (
        f"-o UserKnownHostsFile={bed.known_hosts} -o StrictHostKeyChecking=yes "
        "-o IdentitiesOnly=yes"
    )
    (d / "inventory.ini").write_text(
        "[bench]\n" + "".join(f"{a}\n" for a in _addrs(bed)) + "\n[bench:vars]\n"
        "ansible_user=root\n"
        f"ansible_ssh_private_key_file={bed.client_key}\n"
        f"ansible_python_interpreter={HOST_PYTHON}\n"
        f"ansible_ssh_common_args={ssh_args}\n"
    )
    files = bed.files
    (d / "site.yml").write_text(
        "- hosts: bench\n"
        "  gather_facts: false\n"
        "  tasks:\n"
        "    - name: a file named after the host\n"
        "      copy:\n"
        '        content: "{{ inventory_hostname }}\\n"\n'
        f'        dest: "{files}/{{{{ inventory_hostname }}}}"\n'
        "    - name: an exec with creates\n"
        f"      command: touch {files}/ran\n"
        "      args:\n"
        f"        creates: {files}/ran\n"
    )
    (d / "ansible.cfg").write_text(
        "[defaults]\n"
        f"forks = {FORKS}\n"
        "host_key_checking = True\n"
        f"local_tmp = {d}/local-tmp\n"
        "retry_files_enabled = False\n"
        "[ssh_connection]\n"
        "pipelining = True\n"
        f"control_path_dir = {d}/cp\n"
    )
    argv = [
        str(bin_dir / "ansible-playbook"),
        "-f",
        str(FORKS),
        "-i",
        str(d / "inventory.ini"),
        str(d / "site.yml"),
    ]
    env = _env(
        d,
        ANSIBLE_CONFIG=str(d / "ansible.cfg"),
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        ANSIBLE_NOCOLOR="1",
    )
    return argv, env


def close_control_masters(work: Path) -> None:
    """End the ControlPersist ssh masters an ansible run left (each run connects anew)."""
    cp = work / "ansible" / "cp"
    for sock in sorted(cp.glob("*")) if cp.is_dir() else []:
        subprocess.run(
            ["ssh", "-o", f"ControlPath={sock}", "-O", "exit", "bench"],
            capture_output=True,
            timeout=30,
            check=False,
        )


# -- runs --------------------------------------------------------------------------------
def reset_hosts(bed: Any) -> None:
    """Nothing on the hosts: the managed files, the bundle store (/var/lib/evergraph)
    and root's home (where ansible leaves ~/.ansible) emptied."""
    for h in bed.hosts:
        for top in (h.files, h.var_lib, h.home):
            for p in top.iterdir():
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()


def job_done(bed: Any) -> bool:
    return all(
        (h.files / h.addr).is_file()
        and (h.files / h.addr).read_text() == f"{h.addr}\n"
        and (h.files / "ran").exists()
        for h in bed.hosts
    )


def run_once(
    tool: str, which: str, bed: Any, argv: list[str], env: dict[str, str], logs: Path
) -> Result:
    before = sum(h.bytes_received() for h in bed.hosts)
    t0 = time.perf_counter()
    try:
        r = subprocess.run(
            argv, capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT, cwd=logs
        )
        wall = time.perf_counter() - t0
        code, out = r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        wall = time.perf_counter() - t0
        code, out = -1, f"timed out after {RUN_TIMEOUT} s\n{e.stdout!r}{e.stderr!r}"
    sent = sum(h.bytes_received() for h in bed.hosts) - before
    log = logs / f"{tool}-{len(bed.hosts)}-{which}.log"
    log.write_text(out)
    ok = code == 0 and job_done(bed)
    note = "" if ok else f"exit {code}, job {'done' if job_done(bed) else 'NOT done'}; see {log}"
    return Result(tool, len(bed.hosts), which, round(wall, 2), sent, ok, note)


@contextlib.contextmanager
def one_cluster_lock() -> Iterator[None]:
    """The tests' one-cluster lock: no multi-host cluster test runs beside the bench."""
    with open(CLUSTER_LOCK, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print("remote: waiting for the one-cluster lock", file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def bench_size(
    n: int,
    tools: Sequence[str],
    bin_dir: Path | None,
    tmp: Path,
    logs: Path,
    converged_timeout: float | None,
) -> list[Result]:
    from tests.kit.sshbed import SshBed

    results: list[Result] = []
    t0 = time.perf_counter()
    with SshBed(n, tmp=tmp / f"bed{n}") as bed:
        print(f"remote: {n} host(s) up in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        work = tmp / f"work{n}"
        work.mkdir()
        for tool in tools:
            if tool == "evergraph":
                argv, env = evergraph_job(bed, work, converged_timeout)
            elif tool == "pyinfra":
                assert bin_dir is not None
                argv, env = pyinfra_job(bed, work, bin_dir)
            else:
                assert bin_dir is not None
                argv, env = ansible_job(bed, work, bin_dir)
            reset_hosts(bed)
            for which in RUNS:
                res = run_once(tool, which, bed, argv, env, logs)
                if tool == "ansible":
                    close_control_masters(work)
                print(
                    f"remote: {tool} {n} host(s) {which}: {res.wall_s} s, {res.bytes} B"
                    f"{'' if res.ok else ' FAILED ' + res.note}",
                    file=sys.stderr,
                    flush=True,
                )
                results.append(res)
    return results


def render(results: list[Result], versions: dict[str, str]) -> str:
    rows = [
        [
            r.tool,
            str(r.hosts),
            r.run,
            f"{r.wall_s:.2f}",
            f"{r.bytes:,}",
            f"{r.bytes // max(r.hosts, 1):,}",
            "ok" if r.ok else "FAILED",
        ]
        for r in results
    ]
    head = ["tool", "hosts", "run", "wall s", "bytes", "bytes/host", ""]
    title = "remote: the same file + exec over the same sshds (issue 26)"
    if versions:
        title += "; " + ", ".join(f"{k} {v}" for k, v in versions.items())
    text = table(title, head, rows)
    by = {(r.tool, r.hosts, r.run): r for r in results}
    ratio_rows = []
    for r in results:
        if r.tool != "evergraph":
            continue
        for other in TOOLS[1:]:
            o = by.get((other, r.hosts, r.run))
            if o is None:
                continue
            ratio_rows.append(
                [
                    f"evergraph/{other}",
                    str(r.hosts),
                    r.run,
                    f"{r.wall_s / o.wall_s:.2f}" if o.wall_s else "-",
                    f"{r.bytes / o.bytes:.2f}" if o.bytes else "-",
                ]
            )
    if ratio_rows:
        text += "\n\n" + table(
            "ratios (< 1: evergraph is faster / sends less)",
            ["ratio", "hosts", "run", "wall", "bytes"],
            ratio_rows,
        )
    return text


def bench(
    sizes: Sequence[int],
    tools: Sequence[str],
    converged_timeout: float | None = CONVERGED_TIMEOUT,
) -> tuple[dict[str, Any], str]:
    bin_dir: Path | None = None
    versions: dict[str, str] = {}
    if any(t != "evergraph" for t in tools):
        bin_dir, versions = compare_venv()
    results: list[Result] = []
    with temp_dir("/tmp", "evergraph-bench-remote-") as tmp, one_cluster_lock():
        logs = tmp / "logs"
        logs.mkdir()
        try:
            for n in sizes:
                results += bench_size(n, tools, bin_dir, tmp, logs, converged_timeout)
        finally:
            keep = REPO / "bench" / "results" / "remote-logs"
            shutil.rmtree(keep, ignore_errors=True)
            shutil.copytree(logs, keep)
    out = {
        "versions": versions,
        "converged_timeout": converged_timeout,
        "results": [asdict(r) for r in results],
    }
    return out, render(results, versions)


# -- where evergraph's seconds go ------------------------------------------------------
@dataclass
class Span:
    host: str
    phase: str
    start: float
    end: float


def profile_run(
    bed: Any, site: Path, converged_timeout: float | None
) -> tuple[float, list[Span], int]:
    """One `evergraph remote` run in this process (RemoteRun, as the CLI builds it),
    each phase timed: the bundle's build and hash, etcd's start and stop, and per
    host the SSH connect, the bundle install, the graph copy, the agent (up to its
    first line: python start + imports + World; to its `converged:` line; to its
    exit). Returns the wall time, the spans and the run's exit status."""
    import asyncio
    from unittest import mock

    from evergraph.remote import bundle as bundle_mod
    from evergraph.remote import runner
    from evergraph.remote.bundle import Bundle
    from evergraph.remote.runner import RemoteRun, exit_status
    from evergraph.remote.session import AgentArgs, SshOptions
    from evergraph.remote.target import Target
    from evergraph.world.etcd_server import EtcdServer

    spans: list[Span] = []
    lines: dict[str, list[tuple[float, str]]] = {}

    def sync(phase: str, fn: Any) -> Any:
        def wrapper(*a: Any, **kw: Any) -> Any:
            s = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spans.append(Span("-", phase, s, time.perf_counter()))

        return wrapper

    def host_async(phase: str, fn: Any, host: Any) -> Any:
        async def wrapper(*a: Any, **kw: Any) -> Any:
            s = time.perf_counter()
            try:
                return await fn(*a, **kw)
            finally:
                spans.append(Span(host(a, kw), phase, s, time.perf_counter()))

        return wrapper

    def peer(a: Any, kw: Any) -> str:
        return str(a[0].get_extra_info("peername")[0])

    def emit(label: str, line: str) -> None:
        lines.setdefault(label, []).append((time.perf_counter(), line))

    targets = [Target.parse(f"root@{a}") for a in _addrs(bed)]
    rr = RemoteRun(
        site,
        targets,
        ssh=SshOptions(keys=[bed.client_key], known_hosts=bed.known_hosts),
        agent=AgentArgs(converged_timeout=converged_timeout),
        parallel=FORKS,
    )
    bundle_of = Bundle.of_running_python
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(os.environ, {"SSH_AUTH_SOCK": ""}))
        stack.enter_context(
            mock.patch.object(Bundle, "of_running_python", sync("bundle build + hash", bundle_of))
        )
        # the objects' tar + gzip, built once for the hosts missing the same set, in a
        # thread, while the hosts read it (it overlaps "bundle install")
        build = sync("bundle plan: tar + gzip", bundle_mod.SharedPlan.build)
        stack.enter_context(mock.patch.object(bundle_mod.SharedPlan, "build", build))
        for name, phase in (("spawn", "etcd spawn"), ("wait_healthy", "etcd healthy")):
            fn = getattr(EtcdServer, name)
            stack.enter_context(mock.patch.object(EtcdServer, name, sync(phase, fn)))
        stack.enter_context(
            mock.patch.object(EtcdServer, "stop", sync("etcd stop", EtcdServer.stop))
        )
        for name, phase, host in (
            ("connect", "ssh connect", lambda a, kw: a[0].host),
            ("install_bundle", "bundle install", lambda a, kw: peer(a, kw)),
            ("copy_graph", "graph copy", peer),
            ("run_agent", "agent", peer),
        ):
            fn = getattr(runner, name)
            stack.enter_context(mock.patch.object(runner, name, host_async(phase, fn, host)))
        t0 = time.perf_counter()
        outcomes = asyncio.run(rr.run(emit))
        wall = time.perf_counter() - t0
    # the agent's own milestones, from the lines it sent (arrival time here)
    for a in spans[:]:
        if a.phase != "agent":
            continue
        got = lines.get(a.host, [])
        if got:
            spans.append(Span(a.host, "agent: start to first line", a.start, got[0][0]))
        conv = [t for t, ln in got if " converged: " in ln]
        if conv and got:
            spans.append(Span(a.host, "agent: first line to converged", got[0][0], conv[0]))
            spans.append(Span(a.host, "agent: converged to exit", conv[0], a.end))
    for s in spans:
        s.start -= t0
        s.end -= t0
    return wall, spans, exit_status(outcomes)


PHASES = (
    "bundle build + hash",
    "etcd spawn",
    "etcd healthy",
    "ssh connect",
    "bundle install",
    "bundle plan: tar + gzip",
    "graph copy",
    "agent",
    "agent: start to first line",
    "agent: first line to converged",
    "agent: converged to exit",
    "etcd stop",
)


def profile(n: int, converged_timeout: float | None = CONVERGED_TIMEOUT) -> str:
    """Two in-process runs (first: the bundle store wiped; second: no change) on a
    fresh bed of `n` hosts; per phase the seconds (median and max over the hosts for
    per-host phases) and when the phase ended on the run's clock."""
    from tests.kit.sshbed import SshBed
    from tests.remote.test_remote import graph_file

    out: list[list[str]] = []
    with (
        temp_dir("/tmp", "evergraph-bench-remote-") as tmp,
        one_cluster_lock(),
        SshBed(n, tmp=tmp / "bed") as bed,
    ):
        site = graph_file(tmp, bed.files)
        reset_hosts(bed)
        t0 = time.perf_counter()
        # what the CLI process pays before RemoteRun starts: python and the imports
        # of the CLI, the runner and the etcd World
        imports = "import evergraph.cli.main, evergraph.remote.runner, evergraph.world.etcd"
        subprocess.run([sys.executable, "-c", imports], env=_env(tmp), check=True)
        startup = time.perf_counter() - t0
        for which in RUNS:
            wall, spans, status = profile_run(bed, site, converged_timeout)
            out.append([f"{which} run", "", f"{wall:.2f}", f"exit {status}"])
            for phase in PHASES:
                mine = [s for s in spans if s.phase == phase]
                if not mine:
                    continue
                took = sorted(s.end - s.start for s in mine)
                med = took[len(took) // 2]
                last = max(s.end for s in mine)
                out.append(
                    [
                        "  " + phase,
                        str(len(mine)),
                        f"{med:.2f}",
                        f"max {took[-1]:.2f}",
                        f"{last:.2f}",
                    ]
                )
    text = table(
        f"remote --profile: where evergraph's seconds go, {n} host(s) "
        f"(not in the runs: the CLI's python start + imports, {startup:.2f} s)",
        ["phase", "n", "s (median)", "max", "ends at s"],
        [r + [""] * (5 - len(r)) for r in out],
    )
    return text


def run(quick: bool) -> tuple[dict[str, Any], str]:
    """scripts/bench's entry: 1, 8 and 32 hosts (--quick: 1 and 8), all three tools."""
    return bench(QUICK_SIZES if quick else SIZES, TOOLS)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.remote", description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", default=",".join(map(str, SIZES)), help="[default: %(default)s]")
    ap.add_argument("--tools", default=",".join(TOOLS), help="[default: %(default)s]")
    ap.add_argument("--json", type=Path, help="write the results here too")
    ap.add_argument(
        "--converged-timeout",
        type=float,
        default=CONVERGED_TIMEOUT,
        help="evergraph's --converged-timeout: each agent exits by itself after S s "
        "converged [default: the CLI's, the coordinated end]",
    )
    ap.add_argument(
        "--profile",
        type=int,
        metavar="N",
        help="instead: where evergraph's seconds go in one first and one second run on N hosts",
    )
    args = ap.parse_args(argv)
    if args.profile:
        print(profile(args.profile, args.converged_timeout))
        return 0
    tools = [t for t in args.tools.split(",") if t]
    if bad := [t for t in tools if t not in TOOLS]:
        ap.error(f"--tools: unknown {bad}; known: {', '.join(TOOLS)}")
    out, text = bench([int(n) for n in args.hosts.split(",")], tools, args.converged_timeout)
    out["machine"] = machine()
    print(text)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0 if all(r["ok"] for r in out["results"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
