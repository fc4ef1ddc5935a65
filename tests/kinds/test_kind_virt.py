"""virt: libvirt domains, on libvirt's in-process test driver and on a real libvirtd.

The fast tests run on `test:///default` (libvirt's own fake hypervisor, in
process): parameters, idempotency across state x transient, UUID and MAC
stability, reversal, bad input. The slow ones run on a real libvirtd the test
starts (`libvirtbed`, tests/kit/libvirtbed.py) with a TCG guest booting Debian's
kernel and a busybox initramfs: its life cycle, the repair of out-of-band
`virsh destroy`/`suspend`/`undefine` through libvirt's lifecycle events, and a
libvirtd killed and started again. Each test keeps at most two guests running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import libvirt
import pytest

from evergraph.engine.build import build
from evergraph.engine.contract import Resource, default_registry
from evergraph.engine.services import Services
from evergraph.errors import InputError
from evergraph.resources._libvirt import LibvirtLinks
from evergraph.resources.virt import Virt, derived_mac
from evergraph.testing.kinds import (
    Apply,
    Call,
    Check,
    ExpectClean,
    FakeHandle,
    Start,
    Step,
    arun_steps,
    run_steps,
)
from tests.conftest import Agent, run_cli, wait_for
from tests.kit.agents import save
from tests.kit.libvirtbed import GUEST_KIB, PREFIX, LibvirtBed, libvirt_bed

TEST_URI = "test:///default"
MGMT_YAML = Path("/work/shared/mgmt-yaml")


def virt(**params: Any) -> Virt:
    params.setdefault("uri", TEST_URI)
    params.setdefault("memory", GUEST_KIB)
    res = build(default_registry, "virt", params)
    assert isinstance(res, Virt)
    return res


def build_error(params: dict[str, Any]) -> str:
    """The InputError building (and validating) a virt of `params` raises."""
    try:
        build(default_registry, "virt", params)
    except InputError as e:
        return str(e)
    raise AssertionError(f"{params} was accepted")


# -- parameters and bad input (no hypervisor) ---------------------------------------


@pytest.mark.parametrize(
    ("params", "where", "why"),
    [
        ({"state": "stopped"}, "virt[vm].state", "Invalid enum value 'stopped'"),
        ({"memory": 0}, "virt[vm].memory", "must be > 0 KiB"),
        ({"cpus": 3, "maxcpus": 2}, "virt[vm].cpus", "above maxcpus"),
        ({"cpus": 0}, "virt[vm].cpus", "must be >= 1"),
        ({"boot": ["floppy"]}, "virt[vm].boot[0]", "not one of"),
        ({"network": [{"name": "n", "mac": "zz"}]}, "virt[vm].network[0].mac", "not a MAC"),
        ({"transient": True, "startup": "enabled"}, "virt[vm].startup", "transient"),
    ],
)
def test_bad_input_is_one_line_naming_the_field(
    params: dict[str, Any], where: str, why: str
) -> None:
    text = build_error({"name": "vm", "memory": 1024, **params})
    assert where in text, text
    assert why in text, text
    assert len(text.splitlines()) == 1


def test_bad_input_in_a_graph_exits_2_naming_the_field(tmp_path: Path) -> None:
    g = tmp_path / "g.yaml"
    g.write_text("graph: g\nresources:\n  virt:\n  - name: vm\n    memory: 0\n")
    r = run_cli("check", g)
    assert r.returncode == 2
    assert "virt[vm].memory" in r.stderr
    assert "must be > 0" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_mgmts_virt_examples_load_unchanged(n: int) -> None:
    path = MGMT_YAML / f"virt{n}.yaml"
    if not path.exists():
        pytest.skip(f"{path} is not on this machine")
    r = run_cli("check", path)
    assert r.returncode == 0, r.stderr
    assert "(virt: 1)" in r.stdout


def test_autoedge_after_the_file_of_its_disk_image(tmp_path: Path) -> None:
    g = tmp_path / "g.yaml"
    img = tmp_path / "a.qcow2"
    g.write_text(
        f"graph: g\nresources:\n  file:\n  - name: {img}\n    content: ''\n"
        f"  virt:\n  - name: vm\n    memory: 1024\n    disk:\n    - source: {img}\n"
    )
    r = run_cli("graph", g)
    assert r.returncode == 0, r.stderr
    assert f'"file[{img}]" -> "virt[vm]"' in r.stdout


def test_unreachable_uri_is_one_line_naming_uri(tmp_path: Path) -> None:
    res = virt(name="vm", uri=f"qemu+unix:///system?socket={tmp_path}/nothing")
    h = run_steps(res, [Start(raises=r"^virt\[vm\]\.uri: cannot connect to qemu\+unix")])
    assert h.changes == []


def test_a_missing_disk_image_defines_nothing(tmp_path: Path) -> None:
    name = f"{PREFIX}nodisk"
    res = virt(name=name, disk=[{"source": str(tmp_path / "no.qcow2"), "type": "qcow2"}])
    # after the file resource that makes the image, and libvirt's packages
    assert res.autoedge_wants() == [[f"path:{tmp_path}/no.qcow2"], ["path:/usr/sbin/libvirtd"]]

    async def go(services: Shared, link: Any) -> None:
        where = rf"virt\[{name}\]\.disk\[0\]\.source: .*no\.qcow2: no such file"
        await arun_steps(res, [Start(), Apply(raises=where)], services=Shared())
        assert name not in _domains(link.conn)

    on_the_test_driver(go)


# -- the test driver: idempotency, identity, reversal --------------------------------


def _domains(conn: Any) -> dict[str, tuple[int, bool]]:
    return {d.name(): (d.state()[0], bool(d.isPersistent())) for d in conn.listAllDomains()}


async def _timeline(
    steps_of: Callable[[Services, Path], list[tuple[Resource, list[Step]]]], state: Path
) -> None:
    """Run (resource, steps) pairs in order, sharing one Services (one connection)."""
    services = Shared()
    try:
        for res, steps in steps_of(services, state):
            h = FakeHandle(state_dir=state / res.name, services=services)
            await _steps_no_close(res, steps, h)
    finally:
        await services.really_close()


class Shared(Services):
    """Services that outlive the steps of one resource (`arun_steps` closes a
    handle's services at the end): one connection through a whole test."""

    async def aclose(self) -> None:
        pass

    async def really_close(self) -> None:
        await super().aclose()


def on_the_test_driver(body: Callable[[Shared, Any], Awaitable[None]]) -> None:
    """`body(services, link)` with a link to libvirt's test driver, closed after."""

    async def go() -> None:
        services = Shared()
        try:
            await body(services, await services.get(LibvirtLinks).acquire(TEST_URI))
        finally:
            await services.really_close()

    asyncio.run(go())


async def _steps_no_close(res: Resource, steps: list[Step], h: FakeHandle) -> None:
    """`arun_steps` on a handle with `Shared` services (the connection stays open)."""
    assert isinstance(h.services, Shared)
    await arun_steps(res, steps, h)


def _remove(conn: Any, name: str) -> None:
    """Destroy and undefine `name` if it is there."""
    for d in conn.listAllDomains():
        if d.name() == name:
            persistent = d.isPersistent()
            if d.isActive():
                d.destroy()
            if persistent:
                d.undefine()


STATES = ["running", "paused", "shutoff"]


@pytest.mark.parametrize("transient", [False, True])
@pytest.mark.parametrize("start", [None, *STATES])
@pytest.mark.parametrize("want", STATES)
def test_every_state_converges_and_a_second_run_changes_nothing(
    tmp_path: Path, transient: bool, start: str | None, want: str
) -> None:
    """From no domain or a persistent one in `start`, to `want` (transient or not)."""
    name = f"{PREFIX}s"

    async def go() -> None:
        services = Shared()
        try:
            link = await services.get(LibvirtLinks).acquire(TEST_URI)
            conn = link.conn
            _remove(conn, name)
            if start is not None:
                first = virt(name=name, state=start)
                await _steps_no_close(
                    first,
                    [Start(), Apply()],
                    FakeHandle(state_dir=tmp_path / "a", services=services),
                )
            res = virt(name=name, state=want, transient=transient)
            h = FakeHandle(state_dir=tmp_path / "b", services=services)
            exists_after = want != "shutoff" or not transient
            already = (start == want and not transient) or (
                start is None and want == "shutoff" and transient
            )
            await _steps_no_close(
                res, [Start(watch=True), Check(ok=already), Apply(ok=already), ExpectClean()], h
            )
            # what a noop run reports is what the apply changed
            half = len(h.changes) // 2
            assert h.fields()[:half] == h.fields()[half:], h.changes
            found = _domains(conn).get(name)
            if not exists_after:
                assert found is None
            else:
                assert found is not None
                code = {"running": 1, "paused": 3, "shutoff": 5}[want]
                assert found == (code, not transient)
            # a second run, as the next agent's: nothing to change
            again = virt(name=name, state=want, transient=transient)
            h2 = FakeHandle(state_dir=tmp_path / "b", services=services)
            await _steps_no_close(again, [Start(), ExpectClean(), Apply(ok=True, changes=[])], h2)
        finally:
            _remove(conn, name)
            await services.really_close()

    asyncio.run(go())


def test_uuid_and_mac_stay_across_a_redefinition(tmp_path: Path) -> None:
    name = f"{PREFIX}id"
    seen: list[tuple[str, str]] = []

    def look(conn: Any) -> None:
        dom = conn.lookupByName(name)
        xml = dom.XMLDesc(0)
        mac = xml.split("<mac address='")[1].split("'")[0]
        seen.append((dom.UUIDString(), mac))

    async def go(services: Shared, link: Any) -> None:
        conn = link.conn
        net = [{"name": "default"}]
        for i in range(2):
            res = virt(name=name, state="shutoff", network=net)
            h = FakeHandle(state_dir=tmp_path / "st", services=services)
            await _steps_no_close(
                res, [Start(), Apply(), ExpectClean(), Call(lambda: look(conn))], h
            )
            if i == 0:
                conn.lookupByName(name).undefine()  # gone out of band: defined again
        # memory changed in the graph: redefined, same UUID and MAC
        res = virt(name=name, state="shutoff", network=net, memory=2 * GUEST_KIB)
        h = FakeHandle(state_dir=tmp_path / "st", services=services)
        await _steps_no_close(
            res,
            [Start(), Apply(changes=["definition"]), ExpectClean(), Call(lambda: look(conn))],
            h,
        )
        conn.lookupByName(name).undefine()

    on_the_test_driver(go)
    assert len(seen) == 3, seen
    assert len(set(seen)) == 1, seen
    assert seen[0][1] == derived_mac(seen[0][0], 0)


def test_memory_change_of_a_running_domain_follows_restartondiverge(tmp_path: Path) -> None:
    name = f"{PREFIX}div"

    async def go(services: Shared, link: Any) -> None:
        conn = link.conn

        def h() -> FakeHandle:
            return FakeHandle(state_dir=tmp_path, services=services)

        await _steps_no_close(virt(name=name), [Start(), Apply(), ExpectClean()], h())
        bigger = 2 * GUEST_KIB
        # ignore: redefined for the next start; the running domain left as it is
        await _steps_no_close(
            virt(name=name, memory=bigger),
            [Start(), Apply(changes=["definition"]), ExpectClean()],
            h(),
        )
        assert conn.lookupByName(name).info()[1] == GUEST_KIB
        # error: a resource error saying so
        await _steps_no_close(
            virt(name=name, memory=bigger, restartondiverge="error"),
            [Start(), Check(raises="differs \\(memory\\).*restartondiverge is `error`")],
            h(),
        )
        # ifneeded: restarted once, then clean
        await _steps_no_close(
            virt(name=name, memory=bigger, restartondiverge="ifneeded"),
            [Start(), Apply(changes=["state"]), ExpectClean()],
            h(),
        )
        assert conn.lookupByName(name).info()[1] == bigger
        dom = conn.lookupByName(name)
        dom.destroy()
        dom.undefine()

    on_the_test_driver(go)


def test_a_hot_plug_libvirt_refuses_follows_restartondiverge(tmp_path: Path) -> None:
    """libvirt's test driver plugs nothing live (attachDeviceFlags: not supported):
    an interface added to a running domain then follows `restartondiverge` like any
    other difference, the definition is the graph's either way, and a refused
    hot-plug is never reported as done."""
    name = f"{PREFIX}plug"
    net = [{"name": "default"}]

    async def go(services: Shared, link: Any) -> None:
        conn = link.conn
        _remove(conn, name)

        def h() -> FakeHandle:
            return FakeHandle(state_dir=tmp_path, services=services)

        await _steps_no_close(virt(name=name), [Start(), Apply(), ExpectClean()], h())
        dom_id = conn.lookupByName(name).ID()
        # the dry run says what it would try: plug it in live
        await _steps_no_close(
            virt(name=name, network=net),
            [Start(), Check(ok=False, changes=["definition", "network"])],
            h(),
        )
        # ignore: refused, so redefined only; the domain runs on without it
        hd = h()
        await _steps_no_close(
            virt(name=name, network=net),
            [Start(), Apply(changes=["definition"]), ExpectClean()],
            hd,
        )
        assert any("cannot change it live" in line for line in hd.logs), hd.logs
        dom = conn.lookupByName(name)
        assert dom.ID() == dom_id
        assert "network='default'" not in dom.XMLDesc(0)
        assert "network='default'" in dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)
        # error: says the domain differs
        await _steps_no_close(
            virt(name=name, network=net, restartondiverge="error"),
            [Start(), Check(raises="differs \\(network\\).*restartondiverge is `error`")],
            h(),
        )
        # ifneeded: restarted with it, then clean
        await _steps_no_close(
            virt(name=name, network=net, restartondiverge="ifneeded"),
            [Start(), Apply(changes=["state"]), ExpectClean()],
            h(),
        )
        dom = conn.lookupByName(name)
        assert dom.ID() != dom_id
        assert "network='default'" in dom.XMLDesc(0)
        _remove(conn, name)

    on_the_test_driver(go)


