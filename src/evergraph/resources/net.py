"""net: a network interface's state, addresses, default gateway and forwarding (mgmt's net).

The resource's name is the interface (it must exist: net configures links,
it does not create them). Everything goes through rtnetlink (pyroute2) in the
agent's network namespace:

- `state: up` or `down` sets the link's administrative state (`ip link set`);
  empty: not managed. A link kept down has no gateway to manage (the kernel
  drops its routes); its addresses are still kept as listed.
- `addrs` (CIDR, IPv4 or IPv6) are exactly the interface's addresses: missing
  ones are added, others removed, except the IPv6 link-local ones the kernel
  makes by itself (fe80::/10), unless listed. Unset: not managed; `[]`: none.
- `gateway`: the default route of the gateway's family in the main table goes
  through this interface to it (a replace, as mgmt does: a default route of
  another interface with the same metric is taken over); other default routes
  of the family on this interface are removed.
- `ip_forward`: IPv4 forwarding for this interface
  (`net.ipv4.conf.<name>.forwarding`); unset: not managed.

Unlike mgmt, no systemd-networkd file is written: the state is the running
one (a boot-time configuration is another resource's job, a `file`).

The watch is a netlink socket subscribed to the link, IPv4/IPv6 address and
route groups and IPv4 netconf (forwarding) changes; messages about other
interfaces are skipped.

Reversal restores the state found before the first change (the addresses,
administrative state, forwarding; the gateway when there was one).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import re
import threading
from typing import TYPE_CHECKING, Annotated, Any, Literal

from evergraph.engine.contract import Handle, Resource, doc, register
from evergraph.errors import ResourceError
from evergraph.resources._oserror import os_error

if TYPE_CHECKING:
    from pyroute2 import AsyncIPRoute

IFF_UP = 0x1
MAIN_TABLE = 254
#: rtnetlink multicast groups (bit masks): link, IPv4 and IPv6 addresses and
#: routes, IPv4 netconf (RTNLGRP_IPV4_NETCONF is group 24)
GROUPS = 0x1 | 0x10 | 0x40 | 0x100 | 0x400 | (1 << 23)
_IFNAME = re.compile(r"[^/\s:]{1,15}")
_LINK_LOCAL = ipaddress.ip_network("fe80::/10")

Address = ipaddress.IPv4Interface | ipaddress.IPv6Interface


def _forwarding_path(name: str) -> str:
    return f"/proc/sys/net/ipv4/conf/{name}/forwarding"


def _read_forwarding(name: str) -> bool:
    try:
        with open(_forwarding_path(name)) as f:
            return f.read().strip() != "0"
    except FileNotFoundError:
        raise ResourceError(f"no IPv4 configuration for {name} (is it an interface?)") from None


def _address_of(msg: Any) -> Address:
    addr = msg.get("local") or msg.get("address")
    return ipaddress.ip_interface(f"{addr}/{msg['prefixlen']}")


def _managed(addr: Address, wanted: set[Address]) -> bool:
    """Is `addr` (found on the interface) ours to keep or remove?"""
    return addr in wanted or not (addr.version == 6 and addr.ip in _LINK_LOCAL)


def _default_routes(routes: list[Any], index: int, family: int) -> list[Any]:
    return [
        r
        for r in routes
        if r["dst_len"] == 0
        and r["family"] == family
        and r["table"] == MAIN_TABLE
        and r.get("oif") == index
    ]


def _pyroute2() -> Any:
    """pyroute2, imported on first use (it takes a while), kept quiet: it logs every
    message at DEBUG, and sets its logger's level when imported."""
    import pyroute2

    logging.getLogger("pyroute2").setLevel(logging.WARNING)
    return pyroute2


async def _collect(result: Any) -> list[Any]:
    """pyroute2 answers a dump with an async generator, a get or set with a list."""
    if hasattr(result, "__aiter__"):
        return [m async for m in result]
    return list(result)


