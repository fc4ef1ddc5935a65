"""virt: a libvirt domain (a virtual machine) defined, running, paused or shut off.

mgmt's `virt` kind, with its parameter names, through libvirt's Python binding.
The resource's name is the domain's name; `uri` the hypervisor connection.

- `transient: false` (persistent): the domain is defined (`defineXML`) with
  the graph's definition, then brought to `state`: `running` starts it
  (resumes a paused one), `paused` starts it paused (suspends a running one),
  `shutoff` destroys a running one and keeps the definition. `startup`
  manages libvirt's autostart.
- `transient: true`: no definition is kept. `running`/`paused` create the
  domain from the XML when it does not run; `shutoff` destroys it (it then
  does not exist). A persistent domain of that name is undefined first.
- The definition converges: the graph's XML is compared with the domain's on
  what the parameters say (memory, cpus, maxcpus, boot, kernel, disks,
  cdroms, networks, filesystems); a persistent domain is redefined. A running
  domain whose only differences are disks and interfaces (not cdroms) added or
  removed, and the cpu count with `hotcpus`, takes them live (hot-plug, see
  `Virt._hotplug`); anything else, or a hot-plug libvirt or the guest refuses,
  follows `restartondiverge`: `ifneeded` restarts it, `error` fails, `ignore`
  (or empty) lets it run as it is until its next start.
- The UUID is the domain's if it exists, else the one kept in the state dir,
  else derived from the URI and the name; each network's MAC is derived from
  the UUID (unless `mac` is given): a domain defined again keeps both.
- Direct kernel boot (no disk needed): `kernel`, `initrd`, `cmdline` (these,
  `domaintype` and a network's `type` are evergraph's, not mgmt's).
- The watch is libvirt's domain lifecycle events (no polling), through one
  connection per URI per agent; a lost libvirtd is reconnected with backoff and
  every domain looked at again.
- `meta: {reverse: true}`: a domain the graph created is destroyed and
  undefined when the resource leaves the graph; one that existed before is
  left as it is then.
"""

from __future__ import annotations

import hashlib
import os
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec

from evergraph.engine.contract import Handle, Resource, doc, register
from evergraph.errors import ResourceError

if TYPE_CHECKING:
    from evergraph.resources._libvirt import Link

#: the namespace of the UUIDs derived from a domain's URI and name
_UUID_NS = uuid.UUID("8d0d3f4e-6a0b-4bb7-9a2f-0c7e5d1f2a61")
_BOOT = frozenset({"fd", "hd", "cdrom", "network"})
#: libvirt's domain states (virDomainState) as the resource names them
_STATES = {1: "running", 2: "running", 3: "paused", 4: "running", 5: "shutoff", 6: "shutoff"}
_STATES |= {0: "shutoff", 7: "paused"}