def test_reverse_undefines_what_the_graph_created(tmp_path: Path) -> None:
    name = f"{PREFIX}rev"

    async def go(services: Shared, link: Any) -> None:
        conn = link.conn
        res = virt(name=name, meta={"reverse": True})
        h = FakeHandle(state_dir=tmp_path, services=services)
        await res.init(h)
        rev = res.reversal()  # captured before the first apply: there was none
        await _steps_no_close(res, [Apply(), ExpectClean()], h)
        assert name in _domains(conn)
        assert rev is not None
        await _steps_no_close(
            rev,
            [Start(), Apply(changes=["transient", "state"]), ExpectClean()],
            FakeHandle(services=services),
        )
        assert name not in _domains(conn)
        # a domain that existed before the graph is left alone
        conn.defineXML(
            f"<domain type='test'><name>{name}</name><memory>{GUEST_KIB}</memory>"
            "<os><type>hvm</type></os></domain>"
        )
        again = virt(name=name, meta={"reverse": True})
        await again.init(FakeHandle(state_dir=tmp_path, services=services))
        assert again.reversal() is None
        await again.cleanup()
        conn.lookupByName(name).undefine()

    on_the_test_driver(go)


def test_startup_refresh_and_devices(tmp_path: Path) -> None:
    """Autostart managed; a refresh restarts with `restartonrefresh`; disks, cdroms,
    networks and filesystems are in the definition, and changing one redefines it."""
    name = f"{PREFIX}dev"
    img = tmp_path / "a.qcow2"
    img.write_bytes(b"")
    devices: dict[str, Any] = {
        "disk": [{"source": str(img), "type": "qcow2"}],
        "cdrom": [{"source": str(img)}],
        "network": [
            {"name": "default"},
            {"type": "bridge", "name": "br0", "mac": "52:54:00:aa:bb:cc"},
        ],
        "filesystem": [{"source": str(tmp_path), "target": "share", "read_only": True}],
        "boot": ["hd", "cdrom"],
    }

    async def go(services: Shared, link: Any) -> None:
        conn = link.conn
        _remove(conn, name)

        def h() -> FakeHandle:
            return FakeHandle(state_dir=tmp_path / "st", services=services)

        res = virt(name=name, startup="enabled", **devices)
        await _steps_no_close(
            res,
            [
                Start(),
                Check(changes=["definition", "startup", "state"]),
                Apply(),
                ExpectClean(),
            ],
            h(),
        )
        dom = conn.lookupByName(name)
        assert dom.autostart() == 1
        xml = dom.XMLDesc(0)
        for needle in (
            f"file='{img}'",
            "device='cdrom'",
            "network='default'",
            "bridge='br0'",
            "52:54:00:aa:bb:cc",
            "dir='share'",
            "<readonly/>",
            "<boot dev='hd'/>",
            "<boot dev='cdrom'/>",
        ):
            assert needle in xml, needle
        # a refresh restarts it (restartonrefresh); without the flag nothing happens
        hd = h()
        hd.refresh_now = True
        await _steps_no_close(
            virt(name=name, startup="enabled", **devices), [Start(), ExpectClean()], hd
        )
        hd = h()
        hd.refresh_now = True
        again = virt(name=name, startup="enabled", restartonrefresh=True, **devices)
        await _steps_no_close(again, [Start(), Apply(changes=["state"])], hd)
        # a network dropped from the graph: redefined, autostart off
        fewer = {**devices, "network": devices["network"][:1]}
        await _steps_no_close(
            virt(name=name, startup="disabled", **fewer),
            [Start(), Apply(changes=["definition", "startup"]), ExpectClean()],
            h(),
        )
        dom = conn.lookupByName(name)
        assert "br0" not in dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)
        assert dom.autostart() == 0
        # other credentials: a connection of their own
        other = virt(name=name, auth={"username": "u", "password": "p"}, **fewer)
        await other.init(h())
        assert services.get(LibvirtLinks).links()[TEST_URI] is not link
        await other.cleanup()
        _remove(conn, name)

    on_the_test_driver(go)


