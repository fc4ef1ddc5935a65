"""`evergraph cluster` and the cluster's metrics, against real agents carrying
real etcd members on loopback (tests/kit/loopcluster.py): the ideal size, the
member list as JSON, `watch`, tokens, `remove`, the refused run flags, and
/metrics' voters, learners, standbys, leader changes and replacements."""

from __future__ import annotations

import queue
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from evergraph.cluster.ca import ClusterCA, cluster_dir, serial_of
from evergraph.cluster.revoke import crl_serials
from tests.conftest import EVERGRAPH, REPO, Agent, wait_for
from tests.kit.http import api_url
from tests.kit.loopcluster import LoopMember, cli, loop_members, wait_roles

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="needs etcd")

Make = Callable[[str], LoopMember]
VALID = "1, 3, 5, 7, 9"
HELLO = REPO / "examples" / "hello.yaml"


@pytest.fixture
def make(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Make]:
    monkeypatch.setenv("EVERGRAPH_ETCD_TIMING", "fast")
    monkeypatch.delenv("EVERGRAPH_JOIN_TOKEN", raising=False)
    with loop_members(tmp_path / "m") as m:
        yield m


def one_line(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


def formed(make: Make, name: str = "a1") -> LoopMember:
    m = make(name).start()
    wait_roles(m, {name: "voter"})
    return m


def test_size_is_3_by_default_5_when_set_and_bad_sizes_change_nothing(make: Make) -> None:
    a1 = formed(make)
    assert a1.cluster("size").stdout.strip() == "3"
    for bad in ("4", "0", "11", "-1", "x", "2.5"):
        line = one_line(a1.cluster("size", bad))
        assert VALID in line, line
        assert a1.cluster("size").stdout.strip() == "3"
    r = a1.cluster("size", "5")
    assert r.returncode == 0, r.stderr
    assert a1.cluster("size").stdout.strip() == "5"
    # a single member's metrics: itself a voter, nothing else
    m = a1.metrics()
    assert m["evergraph_cluster_voters"] == 1
    assert m["evergraph_cluster_learners"] == 0
    assert m["evergraph_cluster_standbys"] == 0
    assert m["evergraph_cluster_leader_changes_total"] == 0
    assert m["evergraph_cluster_member_replacements_total"] == 0


def test_tokens_bad_ttl_unknown_revoke_and_a_revoked_token_cannot_join(
    make: Make, tmp_path: Path
) -> None:
    a1 = formed(make)
    for ttl in ("x", "5s", "0", "-1h", "400d", "1y"):
        assert "--ttl" in one_line(a1.cluster("token", "--ttl", ttl)), ttl
    assert "unknown join token" in one_line(a1.cluster("token", "revoke", "0123456789ab"))
    token = a1.token(tmp_path / "t")
    token_id = token.read_text().strip().split(".")[2]
    r = a1.cluster("token", "revoke", token_id)
    assert r.returncode == 0, r.stderr
    assert token_id in r.stdout
    # a host holding the revoked token: refused at once, with one line naming why
    a2 = make("a2")
    r = cli("run", a2.graph, "--state-dir", a2.state, "--converged-exit", *a2.argv([a1], token))
    assert r.returncode == 2, r.stderr
    assert "revoked" in r.stderr, r.stderr
    assert a1.roles() == {"a1": "voter"}
    # `cluster remove` of a host the cluster does not know
    assert "no host 'nosuch'" in one_line(a1.cluster("remove", "nosuch"))


def test_json_lists_one_voter_and_one_standby_and_remove_revokes_the_standby(
    make: Make, tmp_path: Path
) -> None:
    a1 = formed(make)
    assert a1.cluster("size", "1").returncode == 0
    a2 = make("a2").start([a1], a1.token(tmp_path / "t"))
    wait_roles(a1, {"a1": "voter", "a2": "standby"})
    rows = {r["name"]: r for r in a1.rows()}
    assert rows["a1"] == {
        "name": "a1",
        "client_url": a1.client_url,
        "peer_url": a1.peer_url,
        "role": "voter",
        "healthy": True,
        "leader": True,
        "lag": 0,
    }
    assert rows["a2"] == {
        "name": "a2",
        "client_url": a2.client_url,
        "peer_url": a2.peer_url,
        "role": "standby",
        "healthy": True,
        "leader": False,
        "lag": None,
    }
    # the standby's own state dir sees the same cluster
    assert a2.roles() == {"a1": "voter", "a2": "standby"}

    def counted() -> bool:
        m = a1.metrics()
        return (
            m["evergraph_cluster_voters"],
            m["evergraph_cluster_learners"],
            m["evergraph_cluster_standbys"],
        ) == (1, 0, 1)

    wait_for(counted, 20, "1 voter, 0 learners, 1 standby in a1's /metrics")

    # remove the standby: its host certificate is on the cluster's revocation list
    r = a1.cluster("remove", "a2")
    assert r.returncode == 0, r.stderr
    assert "a2: revoked" in r.stdout, r.stdout
    serial = serial_of((cluster_dir(a2.state) / "host.crt").read_bytes())
    ca = ClusterCA.load(cluster_dir(a1.state))
    assert ca is not None
    got = cli("world", "get", "cluster/crl", "--seeds", a1.client_url)
    assert got.returncode == 0, got.stderr
    assert serial in (crl_serials(ca, got.stdout.encode()) or set())
    # and a1's seat took it in (the host-key book rechecks on it)
    wait_for(
        lambda: serial in crl_serials(ca, (cluster_dir(a1.state) / "crl.pem").read_bytes()),  # type: ignore[operator]
        20,
        "a1's crl.pem to list a2's certificate",
    )
    wait_for(
        lambda: (
            "host a2: the certificate of its key" in a1.log()
            and "is revoked: no longer trusted" in a1.log()
        ),
        20,
        "a1's host-key book to distrust a2",
    )
    # a2's agent still runs and writes its candidate record: it is no standby
    # (its certificate is revoked), in the list nor in the metrics
    assert a2.agent is not None
    assert a2.agent.proc.poll() is None
    wait_for(
        lambda: (
            cli("world", "get", "cluster/candidates/a2", "--seeds", a1.client_url).returncode == 0
        ),
        20,
        "a2's agent to write its candidate record again",
    )
    assert a1.roles() == {"a1": "voter"}
    wait_for(lambda: a1.metrics()["evergraph_cluster_standbys"] == 0, 20, "a1 to count no standby")
    assert a1.roles() == {"a1": "voter"}


class Lines:
    """A process' stdout, line by line, read by a thread of its own (a line is
    waited for with a timeout; nothing buffered is missed)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.queue: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self.thread = threading.Thread(target=self._pump, args=(proc,), daemon=True)
        self.thread.start()

    def _pump(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.queue.put(line.rstrip("\n"))
        self.queue.put(None)

    def until(self, want: str, timeout: float) -> str:
        """The first line holding `want`, printed already or waited for (the two
        kinds of line, roles and the curator's, come in no set order)."""
        for line in self.seen:
            if want in line:
                return line
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.queue.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            self.seen.append(line)
            if want in line:
                return line
        raise AssertionError(f"no line with {want!r} from `cluster watch`; it printed {self.seen}")


def _in_log(m: LoopMember, line: str) -> Callable[[], bool]:
    return lambda: line in m.log()


def test_watch_prints_the_join_and_the_curators_what_and_why(make: Make, tmp_path: Path) -> None:
    a1 = formed(make)
    token = a1.token(tmp_path / "t")
    watch = subprocess.Popen(
        [*EVERGRAPH, "cluster", "watch", "--state-dir", str(a1.state)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = Lines(watch)
    try:
        lines.until("a1: voter leader", 30)  # the cluster as it is first
        make("a2").start([a1], token)
        lines.until("a2: new,", 60)
        lines.until("curator a1: added a2 as a learner (1 voters, ideal 3)", 60)
        lines.until("curator a1: promoted a2 to voter (caught up with the leader)", 60)
    finally:
        watch.terminate()
        watch.wait(10)
        lines.thread.join(10)
        assert watch.stdout is not None
        watch.stdout.close()
    # the curator's own log line for each change: what, and why (the agent's log
    # reaches its file a moment later)
    for line in (
        "cluster: added a2 as a learner (1 voters, ideal 3)",
        "cluster: promoted a2 to voter (caught up with the leader)",
    ):
        wait_for(_in_log(a1, line), 20, f"{line!r} in a1's log")


def test_a_killed_leader_is_replaced_and_the_metrics_count_it(make: Make, tmp_path: Path) -> None:
    a1 = formed(make)
    token = a1.token(tmp_path / "t")
    others = [make(n).start([a1], token) for n in ("a2", "a3")]
    wait_roles(a1, {"a1": "voter", "a2": "voter", "a3": "voter"}, 90)
    (leader,) = [r["name"] for r in a1.rows() if r["leader"]]
    members = {m.name: m for m in (a1, *others)}
    members[leader].kill9()
    rest = [m for m in members.values() if m.name != leader]
    wait_roles(rest[0], {m.name: "voter" for m in rest}, 90)

    def replaced() -> bool:
        figures = [m.metrics() for m in rest]
        return (
            sum(f["evergraph_cluster_member_replacements_total"] for f in figures) == 1
            and all(f["evergraph_cluster_leader_changes_total"] >= 1 for f in figures)
            and all(f["evergraph_cluster_voters"] == 2 for f in figures)
        )

    wait_for(replaced, 30, "one replacement and a leader change in the survivors' /metrics")
    assert any(
        f"cluster: removed {leader} (its agent is gone and it has been unreachable" in m.log()
        for m in rest
    )


def test_an_agent_without_a_seat_has_no_cluster_metrics(tmp_path: Path) -> None:
    a = Agent(HELLO, tmp_path / "s", "--http", "127.0.0.1:0")
    try:
        a.wait_converged()
        text = httpx.get(api_url(a) + "/metrics", timeout=10).text
        assert "evergraph_converged" in text
        assert "evergraph_cluster_" not in text
    finally:
        a.stop()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--etcd-client-url", "http://127.0.0.1:23790"], "add --etcd embedded"),
        (["--etcd-peer-url", "http://127.0.0.1:23791"], "add --etcd embedded"),
        (
            ["--etcd", "embedded", "--etcd-client-url", "http://10.1.2.3:2379"],
            "TLS",
        ),
        (
            [
                "--etcd",
                "embedded",
                "--etcd-client-url",
                "https://127.0.0.1:23790",
                "--etcd-peer-url",
                "http://127.0.0.1:23791",
            ],
            "one scheme",
        ),
        (["--etcd", "embedded", "--etcd-client-url", "http://127.0.0.1"], "no port"),
    ],
)
def test_bad_member_flags_are_one_line_and_nothing_is_made(
    tmp_path: Path, args: list[str], says: str
) -> None:
    state = tmp_path / "state"
    r = cli("run", HELLO, "--state-dir", state, "--converged-exit", *args)
    assert says in one_line(r)
    assert not state.exists()  # refused before anything is made


def test_a_state_dir_without_a_cluster_is_one_line(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    for sub in ([], ["size"], ["token"], ["watch"], ["remove", "x"]):
        assert "no self-forming cluster here" in one_line(
            cli("cluster", *sub, "--state-dir", empty)
        ), sub
    assert "no such state directory" in one_line(cli("cluster", "--state-dir", tmp_path / "no"))


def test_an_etcd_data_dir_it_did_not_make_is_never_wiped(tmp_path: Path) -> None:
    """An `--etcd embedded` World of an earlier version (no cluster state beside it)
    may be someone's data: refused with one line, left as it is."""
    state = tmp_path / "state"
    wal = state / "etcd" / "member" / "wal"
    wal.mkdir(parents=True)
    (wal / "0.wal").write_bytes(b"precious")
    r = cli(
        "run",
        HELLO,
        "--state-dir",
        state,
        "--converged-exit",
        "--etcd",
        "embedded",
        "--etcd-client-url",
        "http://127.0.0.1:1",
        "--etcd-peer-url",
        "http://127.0.0.1:2",
    )
    line = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert any("did not make" in ln and str(state / "etcd") in ln for ln in line), r.stderr
    assert (wal / "0.wal").read_bytes() == b"precious"