class Disk(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A disk image file."""

    source: Annotated[str, doc("the image file (`~` is expanded)")]
    type: Annotated[str, doc("its format: qcow2, raw, ...")] = "raw"


class CDRom(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A CD-ROM image file."""

    source: Annotated[str, doc("the image file (`~` is expanded)")]
    type: Annotated[str, doc("its format (raw)")] = "raw"


class Network(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A network interface."""

    name: Annotated[str, doc("the libvirt network (or bridge) it is on")] = ""
    mac: Annotated[str, doc("its MAC address; empty: derived from the domain's UUID")] = ""
    type: Annotated[
        Literal["network", "bridge", "user"],
        doc("`network` (mgmt's), `bridge`, or `user` (QEMU's own NAT, no name)"),
    ] = "network"


class Filesystem(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A host directory shared with the guest."""

    source: Annotated[str, doc("the host directory")]
    target: Annotated[str, doc("the tag (or path) the guest sees")]
    access: Annotated[str, doc("accessmode: passthrough, mapped, squash; empty: default")] = ""
    read_only: Annotated[bool, doc("read only")] = False


class Auth(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Credentials for the connection."""

    username: Annotated[str, doc("user name")] = ""
    password: Annotated[str, doc("password")] = ""


@register("virt")
class Virt(Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
    """A libvirt domain (the name): defined, running, paused or shut off."""

    uri: Annotated[str, doc("libvirt connection URI")] = "qemu:///system"
    state: Annotated[
        Literal["running", "paused", "shutoff"], doc("`running`, `paused` or `shutoff`")
    ] = "running"
    startup: Annotated[
        Literal["enabled", "disabled", ""],
        doc("autostart with the host (persistent domains); empty = not managed"),
    ] = ""
    transient: Annotated[bool, doc("not defined: exists only while it runs")] = False
    cpus: Annotated[int, doc("virtual CPUs (>= 1)")] = 1
    maxcpus: Annotated[int, doc("virtual CPUs it may grow to; 0 = cpus")] = 0
    hotcpus: Annotated[bool, doc("change the cpu count of a running domain live")] = False
    memory: Annotated[int, doc("memory in KiB (> 0)")] = 0
    osinit: Annotated[str, doc("init of an lxc domain")] = ""
    boot: Annotated[list[str], doc("boot order: fd, hd, cdrom, network")] = []
    disk: Annotated[
        list[Disk], doc("disk images: `source` (file), `type` (format: qcow2, raw)")
    ] = []
    cdrom: Annotated[list[CDRom], doc("CD-ROM images: `source` (file), `type` (format)")] = []
    network: Annotated[
        list[Network],
        doc(
            "interfaces: `name` (network), `mac` (default derived), `type` (network, bridge, user)"
        ),
    ] = []
    filesystem: Annotated[
        list[Filesystem], doc("host directories: `source`, `target`, `access`, `read_only`")
    ] = []
    auth: Annotated[Auth | None, doc("credentials for the connection: `username`, `password`")] = (
        None
    )
    restartondiverge: Annotated[
        Literal["", "ignore", "ifneeded", "error"],
        doc("a running domain whose definition changed: ignore, ifneeded (restart), error"),
    ] = ""
    restartonrefresh: Annotated[bool, doc("a refresh (notify edge) restarts it")] = False
    kernel: Annotated[str, doc("direct kernel boot: the kernel (evergraph's)")] = ""
    initrd: Annotated[str, doc("direct kernel boot: the initrd (evergraph's)")] = ""
    cmdline: Annotated[str, doc("direct kernel boot: the command line (evergraph's)")] = ""
    domaintype: Annotated[
        Literal["", "kvm", "qemu", "lxc"],
        doc("domain type; empty: lxc for lxc URIs, else kvm if the host has it, else qemu"),
    ] = ""

    # -- input --------------------------------------------------------------------
    def validate(self) -> None:
        if not self.name or "/" in self.name:
            raise self.bad("name", f"{self.name!r} is not a domain name")
        if not self.uri:
            raise self.bad("uri", "must name a libvirt connection (qemu:///system)")
        if self.memory <= 0:
            raise self.bad("memory", f"must be > 0 KiB, not {self.memory}")
        if self.cpus < 1:
            raise self.bad("cpus", f"must be >= 1, not {self.cpus}")
        if self.maxcpus < 0:
            raise self.bad("maxcpus", f"must be >= 0 (0: cpus), not {self.maxcpus}")
        if self.maxcpus and self.cpus > self.maxcpus:
            raise self.bad("cpus", f"{self.cpus} is above maxcpus ({self.maxcpus})")
        for i, dev in enumerate(self.boot):
            if dev not in _BOOT:
                raise self.bad(f"boot[{i}]", f"{dev!r} is not one of {', '.join(sorted(_BOOT))}")
        for i, net in enumerate(self.network):
            if net.mac and not _is_mac(net.mac):
                raise self.bad(f"network[{i}].mac", f"{net.mac!r} is not a MAC address")
            if net.type != "user" and not net.name:
                raise self.bad(f"network[{i}].name", f"a {net.type} interface needs a name")
        if self.transient and self.startup == "enabled":
            raise self.bad("startup", "a transient domain cannot start with the host")

    def claims(self) -> list[str]:
        return [f"virt:{self.uri}:{self.name}"]

    def autoedge_wants(self) -> list[list[str]]:
        files = [self.kernel, self.initrd, *(d.source for d in self.disk)]
        files += [c.source for c in self.cdrom]
        wants = [[f"path:{os.path.expanduser(f)}"] for f in files if f]
        if _local(self.uri):
            wants.append(["path:/usr/sbin/libvirtd"])  # after the libvirt packages
        return wants

    # -- life cycle ---------------------------------------------------------------
    async def init(self, handle: Handle) -> None:
        await super().init(handle)
        import libvirt

        from evergraph.resources._libvirt import LibvirtLinks, one_line

        self._link: Link | None = None
        try:
            auth = (self.auth.username, self.auth.password) if self.auth else None
            self._link = await handle.services.get(LibvirtLinks).acquire(self.uri, auth)
        except libvirt.libvirtError as e:
            raise ResourceError(
                f"{self.ident}.uri: cannot connect to {self.uri}: {one_line(e)}"
            ) from None
        self._found = await self._link.call(_observe, self.name)

    def subscribe(self) -> Callable[[], None] | None:
        assert self._link is not None
        return self._link.subscribe(self.name, self.handle.event)

    def reversal(self) -> Virt | None:
        found = getattr(self, "_found", ())
        if found is not None:  # it existed (or init did not run): nothing to undo
            return None
        return Virt(name=self.name, uri=self.uri, memory=self.memory, transient=True,
                    state="shutoff")  # fmt: skip

    # -- check and apply ----------------------------------------------------------
    async def check_apply(self, apply: bool) -> bool:
        link = self._link
        assert link is not None
        found = await link.call(_observe, self.name)
        clean = True
        if self.transient and found is not None and found.persistent:
            clean = False
            self.handle.changed("transient", False, True)
            if apply:
                await link.call(_undefine, self.name)
                self._log("undefined (transient)")
            if apply:
                found = await link.call(_observe, self.name)
            elif found.state == "shutoff":  # (noop: what undefining would leave)
                found = None
            else:
                found = msgspec.structs.replace(found, persistent=False, inactive_shape=None)
        if self.transient and self.state == "shutoff":
            if found is not None:
                clean = False
                self.handle.changed("state", found.state, "shutoff")
                if apply:
                    await link.call(_destroy, self.name)
                    self._log("destroyed")
            return clean
        want_uuid = found.uuid if found is not None else self._uuid()
        xml = await self._xml(link, want_uuid)
        if apply:
            self._missing_files()
        if not self.transient:
            clean = await self._definition(link, found, xml, want_uuid, apply) and clean
        now = found.state if found is not None else "shutoff"
        if now != "shutoff" and self.state != "shutoff" and found is not None:
            live = await self._live(link, found, xml, apply)
            if live == "restart":
                self.handle.changed("state", now, f"{self.state} (restarted)")
                if apply:
                    await link.call(_destroy, self.name)
                    self._keep_uuid(want_uuid)
                    await self._start(link, xml, paused=self.state == "paused")
                    self._log("restarted")
                return False
            clean = clean and live != "changed"
        if now == self.state:
            return clean
        clean = False
        self.handle.changed("state", now, self.state)
        if not apply:
            return clean
        if self.state == "shutoff":
            await link.call(_destroy, self.name)
            self._log("destroyed")
        elif now == "shutoff":
            await self._start(link, xml, paused=self.state == "paused")
            self._keep_uuid(want_uuid)
            self._log("started" + (" paused" if self.state == "paused" else ""))
        elif self.state == "paused":
            await link.call(_suspend, self.name)
            self._log("suspended")
        else:
            await link.call(_resume, self.name)
            self._log("resumed")
        return clean

    async def _definition(
        self, link: Link, found: Found | None, xml: str, want_uuid: str, apply: bool
    ) -> bool:
        """A persistent domain: defined as the graph says, autostart as `startup`."""
        clean = True
        inactive = found.inactive_shape if found is not None and found.persistent else None
        if inactive is None or _diff(inactive, _shape(xml)):
            clean = False
            self.handle.changed("definition", None if found is None else "differs", "defined")
            if apply:
                await link.call(_define, xml)
                self._keep_uuid(want_uuid)
                self._log("defined")
        want_auto = self.startup == "enabled"
        if self.startup and (found is None or found.autostart != want_auto):
            clean = False
            self.handle.changed("startup", None if found is None else found.autostart,
                                self.startup)  # fmt: skip
            if apply:
                await link.call(_autostart, self.name, want_auto)
        return clean

    async def _live(
        self, link: Link, found: Found, xml: str, apply: bool
    ) -> Literal["restart", "changed", ""]:
        """A running (or paused) domain against the graph's definition: `restart` it
        (a refresh with `restartonrefresh`, or `restartondiverge: ifneeded`), or
        `changed` live (disks and interfaces plugged/unplugged, the cpu count with
        `hotcpus`), or nothing to do here."""
        if self.handle.refresh() and self.restartonrefresh:
            return "restart"
        want = _shape(xml)
        diverged = _diff(found.live_shape, want)
        rest = diverged - {"disk", "network"} - ({"cpus"} if self.hotcpus else set())
        if diverged and not rest and _cdroms(found.live_shape) == _cdroms(want):
            why = await self._hotplug(link, found, xml, diverged, apply)
            if not why:
                return "changed"
            self._log(f"cannot change it live ({why}): restartondiverge is "
                      f"{self.restartondiverge or 'ignore'}")  # fmt: skip
        if diverged and self.restartondiverge == "error":
            raise ResourceError(
                f"{self.ident}: the running domain differs ({', '.join(sorted(diverged))})"
                " and restartondiverge is `error`"
            )
        return "restart" if diverged and self.restartondiverge == "ifneeded" else ""

    async def _hotplug(
        self, link: Link, found: Found, xml: str, diverged: set[str], apply: bool
    ) -> str:
        """Unplug the disks and interfaces the graph dropped, plug the ones it added
        (each device's XML exactly as in the definition: same MAC, same target), and
        set the cpu count; '' when done (or, not applying, when it would be tried),
        else why not (then nothing is reported: the caller falls back). Only the
        live domain is touched (AFFECT_LIVE, never CONFIG): `_definition` has
        already written the persistent one, exactly as the graph says, with
        defineXML, so a refused or half-done hot-plug never leaves it otherwise.

        Plugging in needs nothing of the guest. Unplugging asks it (ACPI) to let
        go; libvirt waits 5 s for that, and a device still in the live XML after
        the call is a refusal. Measured on the test bed (libvirt 9.0, QEMU under
        TCG, pc machine, Debian's kernel booting a busybox initramfs): a booted
        guest lets go of an interface or a virtio disk at once (< 1 s); a guest
        still booting (its ACPI not up) or paused never does (the request is
        lost), so the unplug then follows `restartondiverge`."""
        old = _pluggable(found.live_xml or "")
        new = _pluggable(xml)
        drop = [(k, v) for k, v in old.items() if k not in new]
        add = [(k, v) for k, v in new.items() if k not in old]
        changes: list[tuple[str, object, object]] = [
            *((k[0], _device_text(k), None) for k, _ in drop),
            *((k[0], None, _device_text(k)) for k, _ in add),
        ]
        if "cpus" in diverged:
            changes.append(("cpus", (found.live_shape or {}).get("cpus"), self.cpus))
        # a refusal is remembered for this run of the domain and this plan: a later
        # check (dry run or not) says the same without asking again
        plan = f"{_domain_id(found.live_xml)} {sorted(str(k) for k, _ in drop + add)}"
        refused = self._refused()
        if refused and refused[0] == plan:
            return refused[1]
        if apply:  # reported once done: a refused hot-plug is no change
            why: str = await link.call(_hotplug, self.name, drop, [v for _, v in add])
            if why:
                self._refused((plan, why))
                return why
            if "cpus" in diverged:
                await link.call(_set_vcpus, self.name, self.cpus)
        for field, was, now in changes:
            self.handle.changed(field, was, now)
            if apply and field != "cpus":
                self._log(f"{'plugged' if was is None else 'unplugged'} {field} {was or now}")
        return ""

    def _refused(self, keep: tuple[str, str] | None = None) -> tuple[str, str] | None:
        """The hot-plug plan last refused and why (in the state dir), or `keep` it."""
        try:
            path = self.handle.state_dir / "hotplug-refused"
            if keep is not None:
                path.write_text("\n".join(keep) + "\n")
                return keep
            plan, _, why = path.read_text().rstrip("\n").partition("\n")
            return plan, why
        except (OSError, ResourceError):
            return None

    async def _start(self, link: Link, xml: str, paused: bool) -> None:
        if self.transient:
            await link.call(_create_transient, self.name, xml, paused)
        else:
            await link.call(_create, self.name, paused)

    def _log(self, what: str) -> None:
        self.handle.logger.info("%s: %s", self.ident, what)

    def _missing_files(self) -> None:
        """A disk, cdrom, kernel or initrd that is not there (on a local URI)."""
        if not _local(self.uri):
            return
        for fields, files in (
            ("disk", [d.source for d in self.disk]),
            ("cdrom", [c.source for c in self.cdrom]),
            ("kernel", [self.kernel]),
            ("initrd", [self.initrd]),
        ):
            for i, f in enumerate(files):
                path = os.path.expanduser(f)
                if f and not os.path.exists(path):
                    where = fields if fields in ("kernel", "initrd") else f"{fields}[{i}].source"
                    raise ResourceError(f"{self.ident}.{where}: {path}: no such file")

    # -- identity -----------------------------------------------------------------
    def _uuid(self) -> str:
        try:
            kept = (self.handle.state_dir / "uuid").read_text().strip()
            return str(uuid.UUID(kept))
        except (OSError, ValueError, ResourceError):
            return str(uuid.uuid5(_UUID_NS, f"{self.uri}\n{self.name}"))

    def _keep_uuid(self, value: str) -> None:
        try:
            path = self.handle.state_dir / "uuid"
            if not path.exists() or path.read_text().strip() != value:
                path.write_text(value + "\n")
        except (OSError, ResourceError):
            pass  # the derived one is as stable

    async def _xml(self, link: Link, domain_uuid: str) -> str:
        dtype = self.domaintype or await self._auto_type(link)
        return domain_xml(self, dtype, domain_uuid)

    async def _auto_type(self, link: Link) -> str:
        if self.uri.startswith("lxc"):
            return "lxc"
        dtype: str | None = getattr(self, "_dtype", None)
        if dtype is None:  # asked once: the host's hypervisor does not change
            caps: str = await link.call(lambda conn: conn.getCapabilities())
            types = [el.get("type") for el in ET.fromstring(caps).iterfind("guest/arch/domain")]
            dtype = next((t for t in ("kvm", "qemu", *types) if t in types), "qemu") or "qemu"
            self._dtype = dtype
        return dtype


# -- the XML ----------------------------------------------------------------------


def _local(uri: str) -> bool:
    """A URI whose hypervisor runs on this host (files named are files here)."""
    scheme, _, rest = uri.partition("://")
    return "+" not in scheme.replace("+unix", "") and not rest.partition("/")[0]


def _is_mac(text: str) -> bool:
    parts = text.split(":")
    return len(parts) == 6 and all(
        len(p) == 2 and all(c in "0123456789abcdefABCDEF" for c in p) for p in parts
    )


def derived_mac(domain_uuid: str, index: int) -> str:
    """A stable locally administered MAC (QEMU's 52:54:00 prefix) for interface `index`."""
    h = hashlib.sha256(f"{domain_uuid}/{index}".encode()).digest()
    return "52:54:00:" + ":".join(f"{b:02x}" for b in h[:3])


def domain_xml(res: Virt, dtype: str, domain_uuid: str) -> str:
    """The domain's definition from the resource's parameters."""
    d = ET.Element("domain", type=dtype)
    ET.SubElement(d, "name").text = res.name
    ET.SubElement(d, "uuid").text = domain_uuid
    ET.SubElement(d, "memory", unit="KiB").text = str(res.memory)
    ET.SubElement(d, "currentMemory", unit="KiB").text = str(res.memory)
    maxcpus = max(res.maxcpus, res.cpus)
    vcpu = ET.SubElement(d, "vcpu", placement="static")
    vcpu.text = str(maxcpus)
    if maxcpus > res.cpus:
        vcpu.set("current", str(res.cpus))
    os_ = ET.SubElement(d, "os")
    if dtype == "lxc":
        ET.SubElement(os_, "type").text = "exe"
        ET.SubElement(os_, "init").text = res.osinit or "/sbin/init"
    else:
        ET.SubElement(os_, "type").text = "hvm"
        for tag in ("kernel", "initrd", "cmdline"):
            value = getattr(res, tag)
            if value:
                ET.SubElement(os_, tag).text = (
                    os.path.expanduser(value) if tag != "cmdline" else value
                )
        for dev in res.boot:
            ET.SubElement(os_, "boot", dev=dev)
        features = ET.SubElement(d, "features")
        ET.SubElement(features, "acpi")  # without it a vcpu cannot be unplugged
        ET.SubElement(features, "apic")
    ET.SubElement(d, "on_poweroff").text = "destroy"
    ET.SubElement(d, "on_reboot").text = "restart"
    ET.SubElement(d, "on_crash").text = "destroy"
    devices = ET.SubElement(d, "devices")
    for i, disk in enumerate(res.disk):
        el = ET.SubElement(devices, "disk", type="file", device="disk")
        ET.SubElement(el, "driver", name="qemu", type=disk.type)
        ET.SubElement(el, "source", file=os.path.expanduser(disk.source))
        ET.SubElement(el, "target", dev=f"vd{chr(ord('a') + i)}", bus="virtio")
    for i, cd in enumerate(res.cdrom):
        el = ET.SubElement(devices, "disk", type="file", device="cdrom")
        ET.SubElement(el, "driver", name="qemu", type=cd.type)
        ET.SubElement(el, "source", file=os.path.expanduser(cd.source))
        ET.SubElement(el, "target", dev=f"hd{chr(ord('c') + i)}", bus="ide")
        ET.SubElement(el, "readonly")
    for i, net in enumerate(res.network):
        el = ET.SubElement(devices, "interface", type=net.type)
        ET.SubElement(el, "mac", address=(net.mac or derived_mac(domain_uuid, i)).lower())
        if net.type == "network":
            ET.SubElement(el, "source", network=net.name)
        elif net.type == "bridge":
            ET.SubElement(el, "source", bridge=net.name)
    for fs in res.filesystem:
        el = ET.SubElement(devices, "filesystem", type="mount")
        if fs.access:
            el.set("accessmode", fs.access)
        ET.SubElement(el, "source", dir=fs.source)
        ET.SubElement(el, "target", dir=fs.target)
        if fs.read_only:
            ET.SubElement(el, "readonly")
    if dtype != "lxc":
        serial = ET.SubElement(devices, "serial", type="pty")
        ET.SubElement(serial, "target", port="0")
    console = ET.SubElement(devices, "console", type="pty")
    ET.SubElement(console, "target", type="serial" if dtype != "lxc" else "lxc", port="0")
    return ET.tostring(d, encoding="unicode")


def _shape(xml: str) -> dict[str, Any]:
    """What the parameters decide of a domain's XML (libvirt's or ours), comparable."""
    d = ET.fromstring(xml)
    vcpu = d.find("vcpu")
    maxcpus = int(vcpu.text or 1) if vcpu is not None else 1
    cpus = int(vcpu.get("current", maxcpus)) if vcpu is not None else 1
    os_ = d.find("os")

    def text(tag: str) -> str:
        el = os_.find(tag) if os_ is not None else None
        return (el.text or "") if el is not None else ""

    disks = []
    for el in d.iterfind("devices/disk"):
        src = el.find("source")
        drv = el.find("driver")
        disks.append((el.get("device"), src.get("file") if src is not None else None,
                      drv.get("type") if drv is not None else None))  # fmt: skip
    nets = []
    for el in d.iterfind("devices/interface"):
        src = el.find("source")
        mac = el.find("mac")
        nets.append((el.get("type"), (src.get("network") or src.get("bridge")) if src is not None
                     else None, mac.get("address") if mac is not None else None))  # fmt: skip
    fss = []
    for el in d.iterfind("devices/filesystem"):
        src, tgt = el.find("source"), el.find("target")
        fss.append((src.get("dir") if src is not None else None,
                    tgt.get("dir") if tgt is not None else None,
                    el.get("accessmode", "passthrough"),
                    el.find("readonly") is not None))  # fmt: skip
    mem = d.find("memory")
    return {
        "type": d.get("type"),
        "memory": _kib(mem) if mem is not None else 0,
        "cpus": cpus,
        "maxcpus": maxcpus,
        "kernel": text("kernel"),
        "initrd": text("initrd"),
        "cmdline": text("cmdline"),
        "init": text("init"),
        "boot": [b.get("dev") for b in (os_.iterfind("boot") if os_ is not None else ())],
        "disk": disks,
        "network": nets,
        "filesystem": fss,
    }


def _kib(el: ET.Element) -> int:
    units = {"b": 1 / 1024, "bytes": 1 / 1024, "k": 1, "kib": 1, "m": 1024, "mib": 1024}
    units |= {"g": 1024**2, "gib": 1024**2}
    return int(int(el.text or 0) * units.get(el.get("unit", "KiB").lower(), 1))


def _diff(actual: dict[str, Any] | None, want: dict[str, Any]) -> set[str]:
    """The fields of `want` that `actual` differs in (no boot order given: libvirt's)."""
    if actual is None:
        return set()
    return {k for k in want if actual.get(k) != want[k] and (k != "boot" or want[k])}


#: a device the running domain takes and gives back live: ("disk", file, format,
#: target) or ("network", type, network or bridge, MAC)
DeviceKey = tuple[str, str | None, str | None, str | None]


def _pluggable(xml: str) -> dict[DeviceKey, str]:
    """The disks (not cdroms) and interfaces of a domain's XML, each as its XML."""
    if not xml:
        return {}
    found: dict[DeviceKey, str] = {}
    devices = ET.fromstring(xml).find("devices")
    for el in devices if devices is not None else ():
        src = el.find("source")
        if el.tag == "disk" and el.get("device", "disk") == "disk":
            drv, tgt = el.find("driver"), el.find("target")
            key: DeviceKey = ("disk", src.get("file") if src is not None else None,
                              drv.get("type") if drv is not None else None,
                              tgt.get("dev") if tgt is not None else None)  # fmt: skip
        elif el.tag == "interface":
            mac = el.find("mac")
            key = ("network", el.get("type"),
                   (src.get("network") or src.get("bridge")) if src is not None else None,
                   mac.get("address") if mac is not None else None)  # fmt: skip
        else:
            continue
        found[key] = ET.tostring(el, encoding="unicode")
    return found


def _device_text(key: DeviceKey) -> str:
    """A device as a change shows it: `vda /path/disk.raw (raw)`, `user 52:54:00:..`."""
    if key[0] == "disk":
        return f"{key[3]} {key[1]} ({key[2]})"
    return " ".join(str(part) for part in (key[1], key[2], key[3]) if part)


def _domain_id(live_xml: str | None) -> str:
    """The id of a running domain (a new one at each start)."""
    return ET.fromstring(live_xml).get("id", "") if live_xml else ""


def _cdroms(shape: dict[str, Any] | None) -> list[Any]:
    return [d for d in (shape or {}).get("disk", ()) if d[0] == "cdrom"]


# -- libvirt calls (each in a worker thread, on the shared connection) --------------


class Found(msgspec.Struct, frozen=True):
    """A domain as libvirt has it now."""

    uuid: str
    state: str
    persistent: bool
    autostart: bool
    inactive_shape: dict[str, Any] | None
    live_shape: dict[str, Any] | None
    live_xml: str | None = None


def _observe(conn: Any, name: str) -> Found | None:
    import libvirt

    try:
        dom = conn.lookupByName(name)
        state = _STATES.get(dom.state()[0], "shutoff")
        persistent = bool(dom.isPersistent())
        inactive = _shape(dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)) if persistent else None
        live_xml = dom.XMLDesc(0) if state != "shutoff" else None
        live = _shape(live_xml) if live_xml is not None else None
        autostart = bool(dom.autostart()) if persistent else False
        return Found(dom.UUIDString(), state, persistent, autostart, inactive, live, live_xml)
    except libvirt.libvirtError as e:
        if e.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
            return None
        raise


def _define(conn: Any, xml: str) -> None:
    conn.defineXML(xml)


def _undefine(conn: Any, name: str) -> None:
    conn.lookupByName(name).undefine()


def _destroy(conn: Any, name: str) -> None:
    import libvirt

    try:
        dom = conn.lookupByName(name)
        if dom.isActive():
            dom.destroy()
    except libvirt.libvirtError as e:
        if e.get_error_code() not in (libvirt.VIR_ERR_NO_DOMAIN, libvirt.VIR_ERR_OPERATION_INVALID):
            raise


def _create(conn: Any, name: str, paused: bool) -> None:
    dom = conn.lookupByName(name)
    _started(conn, name, lambda flags: dom.createWithFlags(flags), paused)


def _create_transient(conn: Any, name: str, xml: str, paused: bool) -> None:
    _started(conn, name, lambda flags: conn.createXML(xml, flags), paused)


def _started(conn: Any, name: str, start: Callable[[int], Any], paused: bool) -> None:
    """Start the domain; `paused`: never running a moment, where the driver can."""
    import libvirt

    if not paused:
        start(0)
        return
    try:
        start(libvirt.VIR_DOMAIN_START_PAUSED)
        return
    except libvirt.libvirtError as e:
        if e.get_error_code() not in (libvirt.VIR_ERR_INVALID_ARG, libvirt.VIR_ERR_NO_SUPPORT):
            raise
    start(0)  # a driver without START_PAUSED (libvirt's test driver): suspended after
    conn.lookupByName(name).suspend()


def _suspend(conn: Any, name: str) -> None:
    conn.lookupByName(name).suspend()


def _resume(conn: Any, name: str) -> None:
    conn.lookupByName(name).resume()


def _autostart(conn: Any, name: str, on: bool) -> None:
    conn.lookupByName(name).setAutostart(1 if on else 0)


def _set_vcpus(conn: Any, name: str, n: int) -> None:
    import libvirt

    conn.lookupByName(name).setVcpusFlags(n, libvirt.VIR_DOMAIN_AFFECT_LIVE)


def _hotplug(conn: Any, name: str, drop: list[tuple[DeviceKey, str]], add: list[str]) -> str:
    """Unplug `drop` (keys and live XML), then plug `add` (XML) into the running
    domain, live only (its definition is written apart): '' when done, else why not
    (libvirt refused, or the guest kept a device it was asked to release)."""
    import libvirt

    dom = conn.lookupByName(name)
    live = libvirt.VIR_DOMAIN_AFFECT_LIVE
    try:
        for _, dev in drop:
            dom.detachDeviceFlags(dev, live)
        kept = [key for key, _ in drop if key in _pluggable(dom.XMLDesc(0))]
        if kept:
            return f"the guest did not release {', '.join(_device_text(k) for k in kept)}"
        for dev in add:
            dom.attachDeviceFlags(dev, live)
    except libvirt.libvirtError as e:
        return " ".join(str(e).split())
    return ""