def test_a_refresh_never_starts_a_domain_that_is_to_be_shut_off(tmp_path: Path) -> None:
    name = f"{PREFIX}ref"

    async def go(services: Shared, link: Any) -> None:
        _remove(link.conn, name)
        on = virt(name=name, restartonrefresh=True)
        await _steps_no_close(on, [Start(), Apply()], FakeHandle(services=services))
        h = FakeHandle(services=services)
        h.refresh_now = True  # and the graph says shut off now: off it goes, no restart
        off = virt(name=name, state="shutoff", restartonrefresh=True)
        await _steps_no_close(off, [Start(), Apply(changes=["state"]), ExpectClean()], h)
        assert link.conn.lookupByName(name).isActive() == 0
        _remove(link.conn, name)

    on_the_test_driver(go)


def test_one_connection_per_uri_for_many_resources(tmp_path: Path) -> None:
    async def go() -> None:
        services = Shared()
        try:
            resources = [virt(name=f"{PREFIX}m{i}", state="shutoff") for i in range(100)]
            for res in resources:
                res.validate()
                await res.init(FakeHandle(state_dir=tmp_path / res.name, services=services))
            links = services.get(LibvirtLinks).links()
            assert list(links) == [TEST_URI]
            assert links[TEST_URI].opened == 1
            for res in resources:
                await res.cleanup()
        finally:
            await services.really_close()

    asyncio.run(go())


# -- a real libvirtd with a TCG guest ------------------------------------------------


