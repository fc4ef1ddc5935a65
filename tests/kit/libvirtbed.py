"""A real libvirtd for the virt tests, and a tiny guest for it to run.

Debian's libvirtd keeps its QEMU driver's state in fixed places (/run/libvirt,
/etc/libvirt/qemu, /var/lib/libvirt): one libvirtd per machine. The fixture
`libvirtbed` takes a machine-wide file lock for the test that uses it; it
reuses a libvirtd that already runs (one it did not start: it never stops that
one), else starts virtlogd (QEMU logs through its fixed socket) and libvirtd
with a private socket directory, as children whose pids it keeps, and stops
them by pid at the end. Every domain named with `PREFIX` is destroyed and
undefined at the end whoever made it.

The guest boots Debian's kernel directly (no disk) with a busybox initramfs:
128 MiB (64 MiB does not boot) under TCG (`<domain type='qemu'>`, no KVM). The
kernel is fetched once with `apt-get download` + `dpkg-deb -x` into a cache
directory (`EVERGRAPH_TEST_CACHE`, default /var/tmp/evergraph-tests), which
QEMU (user libvirt-qemu) must be able to read: hence not under /root.

libvirt probes KVM as libvirt-qemu; with /dev/kvm 600 root it re-probes QEMU's
capabilities on every domain start (+5 s each). The bed gives /dev/kvm group
kvm, 0660 (what Debian's udev rule does) while it runs and puts back what it
found at the end.
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import wait_for

#: the lock held while a libvirtd of the tests runs (one libvirtd per machine)
LOCK = os.path.join(tempfile.gettempdir(), "evergraph-tests-libvirtd.lock")
#: every test domain's name starts with this (the teardown removes them all)
PREFIX = "evgt-"
#: the guest's memory in KiB (64 MiB does not boot Debian's kernel)
GUEST_KIB = 131072
#: what the guest's /init prints on its serial console once up
GUEST_UP = "EVERGRAPH GUEST UP"

_INIT = f"""#!/bin/busybox sh
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sys /sys
echo "{GUEST_UP}"
while :; do /bin/busybox sleep 3600; done
"""


def cache_dir() -> Path:
    d = Path(os.environ.get("EVERGRAPH_TEST_CACHE", "/var/tmp/evergraph-tests")) / "virt"
    d.mkdir(parents=True, exist_ok=True)
    for p in (d.parent, d):  # QEMU runs as libvirt-qemu: it must get through
        p.chmod(0o755)
    return d


def _kernel_package() -> str:
    """The versioned package the `linux-image-amd64` metapackage depends on."""
    out = subprocess.run(
        ["apt-cache", "depends", "linux-image-amd64"], capture_output=True, text=True, check=True
    ).stdout
    for line in out.splitlines():
        dep = line.strip().removeprefix("Depends:").strip()
        if line.strip().startswith("Depends:") and dep.startswith("linux-image-"):
            return dep
    raise RuntimeError(f"no kernel package among linux-image-amd64's dependencies:\n{out}")


def guest_kernel() -> Path:
    """Debian's kernel (vmlinuz), fetched once into the cache."""
    kernel = cache_dir() / "vmlinuz"
    if kernel.exists():
        return kernel
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        subprocess.run(
            ["apt-get", "download", "-q", _kernel_package()],
            cwd=tmp,
            check=True,
            capture_output=True,
        )
        (deb,) = Path(tmp).glob("*.deb")
        subprocess.run(["dpkg-deb", "-x", str(deb), f"{tmp}/x"], check=True)
        (found,) = Path(tmp, "x", "boot").glob("vmlinuz-*")
        shutil.copyfile(found, f"{kernel}.part")
        os.chmod(f"{kernel}.part", 0o644)
        os.replace(f"{kernel}.part", kernel)
    return kernel


