"""A private Docker engine for the docker kinds' tests: Debian's `dockerd` (package
docker.io, installed by scripts/setup) with its own data root, exec root, socket
and pid file under a temporary directory, the vfs storage driver (works on any
filesystem, no overlay mounts), and no bridge, iptables, masquerading or IP
forwarding (nothing of the host's network is touched; containers run with
`network: none`).

The one image the tests use is imported from a rootfs tarball built here from
the host's static busybox (package busybox-static): nothing is ever pulled
from a registry. Its command traps SIGTERM, so a `docker stop` ends it at once
(a PID 1 without a handler ignores SIGTERM and would wait out the timeout).

`dockerbed` is a session fixture: one engine for the test session, stopped by
its PID at the end (its containers and its containerd go with it) and its
directory removed.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import wait_for

DOCKERD = shutil.which("dockerd") or "/usr/sbin/dockerd"
BUSYBOX = Path("/bin/busybox")
#: the test image (imported from the busybox tarball)
IMAGE = "evergraph-test/busybox:1"
#: its command: PID 1 that ends on SIGTERM (see the module's docstring)
IMAGE_CMD = ["/bin/sh", "-c", "trap 'exit 0' TERM; while :; do sleep 1; done"]
#: the busybox applets the image links (sh, sleep and what the tests run in it)
APPLETS = ("sh", "sleep", "env", "cat", "echo", "true")


def needs_dockerd() -> pytest.MarkDecorator:
    why = []
    if not os.access(DOCKERD, os.X_OK):
        why.append("dockerd (docker.io)")
    if not BUSYBOX.exists():
        why.append("busybox-static")
    if os.geteuid() != 0:
        why.append("root")
    return pytest.mark.skipif(bool(why), reason=f"needs {', '.join(why)} (scripts/setup)")


def busybox_rootfs() -> bytes:
    """A tarball of a minimal root filesystem: static busybox and its applets."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d in ("bin", "dev", "proc", "sys", "etc", "tmp"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        tar.add(str(BUSYBOX), "bin/busybox")
        for applet in APPLETS:
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type, info.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(info)
    return buf.getvalue()


class DockerBed:
    """One private dockerd; `host` is its DOCKER_HOST."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.socket = base / "run" / "docker.sock"
        self.pidfile = base / "run" / "dockerd.pid"
        self.host = f"unix://{self.socket}"
        self.log = base / "dockerd.log"
        self.pid: int | None = None

    @property
    def env(self) -> dict[str, str]:
        """The environment of a process (an agent, the docker CLI) using this engine."""
        return dict(os.environ, DOCKER_HOST=self.host)

    def start(self) -> None:
        """Start dockerd, detached (`setsid -f`: not a child of the test process, so a
        test may restart it), and wait until it answers; its PID is `self.pid`."""
        for d in ("data", "exec", "run"):
            (self.base / d).mkdir(parents=True, exist_ok=True)
        self.pidfile.unlink(missing_ok=True)
        args = [
            "setsid", "-f", DOCKERD,
            "--data-root", str(self.base / "data"),
            "--exec-root", str(self.base / "exec"),
            "--pidfile", str(self.pidfile),
            "-H", self.host,
            "--storage-driver", "vfs",
            "--iptables=false", "--ip6tables=false",
            "--bridge=none", "--ip-masq=false",
            "--ip-forward=false",  # the host's net.ipv4.ip_forward is not ours to turn on
        ]  # fmt: skip
        with open(self.log, "ab") as log:
            subprocess.run(args, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=30)

        def up() -> bool:
            if self.pid is None:
                with contextlib.suppress(OSError, ValueError):
                    self.pid = int(self.pidfile.read_text())
            if self.pid is not None and not _alive(self.pid):
                raise AssertionError(f"dockerd exited: {self.tail()}")
            return self.pid is not None and self.cli("version", check=False).returncode == 0

        self.pid = None
        wait_for(up, timeout=60, what=f"dockerd to answer (log: {self.log})")

    @property
    def running(self) -> bool:
        return self.pid is not None and _alive(self.pid)

    def restart(self) -> None:
        """Stop dockerd (by its PID: its containers stop with it) and start it again."""
        self.stop_daemon()
        self.start()

    def stop_daemon(self) -> None:
        """SIGTERM to dockerd by its PID, then wait for it to end (SIGKILL after 60 s)."""
        pid, self.pid = self.pid, None
        if pid is None or not _alive(pid):
            return
        os.kill(pid, signal.SIGTERM)
        try:
            wait_for(lambda: not _alive(pid), timeout=60, what="dockerd to stop")
        except AssertionError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            wait_for(lambda: not _alive(pid), timeout=30, what="dockerd to die")

    def tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-2000:]
        return ""

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """`docker -H <ours> ARGS` (the out-of-band hand in the tests)."""
        r = subprocess.run(
            ["docker", "-H", self.host, *args], capture_output=True, text=True, timeout=120
        )
        if check and r.returncode != 0:
            raise AssertionError(f"docker {' '.join(args)}: {r.stderr.strip()}")
        return r

    def import_image(self, ref: str = IMAGE) -> None:
        """Import the busybox rootfs as `ref` (a local tarball, never a registry)."""
        tarball = self.base / "busybox-rootfs.tar"
        if not tarball.exists():
            tarball.write_bytes(busybox_rootfs())
        self.cli("import", "-c", f"CMD {json.dumps(IMAGE_CMD)}", str(tarball), ref)

    def state(self, name: str) -> str | None:
        """A container's status (`running`, `exited`, `created`...); None: no such one."""
        r = self.cli("inspect", "-f", "{{.State.Status}}", name, check=False)
        return r.stdout.strip() if r.returncode == 0 else None

    def remove_all(self) -> None:
        ids = self.cli("ps", "-aq").stdout.split()
        if ids:
            self.cli("rm", "-f", *ids)


@contextlib.contextmanager
def docker_engine(prefix: str = "evergraph-docker-") -> Iterator[DockerBed]:
    """A private dockerd with the kit's image, stopped and removed at the end."""
    base = Path(tempfile.mkdtemp(prefix=prefix))
    bed = DockerBed(base)
    try:
        bed.start()
        bed.import_image()
        yield bed
    finally:
        with contextlib.suppress(Exception):
            if bed.running:
                bed.remove_all()
        bed.stop_daemon()
        _unmount_under(base)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def dockerbed() -> Iterator[DockerBed]:
    with docker_engine() as bed:
        yield bed


@pytest.fixture
def docker(dockerbed: DockerBed) -> Iterator[DockerBed]:
    """The session's engine, its containers removed after the test (images kept)."""
    if not dockerbed.running:
        dockerbed.start()  # a test stopped it
    yield dockerbed
    if not dockerbed.running:
        dockerbed.start()
    dockerbed.remove_all()


def _unmount_under(base: Path) -> None:
    """Mounts dockerd left under `base` (it unmounts them itself when it stops cleanly)."""
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for point in sorted((p for p in points if p.startswith(f"{base}/")), reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, timeout=30)


def _alive(pid: int) -> bool:
    """`pid` runs (not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