def guest(bed: LibvirtBed, name: str, **params: Any) -> Virt:
    params.setdefault("uri", bed.uri)
    params.setdefault("domaintype", "qemu")
    params.setdefault("kernel", str(bed.kernel))
    params.setdefault("initrd", str(bed.initrd))
    params.setdefault("cmdline", "console=ttyS0 quiet")
    return virt(name=name, **params)


class Pulse:
    """Things the loop hears of (a resource's watch event, the link lost or back)
    wake whoever awaits a state: tests await states, never sleep and look again."""

    def __init__(self) -> None:
        self._woken = asyncio.Event()

    def poke(self) -> None:
        self._woken.set()

    async def until(self, pred: Callable[[], bool], what: str, timeout: float = 30) -> None:
        """Await `pred()`, looked at again after each poke; fails after `timeout` s."""
        try:
            async with asyncio.timeout(timeout):
                while not pred():
                    self._woken.clear()
                    await self._woken.wait()
        except TimeoutError:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}") from None


class WatchedHandle(FakeHandle):
    """A FakeHandle whose watch events poke a Pulse."""

    def __init__(self, pulse: Pulse, **kw: Any) -> None:
        super().__init__(**kw)
        self._pulse = pulse

    def event(self) -> None:
        super().event()
        self._pulse.poke()


class LinkNews(logging.Handler):
    """Pokes a Pulse on what the libvirt links log (lost, reconnected), once the
    loop's callback that logged it is over (it sets the link's state after)."""

    def __init__(self, pulse: Pulse) -> None:
        super().__init__(logging.DEBUG)
        self._pulse = pulse
        self._loop = asyncio.get_running_loop()

    def emit(self, record: logging.LogRecord) -> None:
        self._loop.call_soon_threadsafe(self._pulse.poke)


@contextlib.contextmanager
def link_news(pulse: Pulse) -> Iterator[None]:
    """Poke `pulse` whenever a libvirt link says it lost or got its connection."""
    logger = logging.getLogger("evergraph.resources.virt")
    handler, level = LinkNews(pulse), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)  # (its info lines reach the handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.mark.slow
def test_a_guest_defined_started_paused_resumed_stopped_undefined(
    libvirtbed: LibvirtBed, tmp_path: Path
) -> None:
    bed = libvirtbed
    name = f"{PREFIX}life"

    async def go() -> None:
        services = Shared()
        try:

            def h() -> FakeHandle:
                return FakeHandle(state_dir=tmp_path, services=services)

            net = [{"type": "user"}]
            for state, shown in [
                ("running", "running"),
                ("paused", "paused"),
                ("running", "running"),
                ("shutoff", "shut off"),
            ]:
                res = guest(bed, name, state=state, network=net, meta={"reverse": True})
                hd = h()
                await _steps_no_close(res, [Start(watch=True), Apply(), ExpectClean()], hd)
                assert bed.state(name) == shown
                assert bed.persistent(name)
            xml = bed.dumpxml(name, inactive=True)
            assert "<interface type='user'>" in xml
            uuid = bed.virsh("domuuid", name).stdout.strip()
            assert derived_mac(uuid, 0) in xml
            # reversed: it was not there before the graph
            first = guest(bed, name)
            await first.init(h())
            await first.cleanup()
            rev = Virt(name=name, uri=bed.uri, memory=GUEST_KIB, transient=True, state="shutoff")
            await _steps_no_close(rev, [Start(), Apply(changes=["transient"]), ExpectClean()], h())
            assert bed.state(name) == ""
        finally:
            await services.really_close()

    asyncio.run(go())
    assert bed.domains() == []


@pytest.mark.slow
def test_out_of_band_destroy_suspend_undefine_are_repaired_by_one_check_apply_each(
    libvirtbed: LibvirtBed, tmp_path: Path
) -> None:
    bed = libvirtbed
    name = f"{PREFIX}drift"
    #: seconds from virsh's start, and from its end, to the guest repaired
    timings: dict[str, tuple[float, float]] = {}

    async def go() -> None:
        services = Shared()
        try:
            res = guest(bed, name)
            pulse = Pulse()
            h = WatchedHandle(pulse, state_dir=tmp_path, services=services)
            await arun_steps_keep(res, [Start(watch=True), Apply(), ExpectClean()], h)
            assert h.readies == 0  # a passive watch: subscribed in Start
            for drift, changes in [
                (["destroy", name], ["state"]),
                (["suspend", name], ["state"]),
                (["undefine", name], ["definition"]),
            ]:
                before = h.events
                began = time.monotonic()
                await asyncio.to_thread(bed.virsh, *drift)
                done = time.monotonic()  # (virsh destroy itself waits ~1 s for QEMU to end)
                await pulse.until(
                    lambda before=before: h.events > before, f"an event after {drift}"
                )
                mark = len(h.changes)
                assert not await res.check_apply(True)  # the one repair
                assert [c.field for c in h.changes[mark:]] == changes
                assert await res.check_apply(False)  # clean after it
                now = time.monotonic()
                timings[drift[0]] = (round(now - began, 2), round(now - done, 2))
                assert bed.state(name) == "running"
                assert bed.persistent(name)
            await res.cleanup()
            h.unsubscribe()  # type: ignore[attr-defined]
            dom_uuid = bed.virsh("domuuid", name).stdout.strip()
            assert derived_mac(dom_uuid, 0) not in bed.dumpxml(name)  # (no network here)
        finally:
            await services.really_close()
            bed.remove_test_domains()

    asyncio.run(go())
    print("repair seconds:", timings)


async def arun_steps_keep(res: Resource, steps: list[Step], h: FakeHandle) -> None:
    """Steps without the cleanup at the end (the test goes on with the resource)."""
    for step in steps:
        await step.run(res, h)


