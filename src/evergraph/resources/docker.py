"""docker:container and docker:image: containers and images of a Docker engine.

mgmt's kinds, with its parameters and YAML names, through the Docker Engine API
(the engine at `DOCKER_HOST`, else the local socket; `_docker.py`). Every docker
resource of an agent shares one client and one event stream per engine.

docker:container (the name is the container's):
- `state: running` (the default) creates the container if there is none and
  starts it (a paused one is unpaused); `stopped` creates it if need be and stops
  it; `removed` stops and removes it.
- `image`, `cmd`, `env`, `ports` (and evergraph's `network`) are what the container
  is created with. A container that exists with another image or definition is
  an error naming the field, unless `force: true`: then it is removed and created
  anew (mgmt compares the image only; evergraph all of them). A missing image is
  pulled (mgmt does the same) unless a `docker:image` of the graph provides it
  (an automatic edge orders the two).
- `ports`: mgmt's `{proto: {container port: host port}}`, bound on 0.0.0.0.
- The watch follows the engine's events for the container (`docker stop`,
  `docker rm -f` out of band are repaired) and the engine's restarts.
- `meta: {reverse: true}`: a container the graph created is removed when the
  resource leaves the graph; one that existed is put back to its state.

docker:image (the name is the image, `name[:tag]`, `:latest` if no tag):
- `state: exists` (the default) pulls it if missing, or with evergraph's `source`
  (a tarball on this host) loads it from there instead: `docker save` output is
  loaded, a root filesystem tarball is imported (no registry needed); `absent`
  removes it.
- The watch follows the engine's image events.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import tarfile
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Annotated, Any, Literal

from evergraph.engine.contract import Handle, Resource, doc, register
from evergraph.errors import ResourceError
from evergraph.resources._docker import CALL_TIMEOUT, DockerEngines, Engine

if TYPE_CHECKING:
    import docker

#: Docker's rule for a container name
_CONTAINER_NAME = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]+")
#: mgmt's rule for `apiversion`
_API_VERSION = re.compile(r"v[1-9]\.[0-9]\d*")
#: a reference: [registry[:port]/]path[:tag][@digest], lower-case path components
_IMAGE_REF = re.compile(
    r"(?:[a-zA-Z0-9.-]+(?::[0-9]+)?/)?[a-z0-9]+(?:[._-]+[a-z0-9]+)*"
    r"(?:/[a-z0-9]+(?:[._-]+[a-z0-9]+)*)*(?::[\w][\w.-]{0,127})?(?:@[a-z0-9]+:[a-f0-9]{32,})?"
)
_ENV = re.compile(r"[^=\s]+=\S*")
_PROTOCOLS = ("tcp", "udp", "sctp")
#: container statuses that count as stopped
_STOPPED = ("created", "exited", "dead")
#: the longest `stoptimeout`, seconds (an hour)
MAX_STOP = 3600
#: the label on a container the graph created (which resource made it)
LABEL = "evergraph.resource"


def image_ref(image: str) -> str:
    """`image` with `:latest` when it names no tag or digest (mgmt: the same)."""
    last = image.rpartition("/")[2]
    return image if ":" in last or "@" in last else f"{image}:latest"


def _api(version: str) -> str:
    return version.removeprefix("v")


class _Docker(Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
    """What both docker kinds share: the engine, its events, `apiversion`."""

    apiversion: Annotated[
        str, doc("the Engine API version to speak, `vX.Y`; empty: what the engine offers")
    ] = ""

    def _check_apiversion(self) -> None:
        if self.apiversion and not _API_VERSION.fullmatch(self.apiversion):
            raise self.bad("apiversion", f"{self.apiversion!r} is not `vX.Y` (e.g. v1.41)")

    async def init(self, handle: Handle) -> None:
        await super().init(handle)
        self._engine: Engine = handle.services.get(DockerEngines).engine(_api(self.apiversion))

    def _concerns(self, event: dict[str, Any]) -> bool:
        raise NotImplementedError

    async def watch(self) -> None:
        handle = self.handle

        def listen(event: dict[str, Any] | None) -> None:
            # None: the stream (re)connected, anything may have changed unseen
            if event is None or self._concerns(event):
                handle.event()

        unsubscribe = self._engine.subscribe(listen)
        try:
            # ready at once: what changes before the stream is open is covered by the
            # look again that its opening brings (an engine down at start is then the
            # checks' clear failure, repaired when it answers)
            handle.ready()
            await asyncio.Future()  # until cancelled; the stream reconnects by itself
        finally:
            unsubscribe()

    async def _call(self, what: str, fn: Callable[[docker.DockerClient], Any]) -> Any:
        return await self._engine.call(what, fn)


@register("docker:container")
class DockerContainer(_Docker, kw_only=True, dict=True, forbid_unknown_fields=True):
    """A container of the Docker engine (the name is the container's)."""

    state: Annotated[
        Literal["running", "stopped", "removed"],
        doc("`running`, `stopped` (created, not running) or `removed`"),
    ] = "running"
    image: Annotated[str, doc("the image it runs, `name[:tag]` (`:latest` if no tag)")] = ""
    cmd: Annotated[list[str], doc("the command (the image's own if empty)")] = []
    env: Annotated[list[str], doc("environment variables, `VAR=value` each")] = []
    ports: Annotated[
        dict[str, dict[int, int]],
        doc("published ports: `{tcp: {80: 8080}}` (protocol: container port: host port)"),
    ] = {}
    force: Annotated[
        bool, doc("a container with another image or definition is replaced (else an error)")
    ] = False
    network: Annotated[
        str, doc("evergraph: the network it joins (`none`, `host`, a name); empty: the default")
    ] = ""
    stoptimeout: Annotated[
        int, doc("evergraph: seconds a stop waits for the container before killing it")
    ] = 10

    def validate(self) -> None:
        if not _CONTAINER_NAME.fullmatch(self.name):
            raise self.bad(
                "name", f"{self.name!r} is not a container name ([a-zA-Z0-9][a-zA-Z0-9_.-]+)"
            )
        if not self.image:
            raise self.bad("image", "an image is needed (`name[:tag]`)")
        if not _IMAGE_REF.fullmatch(self.image):
            raise self.bad("image", f"{self.image!r} is not an image reference (name[:tag])")
        for var in self.env:
            if not _ENV.fullmatch(var):
                raise self.bad("env", f"{var!r} is not `VAR=value` (no spaces)")
        for proto, ports in self.ports.items():
            if proto not in _PROTOCOLS:
                raise self.bad("ports", f"{proto!r} is not tcp, udp or sctp")
            for inner, outer in ports.items():
                if not (1 <= inner <= 65535 and 1 <= outer <= 65535):
                    raise self.bad("ports", f"{inner}: {outer}: ports are 1 to 65535")
        if not 0 <= self.stoptimeout <= MAX_STOP:
            raise self.bad(
                "stoptimeout", f"must be 0 to {MAX_STOP} seconds, not {self.stoptimeout}"
            )
        self._check_apiversion()

    def claims(self) -> list[str]:
        return [f"docker:container:{self.name}"]

    def autoedge_wants(self) -> list[list[str]]:
        # the image first (as mgmt's autoedge), unless the container is to go
        return [] if self.state == "removed" else [[f"docker:image:{image_ref(self.image)}"]]

    def _concerns(self, event: dict[str, Any]) -> bool:
        if event.get("Type") != "container":
            return False
        attributes = (event.get("Actor") or {}).get("Attributes") or {}
        return bool(attributes.get("name") == self.name)

    # -- the container as it is -------------------------------------------------------
    def _find(self, client: docker.DockerClient) -> dict[str, Any] | None:
        """The container's inspection (by exact name), None if there is none."""
        import docker

        found = client.api.containers(all=True, filters={"name": f"^/{re.escape(self.name)}$"})
        if not found:
            return None
        cid = found[0]["Id"]
        try:
            seen = dict(client.api.inspect_container(cid))
            if (seen.get("State") or {}).get("Status") == "removing":
                # `docker rm` under way (the list may not show it yet): wait it out
                client.api.wait(cid, timeout=int(CALL_TIMEOUT), condition="removed")
                return None
        except docker.errors.NotFound:
            return None  # removed in between
        return seen

    async def _inspect(self) -> dict[str, Any] | None:
        found: dict[str, Any] | None = await self._call("inspect", lambda c: self._find(c))
        return found

    @staticmethod
    def _status(found: dict[str, Any] | None) -> str:
        if found is None:
            return "removed"
        state = found.get("State") or {}
        if state.get("Paused"):
            return "paused"
        return "running" if state.get("Running") else "stopped"

    def _differences(self, found: dict[str, Any]) -> list[tuple[str, object, object]]:
        """(field, found, wanted) for what differs from what it was created with."""
        config = found.get("Config") or {}
        host = found.get("HostConfig") or {}
        out: list[tuple[str, object, object]] = []
        if image_ref(str(config.get("Image", ""))) != image_ref(self.image):
            out.append(("image", config.get("Image"), self.image))
        if self.cmd and list(config.get("Cmd") or []) != self.cmd:
            out.append(("cmd", config.get("Cmd"), self.cmd))
        have_env = config.get("Env") or []
        if any(v not in have_env for v in self.env):  # (the image's own come on top)
            out.append(("env", have_env, self.env))
        have_ports = _bindings(host.get("PortBindings") or {})
        if have_ports != _wanted_ports(self.ports):
            out.append(("ports", have_ports, _wanted_ports(self.ports)))
        if self.network and host.get("NetworkMode") != self.network:
            out.append(("network", host.get("NetworkMode"), self.network))
        return out

    # -- check_apply ------------------------------------------------------------------
    async def check_apply(self, apply: bool) -> bool:
        found = await self._inspect()
        status = self._status(found)
        if self.state == "removed":
            if found is None:
                return True
            self.handle.changed("state", status, "removed")
            if apply:
                await self._remove(found)
            return False
        clean = True
        if found is not None and (diffs := self._differences(found)):
            if not self.force:
                field, have, want = diffs[0]
                raise ResourceError(
                    f"the container exists with {field} {have!r}, not "
                    f"{want!r}: remove it, or set `force: true` to replace it"
                )
            for field, have, want in diffs:
                self.handle.changed(field, have, want)
            clean = False
            if apply:
                await self._remove(found)
            found, status = None, "removed"
        if found is None:
            clean = False
            self.handle.changed("state", status, self.state)
            if not apply:
                return False
            await self._create()
            status = "stopped"
        if status == self.state:
            return clean
        if clean:
            self.handle.changed("state", status, self.state)
        if apply:
            if self.state == "stopped":
                await self._call(
                    "stop",
                    lambda c: c.api.stop(self.name, timeout=self.stoptimeout),
                )
                self.handle.logger.info("%s: stopped", self.ident)
            elif status == "paused":
                await self._call("unpause", lambda c: c.api.unpause(self.name))
                self.handle.logger.info("%s: unpaused", self.ident)
            else:
                await self._call("start", lambda c: c.api.start(self.name))
                self.handle.logger.info("%s: started", self.ident)
        return False

    async def _remove(self, found: dict[str, Any]) -> None:
        cid = str(found["Id"])
        if self._status(found) != "stopped":
            await self._call("stop", lambda c: c.api.stop(cid, timeout=self.stoptimeout))
        await self._call("remove", lambda c: _remove_container(c, cid))
        self.handle.logger.info("%s: removed", self.ident)

    async def _create(self) -> None:
        ref = image_ref(self.image)
        await self._call(f"image {ref}", lambda c: _have_image(c, ref))
        config = _create_kwargs(self)
        await self._call(
            "create",
            lambda c: c.api.create_container(
                ref,
                name=self.name,
                host_config=c.api.create_host_config(**config["host"]),
                **config["container"],
            ),
        )
        self.handle.logger.info("%s: created from %s", self.ident, ref)

    def reversal(self) -> DockerContainer | None:
        # called before the first apply: the container as found now
        try:
            found = self._engine.call_blocking("inspect", self._find)
        except ResourceError as e:
            self.handle.logger.warning("%s: cannot see it to reverse it later: %s", self.ident, e)
            return None
        status = self._status(found)
        state: Literal["running", "stopped", "removed"] = (
            "running" if status == "paused" else status  # type: ignore[assignment]
        )
        if state == self.state:
            return None
        config = (found or {}).get("Config") or {}
        return DockerContainer(
            name=self.name,
            state=state,
            image=str(config.get("Image") or self.image),
            network=self.network,
            stoptimeout=self.stoptimeout,
            apiversion=self.apiversion,
        )


def _bindings(bindings: dict[str, Any]) -> dict[str, dict[int, int]]:
    """The engine's `PortBindings` as mgmt's `ports` ({proto: {inner: outer}})."""
    out: dict[str, dict[int, int]] = {}
    for key, binds in bindings.items():
        inner, _, proto = key.partition("/")
        for b in binds or []:
            with contextlib.suppress(ValueError, TypeError):
                out.setdefault(proto or "tcp", {})[int(inner)] = int(b.get("HostPort"))
    return out


def _wanted_ports(ports: dict[str, dict[int, int]]) -> dict[str, dict[int, int]]:
    return {proto: dict(p) for proto, p in ports.items() if p}


def _create_kwargs(res: DockerContainer) -> dict[str, dict[str, Any]]:
    bindings = {
        f"{inner}/{proto}": ("0.0.0.0", outer)
        for proto, ports in res.ports.items()
        for inner, outer in ports.items()
    }
    host: dict[str, Any] = {"port_bindings": bindings}
    if res.network:
        host["network_mode"] = res.network
    container: dict[str, Any] = {
        "environment": list(res.env),
        "ports": [(inner, proto) for proto, ports in res.ports.items() for inner in ports],
        "labels": {LABEL: res.ident},
    }
    if res.cmd:
        container["command"] = list(res.cmd)
    return {"host": host, "container": container}


def _remove_container(client: docker.DockerClient, cid: str) -> None:
    import docker

    with contextlib.suppress(docker.errors.NotFound):  # gone meanwhile: fine
        client.api.remove_container(cid, force=True)


def _have_image(client: docker.DockerClient, ref: str) -> None:
    """The image is there, else pulled (as mgmt does)."""
    import docker

    try:
        client.images.get(ref)
        return
    except docker.errors.NotFound:
        pass
    name, _, tag = ref.rpartition(":")
    try:
        client.api.pull(name, tag=tag)
    except docker.errors.APIError as e:
        raise ResourceError(
            f"image {ref} is not here and cannot be pulled: {e.explanation or e}"
        ) from None


@register("docker:image")
class DockerImage(_Docker, kw_only=True, dict=True, forbid_unknown_fields=True):
    """An image of the Docker engine (the name: `name[:tag]`, `:latest` if no tag)."""

    state: Annotated[Literal["exists", "absent"], doc("`exists` or `absent`")] = "exists"
    source: Annotated[
        str,
        doc(
            "evergraph: a tarball to take it from instead of a registry (`docker save` "
            "output is loaded, a root filesystem imported)"
        ),
    ] = ""

    def validate(self) -> None:
        if not _IMAGE_REF.fullmatch(self.name):
            raise self.bad("name", f"{self.name!r} is not an image reference (name[:tag])")
        if self.source and not self.source.startswith("/"):
            raise self.bad("source", f"{self.source!r} is not an absolute path")
        self._check_apiversion()

    @property
    def ref(self) -> str:
        return image_ref(self.name)

    def claims(self) -> list[str]:
        return [f"docker:image:{self.ref}"]

    def autoedge_provides(self) -> list[str]:
        return [f"docker:image:{self.ref}"]

    def autoedge_wants(self) -> Iterable[Iterable[str]]:
        return [[f"path:{self.source}"]] if self.source else []

    def _concerns(self, event: dict[str, Any]) -> bool:
        return event.get("Type") == "image"

    async def _exists(self) -> bool:
        ref = self.ref

        def look(c: docker.DockerClient) -> bool:
            import docker

            try:
                c.images.get(ref)
            except docker.errors.NotFound:
                return False
            return True

        found: bool = await self._call("inspect", look)
        return found

    async def check_apply(self, apply: bool) -> bool:
        exists = await self._exists()
        if exists == (self.state == "exists"):
            return True
        self.handle.changed("state", "exists" if exists else "absent", self.state)
        if not apply:
            return False
        ref = self.ref
        if self.state == "absent":
            await self._call("remove", lambda c: c.api.remove_image(ref))
            self.handle.logger.info("%s: removed", self.ident)
        elif self.source:
            await self._call(f"load {self.source}", self._from_tarball)
            self.handle.logger.info("%s: taken from %s", self.ident, self.source)
        else:
            name, _, tag = ref.rpartition(":")
            await self._call("pull", lambda c: c.api.pull(name, tag=tag))
            self.handle.logger.info("%s: pulled", self.ident)
        return False

    def _from_tarball(self, client: docker.DockerClient) -> None:
        path = self.source
        try:
            with tarfile.open(path) as tar:
                saved = any(m.name == "manifest.json" for m in tar.getmembers())
        except (OSError, tarfile.TarError) as e:
            raise ResourceError(f"source {path}: {e}") from None
        if saved:  # `docker save` output: load it, then tag it as named
            with open(path, "rb") as f:
                images = client.images.load(f.read())
            if not images:
                raise ResourceError(f"{path} holds no image")
            name, _, tag = self.ref.rpartition(":")
            images[0].tag(name, tag)
        else:
            name, _, tag = self.ref.rpartition(":")
            client.api.import_image_from_file(path, repository=name, tag=tag)

    def reversal(self) -> DockerImage | None:
        try:
            exists = self._engine.call_blocking(
                "inspect", lambda c: bool(c.api.images(name=self.ref, quiet=True))
            )
        except ResourceError as e:
            self.handle.logger.warning("%s: cannot see it to reverse it later: %s", self.ident, e)
            return None
        state: Literal["exists", "absent"] = "exists" if exists else "absent"
        if state == self.state:
            return None
        return DockerImage(name=self.name, state=state, apiversion=self.apiversion)