@register("net")
class Net(Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
    """A network interface (the name): up or down, its addresses, gateway, forwarding."""

    state: Annotated[
        Literal["up", "down", ""], doc("`up` or `down` (administrative); empty = not managed")
    ] = ""
    addrs: Annotated[
        list[str] | None,
        doc("the addresses, CIDR (`10.0.0.2/24`, `fd00::2/64`); unset = not managed"),
    ] = None
    gateway: Annotated[
        str, doc("the default route goes through this interface to it; empty = not managed")
    ] = ""
    ip_forward: Annotated[
        bool | None, doc("IPv4 forwarding on this interface; unset = not managed")
    ] = None

    def validate(self) -> None:
        if not _IFNAME.fullmatch(self.name) or self.name in (".", ".."):
            raise self.bad("name", f"{self.name!r} is not an interface name (1-15 characters)")
        for addr in self.addrs or ():
            if "/" not in addr:
                raise self.bad("addrs", f"{addr!r} has no prefix length (CIDR: `10.0.0.2/24`)")
            try:
                ipaddress.ip_interface(addr)
            except ValueError:
                raise self.bad("addrs", f"{addr!r} is not an address in CIDR form") from None
        if self.gateway:
            try:
                ipaddress.ip_address(self.gateway)
            except ValueError:
                raise self.bad("gateway", f"{self.gateway!r} is not an IP address") from None
        if self.state == "down" and self.gateway:
            raise self.bad("gateway", "a link kept down has no routes (the kernel drops them)")

    def claims(self) -> list[str]:
        return [f"net:{self.name}"]

    def reversal(self) -> Net | None:
        # reversal() is called from the event loop: pyroute2's synchronous API runs
        # its own loop, so it gets a thread of its own (a few ms, once per resource)
        found: list[Net | BaseException] = []
        thread = threading.Thread(target=lambda: found.append(self._found_now()))
        thread.start()
        thread.join()
        return found[0] if isinstance(found[0], Net) else None

    def _found_now(self) -> Net | BaseException:
        from pyroute2.netlink.exceptions import NetlinkError

        try:
            with _pyroute2().IPRoute() as ipr:
                link = ipr.link("get", ifname=self.name)[0]
                index = link["index"]
                state = ("up" if link["flags"] & IFF_UP else "down") if self.state else ""
                addrs = None
                if self.addrs is not None:
                    wanted = {ipaddress.ip_interface(a) for a in self.addrs}
                    found = [_address_of(a) for a in ipr.addr("dump", index=index)]
                    addrs = [str(a) for a in found if _managed(a, wanted)]
                gateway = ""
                if self.gateway:
                    family = 4 if ipaddress.ip_address(self.gateway).version == 4 else 6
                    fam = 2 if family == 4 else 10
                    routes = list(ipr.route("dump", family=fam))
                    defaults = _default_routes(routes, index, fam)
                    gateway = defaults[0].get("gateway") or "" if defaults else ""
        except (NetlinkError, OSError) as e:
            return e
        if state == "down":
            gateway = ""
        forward = _read_forwarding(self.name) if self.ip_forward is not None else None
        return Net(name=self.name, state=state, addrs=addrs, gateway=gateway, ip_forward=forward)  # type: ignore[arg-type]

    async def init(self, handle: Handle) -> None:
        await super().init(handle)
        self._ipr: AsyncIPRoute | None = None
        self._index: int | None = None

    async def cleanup(self) -> None:
        if getattr(self, "_ipr", None) is not None:
            assert self._ipr is not None
            with contextlib.suppress(Exception):
                self._ipr.close()
            self._ipr = None

    async def watch(self) -> None:
        ready = False
        while True:
            mon = _pyroute2().AsyncIPRoute()
            try:
                await mon.bind(groups=GROUPS)
                if not ready:
                    self.handle.ready()
                    ready = True
                # new, or again after a lost socket (an overflow): changes may be missed
                self.handle.event()
                while True:
                    got = False
                    async for msg in mon.get():  # one datagram's messages
                        got = True
                        if self._concerns_us(msg):
                            self.handle.event()
                    if not got:
                        break  # the socket was closed under us: a fresh one
            finally:
                with contextlib.suppress(Exception):
                    mon.close()
            self.handle.logger.debug("%s: netlink socket lost, subscribing again", self.ident)

    def _concerns_us(self, msg: Any) -> bool:
        event = str(msg.get("event", ""))
        if event in ("RTM_NEWLINK", "RTM_DELLINK"):
            return bool(msg.get("ifname") == self.name or msg.get("index") == self._index)
        if event.endswith("ADDR"):
            return self._index is None or bool(msg.get("index") == self._index)
        if event.endswith("ROUTE"):
            return self._index is None or bool(msg.get("oif") in (self._index, None))
        if event.endswith("NETCONF"):
            index = msg.get("NETCONFA_IFINDEX")
            return self._index is None or bool(index in (self._index, None))
        return False

    async def _netlink(self) -> AsyncIPRoute:
        if self._ipr is None:
            self._ipr = _pyroute2().AsyncIPRoute()
        return self._ipr

    async def check_apply(self, apply: bool) -> bool:
        from pyroute2.netlink.exceptions import NetlinkError

        try:
            return await self._check_apply(apply)
        except NetlinkError as e:
            # the socket may be unusable after an error: a fresh one next time
            await self.cleanup()
            raise ResourceError(f"netlink: {e.args[1] if len(e.args) > 1 else e}") from None

    async def _check_apply(self, apply: bool) -> bool:
        from pyroute2.netlink.exceptions import NetlinkError

        ipr = await self._netlink()
        try:
            link = (await _collect(await ipr.link("get", ifname=self.name)))[0]
        except NetlinkError as e:
            if e.code == 19:
                self._index = None
                raise ResourceError(f"no network interface {self.name}") from None
            raise
        index = self._index = int(link["index"])
        up = bool(link["flags"] & IFF_UP)
        clean = True
        if self.state and up != (self.state == "up"):
            clean = False
            self.handle.changed("state", "up" if up else "down", self.state)
            if apply:
                await ipr.link("set", index=index, state=self.state)
                self.handle.logger.info("%s: link set %s", self.ident, self.state)
                up = self.state == "up"
        if self.ip_forward is not None:
            now = _read_forwarding(self.name)
            if now != self.ip_forward:
                clean = False
                self.handle.changed("ip_forward", now, self.ip_forward)
                if apply:
                    self._write_forwarding()
        if self.addrs is not None:
            clean = await self._addresses(ipr, index, apply) and clean
        if self.gateway:
            clean = await self._gateway(ipr, index, apply) and clean
        return clean

    def _write_forwarding(self) -> None:
        value = "1" if self.ip_forward else "0"
        try:
            with open(_forwarding_path(self.name), "w") as f:
                f.write(value)
        except OSError as e:
            raise os_error(f"cannot set forwarding on {self.name}", e) from None
        self.handle.logger.info("%s: ip_forward set to %s", self.ident, value)

    async def _addresses(self, ipr: AsyncIPRoute, index: int, apply: bool) -> bool:
        wanted = {ipaddress.ip_interface(a) for a in self.addrs or ()}
        found = [_address_of(a) for a in await _collect(await ipr.addr("dump", index=index))]
        have = {a for a in found if _managed(a, wanted)}
        if have == wanted:
            return True
        self.handle.changed("addrs", sorted(map(str, have)), sorted(map(str, wanted)))
        if apply:
            for addr in sorted(have - wanted, key=str):
                await ipr.addr(
                    "del", index=index, address=str(addr.ip), prefixlen=addr.network.prefixlen
                )
                self.handle.logger.info("%s: address %s removed", self.ident, addr)
            for addr in sorted(wanted - have, key=str):
                await ipr.addr(
                    "add", index=index, address=str(addr.ip), prefixlen=addr.network.prefixlen
                )
                self.handle.logger.info("%s: address %s added", self.ident, addr)
        return False

    async def _gateway(self, ipr: AsyncIPRoute, index: int, apply: bool) -> bool:
        gateway = ipaddress.ip_address(self.gateway)
        family = 2 if gateway.version == 4 else 10
        routes = await _collect(await ipr.route("dump", family=family))
        defaults = _default_routes(routes, index, family)
        ours = [r for r in defaults if r.get("gateway") == str(gateway)]
        if len(ours) == 1 and len(defaults) == 1:
            return True
        now = [r.get("gateway") for r in defaults]
        self.handle.changed("gateway", ", ".join(g or "?" for g in now) or None, str(gateway))
        if apply:
            for r in defaults:
                if r not in ours[:1]:
                    extra = {k: r.get(k) for k in ("gateway", "priority") if r.get(k) is not None}
                    dst = "0.0.0.0/0" if family == 2 else "::/0"
                    await ipr.route("del", dst=dst, oif=index, **extra)
            if not ours:
                dst = "0.0.0.0/0" if family == 2 else "::/0"
                try:
                    await ipr.route("replace", dst=dst, gateway=str(gateway), oif=index)
                except Exception as e:
                    why = e.args[1] if len(e.args) > 1 else e
                    raise ResourceError(f"default route via {gateway}: {why}") from None
            self.handle.logger.info("%s: default route via %s", self.ident, gateway)
        return False
