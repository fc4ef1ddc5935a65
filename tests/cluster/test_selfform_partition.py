"""The self-forming etcd World cut apart and lied to: a partition isolating one
voter (the majority writes on, the isolated host applies nothing stale, and after
healing there is one cluster with nothing acknowledged lost); and a host-key
attack while a host is away (a host that joins later refuses the key and the
forged export, for want of a CA certificate, and accepts the real host when it
returns). Real agents and etcd members in network namespaces (tests/kit/netbed.py)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

from evergraph.cluster.hostkeys import HostKeys
from tests.kit.identity_attacks import forged_export, host_key_record
from tests.kit.netbed import NetBed
from tests.kit.selfform import (
    CLUSTER_TEST,
    CounterWriter,
    Member,
    cluster_timeout,
    formed,
    roles,
    settled,
    wait_until,
    with_role,
    world_put_raw,
)

pytestmark = CLUSTER_TEST


def collector(name: str) -> str:
    """A graph that applies every file exported to this host."""
    return f"graph: {name}\nresources:\n  noop:\n  - name: {name}\ncollect:\n- {{kind: file}}\n"


def exporter(name: str, files: dict[Path, tuple[str, str]]) -> str:
    """A graph that exports `files` (path -> (content, target host)), hidden here."""
    text = f"graph: {name}\nresources:\n  file:\n"
    for path, (content, to) in files.items():
        text += (
            f"  - name: {path}\n    content: {json.dumps(content)}\n"
            f'    meta: {{export: ["{to}"], hidden: true}}\n'
        )
    return text


def content(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


class Sampler:
    """Every content `path` has, in order, as seen polling it from now on (None:
    no file), until `stop()`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen: list[str | None] = [content(path)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            now = content(self.path)
            if now != self.seen[-1]:
                self.seen.append(now)

    def stop(self) -> list[str | None]:
        self._stop.set()
        self._thread.join()
        return self.seen


@cluster_timeout(400)
def test_an_isolated_voter_applies_nothing_stale_and_the_majority_writes_on(
    netbed: Callable[[int], NetBed],
) -> None:
    bed = netbed(5)
    out = bed.tmp / "out"
    out.mkdir()
    members, _ = formed(bed, 5, {h.name: collector(h.name) for h in bed.hosts})
    by = {m.h.name: m for m in members}
    wait_until(settled(members, 3, 2), 90, "3 voters and 2 standbys", members)
    rows = members[0].rows()
    voters, standbys = with_role(rows, "voter"), with_role(rows, "standby")
    seed = members[0]  # the exporter (a voter: it formed the cluster)
    victim = by[next(v for v in voters if v != "h0")]
    witness = by[next(v for v in voters if v not in ("h0", victim.h.name))]
    writer = CounterWriter(by[standbys[-1]].h)
    at_victim, at_witness = out / "to-victim.conf", out / "to-witness.conf"

    def export(text: str) -> None:
        seed.set_graph(
            exporter(
                "h0",
                {at_victim: (text, victim.h.name), at_witness: (text, witness.h.name)},
            )
        )

    export("v1\n")
    wait_until(lambda: content(at_victim) == "v1\n", 60, "the first export on the victim", members)
    wait_until(lambda: content(at_witness) == "v1\n", 60, "the first export on the witness")
    sampler = Sampler(at_victim)
    writer.start()
    wait_until(writer.grew(20), 30, "the writer's first writes", members)

    others = [h for h in bed.hosts if h is not victim.h]
    victim.h.partition(*others)
    majority = [m for m in members if m is not victim]
    wait_until(writer.grew(50), 30, "writes on the majority side", majority)
    export("v2\n")
    wait_until(lambda: content(at_witness) == "v2\n", 60, "the new export on the witness")

    def replaced() -> bool:
        rows = seed.rows()
        return (
            victim.h.name not in with_role(rows, "voter")
            and len([r for r in rows if r["role"] == "voter" and r["healthy"]]) == 3
        )

    wait_until(replaced, 60, f"{victim.h.name} replaced on the majority side", majority)
    wait_until(writer.grew(50), 30, "writes after the replacement", majority)
    # the isolated host still has what it had, not the new export nor anything older
    assert content(at_victim) == "v1\n"

    victim.h.heal()
    wait_until(lambda: content(at_victim) == "v2\n", 90, "the new export after healing", members)
    wait_until(settled(members, 3, 2), 90, "one cluster of 3 voters and 2 standbys", members)
    # and the healed host sees that same cluster
    wait_until(
        lambda: with_role(victim.rows(), "voter") == with_role(seed.rows(), "voter"),
        60,
        f"{victim.h.name} sees the same voters",
        members,
    )
    wait_until(writer.grew(20), 30, "writes after healing", members)
    writer.stop()
    report = writer.verify()
    print(f"partition: writer {report}")
    assert sampler.stop() == ["v1\n", "v2\n"]


@cluster_timeout(400)
def test_a_host_joining_later_refuses_a_forged_key_and_export_and_accepts_the_real_host(
    netbed: Callable[[int], NetBed],
) -> None:
    bed = netbed(4)
    out = bed.tmp / "out"
    out.mkdir()
    forged, real = out / "forged.conf", out / "real.conf"
    members, token = formed(bed, 3)
    h0, _, h2 = members
    wait_until(settled(members, 3, 0), 90, "3 voters", members)
    assert h2.stop() == 0
    # the attacker, holding h0's TLS files, writes a key of its own for h2 (with no
    # certificate) and an export "from h2" to every host, signed with it (h3 does
    # not exist yet: nothing could be sealed to it)
    mallory = HostKeys(bed.tmp / "mallory")
    items = [("hostkeys/h2", host_key_record("h2", mallory))]
    items += [(p.key, p.value) for p in forged_export(mallory, "h2", "*", forged, "evil\n")]
    world_put_raw(h0.h, items)

    h3 = Member(bed, bed.hosts[3], graph=collector("h3"))
    h3.start([bed.hosts[0]], token)
    alive = [h0, members[1], h3]

    def refused() -> list[str]:
        return [
            ln
            for ln in h3.text().splitlines()
            if "hostkeys/h2" in ln and "refused" in ln and "certificate" in ln
        ]

    wait_until(refused, 90, "h3 refuses h2's uncertified key", alive)
    wait_until(
        lambda: "forged.conf waits for the key of its exporter h2" in h3.text(),
        60,
        "h3 holds the forged export back",
        alive,
    )
    wait_until(lambda: "h3" in roles(h0.rows()), 60, "h3 in the cluster", alive)
    assert not forged.exists()

    h2.set_graph(exporter("h2", {real: ("real\n", "h3")}))
    h2.restart()
    wait_until(lambda: content(real) == "real\n", 90, "h3 applies h2's real export", [*alive, h2])
    # with h2's real (certified) key, the forged record fails its signature check
    wait_until(
        lambda: any(
            "rejected export: exported/*/h2/" in ln and "not signed by 'h2'" in ln
            for ln in h3.text().splitlines()
        ),
        30,
        "h3 rejects the forged export",
        [h3],
    )
    assert not forged.exists()
    print(refused()[0])