def guest_initrd() -> Path:
    """A busybox initramfs whose /init says GUEST_UP and idles (made once)."""
    initrd = cache_dir() / "initrd.gz"
    if initrd.exists():
        return initrd
    busybox = shutil.which("busybox")
    if busybox is None:
        raise RuntimeError("busybox (busybox-static) is not installed: scripts/setup does it")
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        root = Path(tmp, "root")
        for d in ("bin", "proc", "sys", "dev"):
            (root / d).mkdir(parents=True)
        shutil.copyfile(busybox, root / "bin" / "busybox")
        (root / "bin" / "busybox").chmod(0o755)
        (root / "bin" / "sh").symlink_to("busybox")
        (root / "init").write_text(_INIT)
        (root / "init").chmod(0o755)
        names = "\n".join(
            str(p.relative_to(root)) for p in sorted(root.rglob("*"), key=lambda p: str(p))
        )
        cpio = subprocess.run(
            [busybox, "cpio", "-o", "-H", "newc"],
            cwd=root,
            input=names.encode() + b"\n",
            capture_output=True,
            check=True,
        ).stdout
        Path(f"{initrd}.part").write_bytes(gzip.compress(cpio))
        os.chmod(f"{initrd}.part", 0o644)
        os.replace(f"{initrd}.part", initrd)
    return initrd


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for init to reap it is not)."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat_line.rpartition(")")[2].split()[0] != "Z"


def _read_pid(path: Path) -> int | None:
    try:
        pid = int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    return pid if _alive(pid) else None


def _stop(pid: int | None, proc: subprocess.Popen[bytes] | None = None) -> None:
    """terminate -> grace -> kill, by pid; `proc` (our child): reaped."""
    if proc is not None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        return
    if pid is None or not _alive(pid):
        return
    os.kill(pid, signal.SIGTERM)
    with contextlib.suppress(AssertionError):
        wait_for(lambda: not _alive(pid), 10, f"pid {pid} to end")
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not _alive(pid), 10, f"pid {pid} to end")


#: the system bus the bed's daemons are given: none. A test of the suite may start a
#: system dbus-daemon (tests/kinds/test_svc.py) and stop it while a bed runs; a
#: libvirtd connected to it then ends (GLib's bus connections exit on close: it
#: raises SIGTERM, and libvirtd stops cleanly, status 0, mid-test)
NO_SYSTEM_BUS = "unix:path=/nonexistent/evergraph-tests-no-system-bus"