@pytest.mark.slow
def test_libvirtd_killed_and_restarted_the_resources_recover(
    libvirtbed: LibvirtBed, tmp_path: Path
) -> None:
    bed = libvirtbed
    if not bed.ours:
        pytest.skip("the machine's own libvirtd runs: the test does not kill it")
    names = [f"{PREFIX}k1", f"{PREFIX}k2"]

    async def go() -> None:
        services = Shared()
        try:
            resources = [
                guest(bed, n, state=s) for n, s in zip(names, ["running", "shutoff"], strict=True)
            ]
            pulse = Pulse()
            handles = [
                WatchedHandle(pulse, state_dir=tmp_path / r.name, services=services)
                for r in resources
            ]
            for r, h in zip(resources, handles, strict=True):
                await arun_steps_keep(r, [Start(watch=True), Apply(), ExpectClean()], h)
            link = services.get(LibvirtLinks).links()[bed.uri]
            assert link.opened == 1
            events = [h.events for h in handles]
            with link_news(pulse):
                await asyncio.to_thread(bed.kill_libvirtd, signal.SIGTERM)
                await pulse.until(lambda: link.conn is None, "the link to see libvirtd gone", 10)
                await asyncio.to_thread(bed.start_libvirtd)
                # the link reconnects by itself and tells every resource to look again
                await pulse.until(lambda: link.conn is not None, "the link to reconnect", 60)
                await pulse.until(
                    lambda: all(h.events > e for h, e in zip(handles, events, strict=True)),
                    "events after it",
                )
            assert link.opened == 2
            # libvirtd re-attaches to a running guest's QEMU under a job of its own; a
            # monitor query waits for it. (Here, with cgroup v1, libvirtd sometimes
            # drops the guest on the way back: then it is started again, once.)
            await asyncio.to_thread(
                bed.virsh, "qemu-monitor-command", "--hmp", names[0], "info status", check=False
            )
            for r in resources:
                if not await r.check_apply(True):
                    assert await r.check_apply(False)
            assert [bed.state(n) for n in names] == ["running", "shut off"]
            # and the watch works on the new connection: drift repaired
            before = handles[0].events
            await asyncio.to_thread(bed.virsh, "destroy", names[0])
            await pulse.until(lambda: handles[0].events > before, "an event on the new connection")
            assert not await resources[0].check_apply(True)
            assert bed.state(names[0]) == "running"
            for r, h in zip(resources, handles, strict=True):
                h.unsubscribe()  # type: ignore[attr-defined]
                await r.cleanup()
        finally:
            await services.really_close()
            bed.remove_test_domains()

    asyncio.run(go())