def _spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    """A daemon in the foreground, our child: when it ends we reap it (a daemonised
    one ends as init's child, and an init that does not reap keeps a zombie)."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "DBUS_SYSTEM_BUS_ADDRESS": NO_SYSTEM_BUS},
            start_new_session=True,  # (a ^C to pytest is not for it: the teardown stops it)
        )  # fmt: skip


@dataclass
class LibvirtBed:
    """A running libvirtd: its URI, and (when the bed started it) its process."""

    root: Path
    uri: str
    kernel: Path
    initrd: Path
    #: the pid of the libvirtd the bed started (None: it reuses the machine's)
    pid: int | None = None
    virtlogd_pid: int | None = None
    _kvm: tuple[int, int] | None = field(default=None, repr=False)
    _libvirtd: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _virtlogd: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    #: the bed started libvirtd (and may kill and restart it)
    ours: bool = False

    def virsh(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(["virsh", "-q", "-c", self.uri, *args], capture_output=True, text=True)
        if check and r.returncode != 0:
            raise AssertionError(f"virsh {' '.join(args)}: exit {r.returncode}: {r.stderr}")
        return r

    def up(self) -> bool:
        return self.virsh("uri", check=False).returncode == 0

    def start_libvirtd(self) -> None:
        """Start (or, after `kill_libvirtd`, restart) the bed's libvirtd; wait for it.
        In the foreground, a child of the test process: it outlives the test that
        restarts it; `teardown` ends it by its pid and reaps it."""
        pidfile = self.root / "libvirtd.pid"
        conf = self.root / "libvirtd.conf"
        log = self.root / "libvirtd.out"
        proc = _spawn(["libvirtd", "-f", str(conf), "-p", str(pidfile)], log)
        self._libvirtd, self.pid = proc, proc.pid

        def answers() -> bool:
            if proc.poll() is not None:
                out = log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"libvirtd exited {proc.returncode}:\n{out}")
            return _read_pid(pidfile) == proc.pid and self.up()

        wait_for(answers, 60, "libvirtd to answer")

    def kill_libvirtd(self, sig: int = signal.SIGKILL) -> None:
        """Kill the bed's libvirtd by its pid (its guests live on); its end awaited."""
        proc = self._libvirtd
        assert proc is not None
        os.kill(proc.pid, sig)
        proc.wait(30)
        self._libvirtd, self.pid = None, None

    def domains(self) -> list[str]:
        out = self.virsh("list", "--all", "--name", check=False).stdout
        return [n for n in out.split() if n.startswith(PREFIX)]

    def state(self, name: str) -> str:
        """`virsh domstate`: running, paused, shut off; "" when there is no such domain."""
        r = self.virsh("domstate", name, check=False)
        return r.stdout.strip() if r.returncode == 0 else ""

    def persistent(self, name: str) -> bool:
        return "Persistent:     yes" in self.virsh("dominfo", name).stdout

    def dumpxml(self, name: str, inactive: bool = False) -> str:
        return self.virsh("dumpxml", *(["--inactive"] if inactive else []), name).stdout

    @contextlib.contextmanager
    def console(self, name: str) -> Iterator[Callable[[], None]]:
        """The running guest's serial console (its pty) held open from now on; yields
        `wait_up()`, which returns once the guest's /init has said GUEST_UP on it.
        Open it right after the start: QEMU drops what it writes while no one reads."""
        found = re.search(r"<console type='pty'[^>]*>\s*<source path='([^']+)'", self.dumpxml(name))
        assert found is not None, f"{name} has no pty console"
        fd = os.open(found.group(1), os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK)
        seen = bytearray()

        def heard() -> bool:
            with contextlib.suppress(BlockingIOError):
                seen.extend(os.read(fd, 65536))
            return GUEST_UP.encode() in seen

        try:
            yield lambda: wait_for(heard, 180, f"{name} to say {GUEST_UP!r} on its console")
        finally:
            os.close(fd)

    def remove_test_domains(self) -> None:
        for name in self.domains():
            self.virsh("destroy", name, check=False)
            self.virsh("undefine", name, check=False)

    # -- setup and teardown ------------------------------------------------------
    def _open_kvm(self) -> None:
        try:
            st = os.stat("/dev/kvm")
        except FileNotFoundError:
            return
        self._kvm = (st.st_gid, stat.S_IMODE(st.st_mode))
        with contextlib.suppress(KeyError, PermissionError):
            import grp

            os.chown("/dev/kvm", -1, grp.getgrnam("kvm").gr_gid)
            os.chmod("/dev/kvm", 0o660)

    def _restore_kvm(self) -> None:
        if self._kvm is not None:
            gid, mode = self._kvm
            with contextlib.suppress(OSError):
                os.chown("/dev/kvm", -1, gid)
                os.chmod("/dev/kvm", mode)

    def setup(self) -> None:
        run = self.root / "run"
        run.mkdir(parents=True, exist_ok=True)
        (self.root / "libvirtd.conf").write_text(
            f'unix_sock_dir = "{run}"\n'
            'unix_sock_group = "root"\n'
            'unix_sock_rw_perms = "0770"\n'
            'auth_unix_ro = "none"\n'
            'auth_unix_rw = "none"\n'
            'log_filters = "3:*"\n'
            f'log_outputs = "3:file:{self.root}/libvirtd.log"\n'
        )
        self._open_kvm()
        self.ours = True
        if not Path("/run/libvirt/virtlogd-sock").is_socket() or not _virtlogd_running():
            pidfile = self.root / "virtlogd.pid"
            proc = _spawn(["virtlogd", "-p", str(pidfile)], self.root / "virtlogd.out")
            self._virtlogd, self.virtlogd_pid = proc, proc.pid
            wait_for(lambda: _read_pid(pidfile) == proc.pid, 30, "virtlogd's pid file")
        self.start_libvirtd()

    def teardown(self) -> None:
        proc = self._libvirtd
        ended = None
        if proc is not None and proc.poll() is not None:  # not killed by a test: say how
            log = (self.root / "libvirtd.log").read_text(errors="replace")[-1500:]
            ended = f"the bed's libvirtd (pid {proc.pid}) ended by itself, status {proc.returncode}"
            print(f"{ended}; the end of its log:\n{log}", file=sys.stderr)
        try:
            if self.pid is not None and _alive(self.pid):
                self.remove_test_domains()
            _stop(self.pid, self._libvirtd)
            _stop(self.virtlogd_pid, self._virtlogd)
        finally:
            self._restore_kvm()
        if ended is not None:  # an error of the test's own (in the run's summary line)
            raise AssertionError(ended)


def _virtlogd_running() -> bool:
    r = subprocess.run(["pgrep", "-x", "virtlogd"], capture_output=True, text=True)
    return any(_alive(int(p)) for p in r.stdout.split())


def _foreign_libvirtd() -> str:
    """The pids of a libvirtd the bed did not start ("" when none runs)."""
    r = subprocess.run(["pgrep", "-x", "libvirtd"], capture_output=True, text=True)
    return " ".join(p for p in r.stdout.split() if _alive(int(p)))  # (not a zombie)


#: how long a test may wait for its turn at the machine's one libvirtd (LOCK):
#: every other test of this suite and of one more suite (or bench) beside it
LOCK_WAIT = 1800


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """pytest-timeout counts a libvirtbed test's wait for its turn: its time-out is
    its own (or the default) plus LOCK_WAIT."""
    for item in items:
        if "libvirtbed" in getattr(item, "fixturenames", ()):
            own = item.get_closest_marker("timeout")
            base = float(own.args[0]) if own is not None and own.args else 120.0
            item.add_marker(pytest.mark.timeout(base + LOCK_WAIT), append=False)


@contextlib.contextmanager
def libvirt_bed(
    make_root: Callable[[], Path], wait: Callable[[], None] = lambda: None
) -> Iterator[LibvirtBed]:
    """The machine's one test libvirtd, under LOCK (`wait()` is called first if
    another holds it): a private one started in `make_root()`, or the machine's
    own (reused, never stopped); what the tests made is removed at the end."""
    for tool in ("libvirtd", "virtlogd", "virsh"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} is not installed: run scripts/setup as root")
    with open(LOCK, "a") as lock:  # released when the file closes
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            wait()
            fcntl.flock(lock, fcntl.LOCK_EX)
        root = make_root()
        root.chmod(0o755)
        bed = LibvirtBed(root, f"qemu+unix:///system?socket={root}/run/libvirt-sock",
                         guest_kernel(), guest_initrd())  # fmt: skip
        if foreign := _foreign_libvirtd():  # the machine's own: reuse it, never stop it
            if not Path("/run/libvirt/libvirt-sock").is_socket():
                raise RuntimeError(f"a libvirtd runs (pid {foreign}) with its socket elsewhere")
            bed.uri = "qemu:///system"
            try:
                yield bed
            finally:
                bed.remove_test_domains()
            return
        try:
            bed.setup()
            bed.remove_test_domains()  # left by a run that was killed
            yield bed
        finally:
            bed.teardown()


@pytest.fixture
def libvirtbed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LibvirtBed]:
    """A libvirtd for one test, under a machine-wide lock: tests on several xdist
    workers take turns (a module-wide bed would keep the others waiting past their
    timeout), each starting its own (~1 s once QEMU's capabilities are cached)."""
    try:
        with libvirt_bed(lambda: tmp_path_factory.mktemp("libvirt")) as bed:
            yield bed
    except RuntimeError as e:
        pytest.fail(str(e))