@pytest.mark.slow
def test_the_beds_libvirtd_never_joins_a_system_bus_that_another_test_may_stop(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A system bus is up (here a private one, named by DBUS_SYSTEM_BUS_ADDRESS as
    the tests' own would be found) when the bed starts: its libvirtd does not
    connect to it. One that did ended (status 0) when that bus was stopped, and
    the test running on it failed ("client socket is closed")."""
    bus = tmp_path / "bus"
    daemon = subprocess.Popen(
        ["dbus-daemon", "--session", "--nofork", "--print-address", f"--address=unix:path={bus}"],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    try:
        assert daemon.stdout is not None
        assert daemon.stdout.readline().startswith(b"unix:path=")  # listening
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("DBUS_SYSTEM_BUS_ADDRESS", f"unix:path={bus}")
            with libvirt_bed(lambda: tmp_path_factory.mktemp("libvirt")) as bed:
                if not bed.ours:
                    pytest.skip("the machine's own libvirtd runs: not the bed's to start")
                log = (bed.root / "libvirtd.log").read_text()
        assert "Unable to get system bus connection" in log, log
    finally:
        daemon.terminate()
        daemon.wait(10)
        if daemon.stdout is not None:
            daemon.stdout.close()


def test_a_call_that_finds_its_connection_closed_by_libvirtd_is_made_again_once(
    libvirtbed: LibvirtBed,
) -> None:
    """libvirtd drops the link's connection (`virt-admin client-disconnect`) and a
    call is made before the link has heard of it (its close callback is still on
    the way): libvirt refuses the call unsent ("client socket is closed"), and the
    link reconnects and makes it again, instead of failing the resource's apply."""
    bed = libvirtbed

    async def go() -> None:
        services = Shared()
        try:
            link = await services.get(LibvirtLinks).acquire(bed.uri)
            old = link.conn
            [client] = await asyncio.to_thread(_clients_of, bed, os.getpid())
            # the loop gets no turn from here to the call: the callback cannot run
            _admin(bed, "client-disconnect", "libvirtd", client)
            wait_for(lambda: not old.isAlive(), 30, "libvirt to see the connection closed")
            assert link.conn is old
            # (a call libvirtd answers: getURI is answered by the client alone)
            assert await link.call(lambda conn: conn.numOfDomains()) >= 0
            assert link.conn is not old
            assert link.opened == 2
            assert link.lost_why.startswith("connection lost: ")
            # and the new connection is whole: one client of this process again
            assert len(await asyncio.to_thread(_clients_of, bed, os.getpid())) == 1
        finally:
            await services.really_close()

    asyncio.run(go())


def test_a_transient_guest_and_live_cpus(libvirtbed: LibvirtBed, tmp_path: Path) -> None:
    bed = libvirtbed
    name = f"{PREFIX}tr"

    async def go() -> None:
        services = Shared()
        try:

            def h() -> FakeHandle:
                return FakeHandle(state_dir=tmp_path, services=services)

            res = guest(bed, name, transient=True, cpus=1, maxcpus=2, hotcpus=True)
            await _steps_no_close(res, [Start(), Apply(changes=["state"]), ExpectClean()], h())
            assert bed.state(name) == "running"
            assert not bed.persistent(name)
            more = guest(bed, name, transient=True, cpus=2, maxcpus=2, hotcpus=True)
            await _steps_no_close(more, [Start(), Apply(changes=["cpus"]), ExpectClean()], h())
            live = bed.virsh("vcpucount", name, "--live", "--active").stdout.split()
            assert live == ["2"], live  # plugged in live: the guest ran on
            off = guest(bed, name, transient=True, state="shutoff")
            await _steps_no_close(off, [Start(), Apply(changes=["state"]), ExpectClean()], h())
            assert bed.state(name) == ""
        finally:
            await services.really_close()
            bed.remove_test_domains()

    asyncio.run(go())


#: (state, transient, startup) for a domain that does not exist yet: every state,
#: persistent with autostart on, off or not managed, and transient
MATRIX = [
    *((state, False, startup) for state in STATES for startup in ("enabled", "disabled", "")),
    *((state, True, "") for state in STATES),
]
SHOWN = {"running": "running", "paused": "paused", "shutoff": "shut off"}


@pytest.mark.slow
def test_every_state_transient_startup_from_nothing_then_a_second_run_changes_nothing(
    libvirtbed: LibvirtBed, tmp_path: Path
) -> None:
    """The idempotency matrix on the real daemon, one case after the other on one bed
    (one guest running at a time): apply from no domain, libvirt has it as asked,
    then a second run (a new resource, as the next agent's) finds nothing to do."""
    bed = libvirtbed
    done: list[str] = []

    async def go() -> None:
        services = Shared()
        try:
            for state, transient, startup in MATRIX:
                kind = "t" if transient else "p"
                name = f"{PREFIX}mx-{state}-{kind}-{startup or 'unmanaged'}"
                case = f"{name}: state={state} transient={transient} startup={startup!r}"
                params: dict[str, Any] = {"state": state, "transient": transient}
                params["startup"] = startup
                nothing = transient and state == "shutoff"  # a transient domain shut off is none
                h = FakeHandle(state_dir=tmp_path / name, services=services)
                steps = [Start(), Check(ok=nothing), Apply(ok=nothing), ExpectClean()]
                await _steps_no_close(guest(bed, name, **params), steps, h)
                half = len(h.changes) // 2  # the check reports what the apply changes
                assert h.fields()[:half] == h.fields()[half:], (case, h.changes)
                assert bed.state(name) == ("" if nothing else SHOWN[state]), case
                if not nothing:
                    info = bed.virsh("dominfo", name).stdout
                    assert bed.persistent(name) is not transient, case
                    if not transient:
                        auto = "enable" if startup == "enabled" else "disable"
                        assert f"Autostart:      {auto}\n" in info, (case, info)
                again = guest(bed, name, **params)
                h2 = FakeHandle(state_dir=tmp_path / name, services=services)
                await _steps_no_close(
                    again, [Start(), ExpectClean(), Apply(ok=True, changes=[])], h2
                )
                assert bed.state(name) == ("" if nothing else SHOWN[state]), case
                done.append(case)
                await asyncio.to_thread(bed.remove_test_domains)
        finally:
            await services.really_close()
            bed.remove_test_domains()

    asyncio.run(go())
    assert len(done) == len(MATRIX) == 12, done


#: walks through every change of state (persistent: all six; transient: the four
#: between existing states, and shut off = gone and back)
WALKS = {
    False: ["running", "paused", "shutoff", "paused", "running", "shutoff", "running"],
    True: ["running", "paused", "running", "shutoff", "paused", "shutoff"],
}


@pytest.mark.slow
@pytest.mark.parametrize("transient", [False, True])
def test_every_change_of_state_of_a_real_guest_is_one_apply_then_clean(
    libvirtbed: LibvirtBed, tmp_path: Path, transient: bool
) -> None:
    """From each state to each other on the real daemon: one apply reporting `state`,
    libvirt has it, and the next run (a new resource) changes nothing."""
    bed = libvirtbed
    name = f"{PREFIX}walk"

    async def go() -> None:
        services = Shared()
        try:
            before = None
            for state in WALKS[transient]:
                step = f"{before} -> {state} (transient={transient})"
                h = FakeHandle(state_dir=tmp_path, services=services)
                res = guest(bed, name, state=state, transient=transient)
                first = ["definition", "state"] if before is None and not transient else ["state"]
                await _steps_no_close(res, [Start(), Apply(changes=first), ExpectClean()], h)
                gone = transient and state == "shutoff"
                assert bed.state(name) == ("" if gone else SHOWN[state]), step
                again = guest(bed, name, state=state, transient=transient)
                h2 = FakeHandle(state_dir=tmp_path, services=services)
                await _steps_no_close(again, [Start(), Apply(ok=True, changes=[])], h2)
                before = state
        finally:
            await services.really_close()
            bed.remove_test_domains()

    asyncio.run(go())


def _admin(bed: LibvirtBed, *args: str) -> str:
    """`virt-admin ARGS` on the bed's libvirtd (its admin socket); its output."""
    admin = (
        f"libvirtd:///system?socket={bed.root}/run/libvirt-admin-sock"
        if bed.ours
        else "libvirtd:///system"
    )
    r = subprocess.run(["virt-admin", "-q", "-c", admin, *args], capture_output=True, text=True)
    assert r.returncode == 0, f"virt-admin {' '.join(args)}: {r.stderr}"
    return r.stdout


def _clients_of(bed: LibvirtBed, pid: int) -> list[str]:
    """The clients of libvirtd's `libvirtd` server that process `pid` holds (by its
    admin socket: `virt-admin client-list`, then `client-info` for each one's pid)."""

    def admin_cmd(*args: str) -> str:
        return _admin(bed, *args)

    ids = [
        line.split()[0]
        for line in admin_cmd("client-list", "libvirtd").splitlines()
        if line.split() and line.split()[0].isdigit()
    ]
    mine = []
    for client in ids:
        info = dict(
            (k.strip(), v.strip())
            for k, _, v in (line.partition(":") for line in admin_cmd(
                "client-info", "libvirtd", client).splitlines())
        )  # fmt: skip
        if info.get("unix_process_id") == str(pid):
            mine.append(client)
    assert ids, "libvirtd lists no client at all"
    return mine


@pytest.mark.slow
def test_100_domains_on_a_real_libvirtd_share_one_connection(
    libvirtbed: LibvirtBed, tmp_path: Path
) -> None:
    """100 persistent shut-off domains (defined only), each resource watching its own:
    libvirtd sees one client connection of this process, and every resource hears
    the event of its domain's definition over it."""
    bed = libvirtbed
    names = [f"{PREFIX}c{i:03}" for i in range(100)]

    async def go() -> None:
        services = Shared()
        pulse = Pulse()
        try:
            resources = [guest(bed, n, state="shutoff") for n in names]
            handles = [
                WatchedHandle(pulse, state_dir=tmp_path / r.name, services=services)
                for r in resources
            ]
            for r, h in zip(resources, handles, strict=True):
                steps = [Start(watch=True), Apply(changes=["definition"]), ExpectClean()]
                await arun_steps_keep(r, steps, h)
            await pulse.until(lambda: all(h.events for h in handles), "each domain's event")
            link = services.get(LibvirtLinks).links()[bed.uri]
            assert link.opened == 1
            clients = await asyncio.to_thread(_clients_of, bed, os.getpid())
            assert len(clients) == 1, clients  # (the bar: <= 2)
            listed = bed.virsh("list", "--inactive", "--persistent", "--name").stdout.split()
            assert sorted(n for n in listed if n.startswith(PREFIX)) == names
            for r in resources:  # the second run over them: nothing to do
                assert await r.check_apply(False)
            for r, h in zip(resources, handles, strict=True):
                h.unsubscribe()  # type: ignore[attr-defined]
                await r.cleanup()
            for n in names:
                await link.call(_undefine_by_name, n)
        finally:
            await services.really_close()

    asyncio.run(go())
    assert bed.domains() == []


def _undefine_by_name(conn: Any, name: str) -> None:
    conn.lookupByName(name).undefine()


def _iso(tmp: Path) -> Path:
    """A CD image with one file on it: an ISO 9660 made by xorriso (scripts/setup
    installs it)."""
    if shutil.which("xorriso") is None:
        pytest.fail("xorriso is not installed: run scripts/setup as root")
    tree = tmp / "cd"
    tree.mkdir()
    (tree / "hello.txt").write_text("hello from the cdrom\n")
    iso = tmp / "cd.iso"
    subprocess.run(["xorriso", "-as", "mkisofs", "-quiet", "-o", str(iso), str(tree)],
                   check=True, capture_output=True)  # fmt: skip
    iso.chmod(0o644)
    return iso


@pytest.mark.slow
def test_a_guest_with_a_cdrom_and_a_shared_directory(
    libvirtbed: LibvirtBed, tmp_path: Path
) -> None:
    """A cdrom (IDE, an image the test makes) and a filesystem (9p passthrough, read
    only) on a running TCG guest without a disk: libvirt accepts both, QEMU has the
    medium in the drive and the 9p device, and a second run changes nothing."""
    bed = libvirtbed
    name = f"{PREFIX}devs"
    # QEMU (user libvirt-qemu) opens the image and the directory: not under pytest's
    # tmp_path (/tmp/pytest-of-root is 0700), but beside the guest's kernel
    top = Path(tempfile.mkdtemp(prefix="devs-", dir=bed.kernel.parent))
    top.chmod(0o755)
    share = top / "share"
    share.mkdir(mode=0o755)
    (share / "file").write_text("shared\n")
    iso = _iso(top)
    devices: dict[str, Any] = {
        "cdrom": [{"source": str(iso)}],
        "filesystem": [{"source": str(share), "target": "share", "read_only": True}],
    }

    async def go() -> None:
        services = Shared()
        try:

            def h() -> FakeHandle:
                return FakeHandle(state_dir=tmp_path / "st", services=services)

            res = guest(bed, name, **devices)
            steps = [Start(), Apply(changes=["definition", "state"]), ExpectClean()]
            await _steps_no_close(res, steps, h())
            assert bed.state(name) == "running"
            blk = bed.virsh("domblklist", name, "--details").stdout
            assert f"file cdrom hdc {iso}" in " ".join(blk.split()), blk
            hmp = "qemu-monitor-command"
            block = bed.virsh(hmp, "--hmp", name, "info block").stdout
            assert str(iso) in block, block  # the medium is in QEMU's drive
            qtree = bed.virsh(hmp, "--hmp", name, "info qtree").stdout
            assert "virtio-9p" in qtree, qtree
            assert 'mount_tag = "share"' in qtree, qtree
            live = bed.dumpxml(name)
            assert f"<source dir='{share}'/>" in live, live
            assert "<target dir='share'/>" in live, live
            again = guest(bed, name, **devices)
            await _steps_no_close(again, [Start(), ExpectClean()], h())
            off = guest(bed, name, state="shutoff", **devices)
            await _steps_no_close(off, [Start(), Apply(changes=["state"]), ExpectClean()], h())
        finally:
            await services.really_close()
            bed.remove_test_domains()
            shutil.rmtree(top)

    asyncio.run(go())


def _macs(xml: str) -> list[str]:
    """The MAC addresses of a domain's XML, in the order of its interfaces."""
    return re.findall(r"<mac address='([0-9a-f:]+)'/>", xml)


def _memory_kib(xml: str) -> int:
    found = re.search(r"<memory unit='KiB'>(\d+)</memory>", xml)
    assert found is not None, xml
    return int(found.group(1))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_running_guests_definition_changes_converge_with_uuid_and_macs_kept(
    libvirtbed: LibvirtBed, tmp_path: Path
) -> None:
    """A running persistent guest on the real daemon, its definition changed step by
    step; each step is one apply, then a second run (a new resource) is clean, and
    the UUID and every MAC stay as derived throughout.

    - memory with `restartondiverge: ifneeded`: redefined and restarted, QEMU has it;
      with `ignore`: redefined only, the running guest keeps its memory until the
      graph shuts it off and starts it again;
    - cpus within maxcpus with `hotcpus`: plugged in live (same domain id);
    - a `user` interface, then a raw disk, added and removed: plugged in and out
      live (same domain id), the definition redefined to match; QEMU has each, then
      not. Unplugging needs the guest's ACPI: the test waits for the guest to be
      up (its console) first: a guest still booting does not ack (measured);
    - a paused guest: a disk plugged in live, but its unplug is not acked, so with
      `ifneeded` it is redefined and restarted (paused again)."""
    bed = libvirtbed
    name = f"{PREFIX}conv"
    # QEMU (user libvirt-qemu) opens the disk image: beside the guest's kernel, not
    # under pytest's tmp_path (/tmp/pytest-of-root is 0700)
    top = Path(tempfile.mkdtemp(prefix="conv-", dir=bed.kernel.parent))
    top.chmod(0o755)
    img = top / "disk.raw"
    subprocess.run(["truncate", "-s", "1M", str(img)], check=True)
    img.chmod(0o644)
    one_net: list[dict[str, Any]] = [{"type": "user"}]
    base: dict[str, Any] = {"cpus": 1, "maxcpus": 2, "hotcpus": True, "network": one_net}
    more = GUEST_KIB + 32768  # 160 MiB
    most = GUEST_KIB + 65536  # 192 MiB
    seen: dict[str, str] = {}

    def domid() -> str:
        return bed.virsh("domid", name).stdout.strip()

    def live_memory() -> int:
        info = bed.virsh("dominfo", name).stdout
        found = re.search(r"Max memory:\s+(\d+) KiB", info)
        assert found is not None, info
        return int(found.group(1))

    def identity(nets: int) -> None:
        """The UUID is the first one seen, and each MAC (live and defined) derived from it."""
        dom_uuid = bed.virsh("domuuid", name).stdout.strip()
        assert seen.setdefault("uuid", dom_uuid) == dom_uuid
        want = [derived_mac(dom_uuid, i) for i in range(nets)]
        assert _macs(bed.dumpxml(name, inactive=True)) == want
        if bed.state(name) != "shut off":
            assert _macs(bed.dumpxml(name)) == want
            listed = bed.virsh("domiflist", name).stdout
            assert [line.split()[-1] for line in listed.splitlines() if line.split()] == want

    async def go() -> None:
        services = Shared()

        def h() -> FakeHandle:
            return FakeHandle(state_dir=tmp_path / "st", services=services)

        async def converge(params: dict[str, Any], changes: list[str]) -> None:
            """One apply reporting `changes`; then a second run finds nothing to do."""
            res = guest(bed, name, **params)
            await _steps_no_close(res, [Start(), Apply(changes=changes), ExpectClean()], h())
            again = guest(bed, name, **params)
            steps = [Start(), ExpectClean(), Apply(ok=True, changes=[])]
            await _steps_no_close(again, steps, h())
            identity(len(params.get("network", ())))

        stack = contextlib.ExitStack()
        try:
            await converge(base, ["definition", "state"])
            assert bed.state(name) == "running"
            assert bed.persistent(name)
            assert live_memory() == GUEST_KIB

            # 1. memory, ifneeded: redefined, restarted with it
            first = domid()
            ifneeded = {**base, "restartondiverge": "ifneeded"}
            await converge({**ifneeded, "memory": more}, ["definition", "state"])
            assert bed.state(name) == "running"
            assert domid() != first  # a new QEMU
            assert live_memory() == more
            assert _memory_kib(bed.dumpxml(name, inactive=True)) == more
            #    ignore: the definition has it, the running guest keeps its own
            first = domid()
            ignore = {**base, "restartondiverge": "ignore", "memory": most}
            await converge(ignore, ["definition"])
            assert domid() == first
            assert live_memory() == more
            assert _memory_kib(bed.dumpxml(name, inactive=True)) == most
            #    ... until its next start
            await converge({**ignore, "state": "shutoff"}, ["state"])
            await converge(ignore, ["state"])
            assert live_memory() == most
            wait_up = stack.enter_context(bed.console(name))  # (heard from now on)

            # 2. cpus within maxcpus, hotcpus: live, the same QEMU
            first = domid()
            cpus2 = {**ignore, "cpus": 2}
            await converge(cpus2, ["definition", "cpus"])
            assert domid() == first
            assert bed.virsh("vcpucount", name, "--live", "--active").stdout.split() == ["2"]
            assert bed.virsh("vcpucount", name, "--config", "--active").stdout.split() == ["2"]

            # 3. a second interface added: plugged in live (the same QEMU); removed
            #    once the guest is up (ACPI: it must let go): unplugged live
            ifneeded = {**cpus2, "restartondiverge": "ifneeded"}
            two_nets = {**ifneeded, "network": [*one_net, {"type": "user"}]}
            first = domid()
            await converge(two_nets, ["definition", "network"])
            assert domid() == first
            assert bed.state(name) == "running"
            assert len(_macs(bed.dumpxml(name))) == 2  # (and as derived: identity)
            wait_up()
            await converge(ifneeded, ["definition", "network"])
            assert domid() == first
            assert len(_macs(bed.dumpxml(name))) == 1

            # 4. a raw disk added, then removed: the same, live
            disk = {**ifneeded, "disk": [{"source": str(img), "type": "raw"}]}
            await converge(disk, ["definition", "disk"])
            assert domid() == first
            blk = bed.virsh("domblklist", name, "--details").stdout
            assert f"file disk vda {img}" in " ".join(blk.split()), blk
            block = bed.virsh("qemu-monitor-command", "--hmp", name, "info block").stdout
            assert str(img) in block, block  # QEMU opened the image
            await converge(ifneeded, ["definition", "disk"])
            assert domid() == first
            block = bed.virsh("qemu-monitor-command", "--hmp", name, "info block").stdout
            assert str(img) not in block, block  # QEMU closed the image
            assert str(img) not in bed.dumpxml(name)
            assert str(img) not in bed.dumpxml(name, inactive=True)
            assert bed.state(name) == "running"
            assert bed.virsh("vcpucount", name, "--live", "--active").stdout.split() == ["2"]
            assert live_memory() == most

            # 5. a paused guest takes a disk live, but cannot let go of it (it runs
            #    no code to ack the unplug): redefined and restarted (ifneeded)
            await converge({**disk, "state": "paused"}, ["definition", "disk", "state"])
            assert domid() == first
            assert str(img) in bed.dumpxml(name)
            await converge({**ifneeded, "state": "paused"}, ["definition", "state"])
            assert domid() != first
            assert bed.state(name) == "paused"
            assert str(img) not in bed.dumpxml(name)
            assert str(img) not in bed.dumpxml(name, inactive=True)
        finally:
            stack.close()
            await services.really_close()
            bed.remove_test_domains()
            shutil.rmtree(top)

    asyncio.run(go())
    assert "uuid" in seen


@pytest.mark.slow
def test_an_agent_converges_a_guest_repairs_it_once_per_drift_and_reverses_it(
    libvirtbed: LibvirtBed, tmp_path: Path, agents: Callable[..., Agent]
) -> None:
    """End to end: `evergraph run` twice (the second changes nothing), then an agent
    that repairs a `virsh destroy` with one start, and undefines the guest when the
    graph drops it (`meta: {reverse: true}`)."""
    bed = libvirtbed
    name = f"{PREFIX}agent"
    g = tmp_path / "g.yaml"
    graph = (
        f"graph: g\nresources:\n  virt:\n  - name: {name}\n    uri: '{bed.uri}'\n"
        f"    memory: {GUEST_KIB}\n    domaintype: qemu\n    kernel: {bed.kernel}\n"
        f"    initrd: {bed.initrd}\n    cmdline: console=ttyS0\n"
        "    network:\n    - type: user\n    meta: {reverse: true}\n"
    )
    save(g, graph)
    try:
        first = run_cli("run", g, "--state-dir", tmp_path / "s1", "--converged-exit")
        assert first.returncode == 0, first.stderr
        assert bed.state(name) == "running"
        uuid = bed.virsh("domuuid", name).stdout.strip()
        again = run_cli("run", g, "--state-dir", tmp_path / "s1", "--converged-exit")
        assert again.returncode == 0, again.stderr
        assert f"virt[{name}]: started" not in again.stderr + again.stdout
        assert f"virt[{name}]: defined" not in again.stderr + again.stdout
        assert "recap: nothing changed or failed, 1 clean" in again.stderr + again.stdout

        agent = agents(g, tmp_path / "s1")  # the first run captured the reversal
        agent.wait_converged(1, timeout=60)
        bed.virsh("destroy", name)
        agent.wait_converged(2, timeout=60)
        assert bed.state(name) == "running"
        assert agent.log.read_text().count(f"virt[{name}]: started") == 1  # the one repair
        assert bed.virsh("domuuid", name).stdout.strip() == uuid
        # the graph drops it: reversed (it did not exist before the first run)
        save(g, "graph: g\nresources:\n  noop:\n  - name: n\n")
        wait_for(lambda: bed.state(name) == "", 60, "the guest to be undefined")
        agent.wait_converged(3, timeout=60)
    finally:
        bed.remove_test_domains()
