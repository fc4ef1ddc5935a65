"""What the initiator ships to a host that has nothing of evergraph: a bundle.

Issue 26, "nothing to install": the first contact copies evergraph and every
distribution it requires (as installed here) into a content-addressed store on
the host; a later run with the same version sends only the bundle's hash.

Three pieces, all local and pure so they are tested without SSH:

- `Bundle.of_running_python()`: the files to ship (each with path under `site/`,
  mode, sha256, size) and a manifest whose sha256 is the bundle's `digest`.
- `REMOTE_SCRIPT`: stdlib-only Python run on the host (`python3 -I -c`); it
  keeps the store (``objects/<sha[:2]>/<sha>``, ``bundles/<digest[:16]>/``)
  and answers ``probe``, ``missing`` and ``store`` (see the script).
- `install`: the conversation, over any ``run(argv, stdin) -> stdout`` the
  caller provides (an SSH channel in `remote`, a subprocess in the tests).

Compiled extension modules travel as they are, which is why the host must run
the same Python minor version on the same machine architecture
(`python_problem` says so in one line when it does not).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import io
import os
import platform
import re
import stat
import sys
import tarfile
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

#: the distribution whose requirements are shipped (normalised name)
ROOT_DIST = "evergraph"
#: where a host keeps its stores (one per initiator user would be a later choice)
DEFAULT_STORE = "/var/lib/evergraph/remote"
#: hex digits of the digest that name a bundle's directory
DIR_DIGITS = 16

#: dist-info files that describe this installation, not the package
_LOCAL_RECORDS = frozenset({"RECORD", "INSTALLER", "direct_url.json", "REQUESTED"})


class BundleError(Exception):
    """The running environment cannot be bundled, or a host refused a bundle."""


class FileEntry(msgspec.Struct, frozen=True, array_like=True):
    """One file of the bundle: its place under ``site/``, mode, content hash, size."""

    path: str
    mode: int
    sha256: str
    size: int


class Manifest(msgspec.Struct, frozen=True):
    """What a bundle holds; its canonical JSON's sha256 is the bundle's digest."""

    python: str
    machine: str
    dists: list[tuple[str, str]]
    files: list[FileEntry]


@dataclass(frozen=True)
class Bundle:
    """A manifest and where each of its objects is read from on this machine."""

    manifest: Manifest
    #: sha256 -> a local file with that content
    sources: Mapping[str, Path]

    @property
    def manifest_bytes(self) -> bytes:
        """The canonical JSON the digest is taken of (sorted; no whitespace)."""
        return msgspec.json.encode(self.manifest)

    @property
    def digest(self) -> str:
        """sha256 (hex) of the manifest: names the bundle on every host."""
        return hashlib.sha256(self.manifest_bytes).hexdigest()

    @property
    def dir_name(self) -> str:
        """The bundle's directory under ``bundles/`` in a store."""
        return self.digest[:DIR_DIGITS]

    @property
    def size(self) -> int:
        """Bytes of content in the bundle (each distinct object once)."""
        return sum({f.sha256: f.size for f in self.manifest.files}.values())

    @classmethod
    def of_running_python(cls, programs: Mapping[str, Path] | None = None) -> Bundle:
        """The evergraph package that is running and every distribution it needs;
        `programs` (name -> local file) go to the bundle's ``bin/`` (etcd, for
        hosts that will run an embedded World)."""
        paths, dists = collect_files()
        for name, local in (programs or {}).items():
            paths[f"bin/{name}"] = local
        return cls.of_paths((paths, dists))

    @classmethod
    def of_paths(
        cls,
        files: tuple[Mapping[str, Path], list[tuple[str, str]]],
        *,
        python: str | None = None,
        machine: str | None = None,
    ) -> Bundle:
        """A bundle of ``site/``-relative paths -> local files, and (dist, version)s."""
        paths, dists = files
        entries: list[FileEntry] = []
        sources: dict[str, Path] = {}
        for rel in sorted(paths):
            local = paths[rel]
            sha, size = _hash_file(local)
            entries.append(FileEntry(rel, _mode(local), sha, size))
            sources.setdefault(sha, local)
        manifest = Manifest(
            python=python or running_python(),
            machine=machine or platform.machine(),
            dists=sorted(dists),
            files=entries,
        )
        return cls(manifest, sources)


def running_python() -> str:
    """``major.minor`` of this interpreter: what a host must run."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def python_problem(
    remote_version: str, remote_machine: str, *, host: str = "the host"
) -> str | None:
    """None when a host's Python can run this bundle, else one line saying what to do."""
    here_version, here_machine = running_python(), platform.machine()
    if remote_version == here_version and remote_machine == here_machine:
        return None
    wanted = f"python{here_version} on {here_machine}"
    todo = (
        f"install python{here_version} on {host}"
        if remote_machine == here_machine
        else f"run evergraph remote from a {remote_machine} machine with python{remote_version}"
    )
    return (
        f"{host} has python {remote_version} on {remote_machine}, this evergraph needs "
        f"{wanted} (its bundle carries compiled modules): {todo}"
    )


# --- what to ship ---------------------------------------------------------------


def collect_files() -> tuple[dict[str, Path], list[tuple[str, str]]]:
    """Every file to ship (``site/``-relative path -> local file) and the dists shipped.

    evergraph itself is taken from the package directory that is running (an
    editable install's distribution lists no package files); each dependency from
    its distribution's installed file list.
    """
    root = importlib.metadata.distribution(ROOT_DIST)
    files: dict[str, Path] = {}
    package_dir = Path(__file__).resolve().parent.parent  # .../evergraph
    for local in _walk(package_dir):
        files["site/" + local.relative_to(package_dir.parent).as_posix()] = local
    # its METADATA, so that importlib.metadata.version("evergraph") works there too
    meta = root.locate_file(f"{_dist_info_name(root)}/METADATA")
    if Path(str(meta)).is_file():
        files[f"site/{_dist_info_name(root)}/METADATA"] = Path(str(meta))
    dists = [(ROOT_DIST, root.version)]
    for dist in required_dists(root):
        dists.append((_normalise(dist.metadata["Name"]), dist.version))
        for rel, local in _dist_files(dist):
            files.setdefault("site/" + rel, local)
    return files, dists


def required_dists(root: importlib.metadata.Distribution) -> list[importlib.metadata.Distribution]:
    """Installed distributions ``root`` requires, transitively (extras it asks for only)."""
    seen: dict[str, importlib.metadata.Distribution] = {}
    todo: list[tuple[importlib.metadata.Distribution, frozenset[str]]] = [(root, frozenset())]
    asked: set[tuple[str, frozenset[str]]] = set()
    while todo:
        dist, extras = todo.pop()
        for line in dist.requires or ():
            need = _requirement(line, extras)
            if need is None:
                continue
            name, its_extras = need
            if (name, its_extras) in asked:
                continue
            asked.add((name, its_extras))
            try:
                found = seen.get(name) or importlib.metadata.distribution(name)
            except importlib.metadata.PackageNotFoundError:
                raise BundleError(
                    f"{_normalise(dist.metadata['Name'])} requires {name!r}, which is not "
                    "installed here: reinstall evergraph's dependencies (pip install evergraph)"
                ) from None
            seen[name] = found
            todo.append((found, its_extras))
    return [seen[name] for name in sorted(seen)]


def _requirement(line: str, extras: frozenset[str]) -> tuple[str, frozenset[str]] | None:
    """(name, extras) a requirement line asks for here, or None if its marker is false."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pragma: no cover - packaging is everywhere pip is
        # without packaging: take what has no marker, skip what is conditional
        if ";" in line:
            return None
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", line)
        return (_normalise(match.group(1)), frozenset()) if match else None
    req = Requirement(line)
    if req.marker is not None and not any(
        req.marker.evaluate({"extra": extra}) for extra in (extras or {""})
    ):
        return None
    return _normalise(req.name), frozenset(req.extras)


def _dist_files(dist: importlib.metadata.Distribution) -> Iterable[tuple[str, Path]]:
    """A distribution's installed files under site-packages, minus local records."""
    for ref in dist.files or ():
        parts = ref.parts
        if not parts or parts[0] == ".." or os.path.isabs(str(ref)):
            continue  # entry-point scripts and data outside site-packages
        if "__pycache__" in parts or ref.name.endswith(".pyc"):
            continue
        if ref.name in _LOCAL_RECORDS and parts[0].endswith(".dist-info"):
            continue
        local = Path(str(dist.locate_file(ref)))
        if local.is_file():
            yield ref.as_posix(), local


def _walk(top: Path) -> Iterable[Path]:
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if not name.endswith((".pyc", ".pyo")):
                yield Path(dirpath) / name


def _dist_info_name(dist: importlib.metadata.Distribution) -> str:
    name = dist.metadata["Name"].replace("-", "_")
    return f"{name}-{dist.version}.dist-info"


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _mode(path: Path) -> int:
    # only the executable bit travels: owner and umask are the host's business
    return 0o755 if path.stat().st_mode & stat.S_IXUSR else 0o644


def _hash_file(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


# --- what to send ---------------------------------------------------------------


def plan(bundle: Bundle, missing: Iterable[str]) -> bytes:
    """An uncompressed tar of the missing objects, each named by its sha256.

    Uncompressed because time beats bytes on the links this is for: measured on
    this project's bundle (1,665 objects, 60 MB, a loaded 2-core machine), the
    plain tar is built in 0.9-1.5 s, gzip level 1 takes 4.3-6.2 s for 23 MB; that
    CPU is spent per first contact on the initiator, and a LAN moves the 38 MB
    saved in well under that (SSH can still compress if the operator asks).
    `tests/remote/test_bundle.py` prints both (``-s``).
    """
    return _tar(bundle, missing, compress=False)


def _tar(bundle: Bundle, missing: Iterable[str], *, compress: bool) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for sha in sorted(set(missing)):
            source = bundle.sources.get(sha)
            if source is None:
                raise BundleError(f"the host asked for object {sha}, which is not in this bundle")
            info = tarfile.TarInfo(sha)
            info.size = source.stat().st_size
            info.mode = 0o644
            with source.open("rb") as f:
                tar.addfile(info, f)
    return gzip.compress(out.getvalue(), compresslevel=1) if compress else out.getvalue()


# --- the conversation ------------------------------------------------------------

#: run ``python3 <argv...>`` on the host with ``stdin``; return its stdout, raise on failure
Run = Callable[[Sequence[str], bytes], Awaitable[bytes]]


@dataclass(frozen=True)
class Installed:
    """Where a bundle lives on a host, and what it took to put it there."""

    site: str
    #: bytes written to the host (argv, manifest, objects)
    sent: int
    #: objects the host did not have
    objects: int


async def install(
    bundle: Bundle, run: Run, *, store: str = DEFAULT_STORE, host: str = "the host"
) -> Installed:
    """Make sure ``bundle`` is materialised in ``store`` on a host; send only what it lacks."""
    sent = 0

    async def call(argv: Sequence[str], stdin: bytes = b"") -> bytes:
        nonlocal sent
        full = ["-I", "-c", REMOTE_SCRIPT, *argv]
        sent += sum(len(a) + 1 for a in full) + len(stdin)
        return await run(full, stdin)

    site = f"{store}/bundles/{bundle.dir_name}/site"
    probe = msgspec.json.decode(await call(["probe", store, bundle.digest]), type=_Probe)
    problem = python_problem(probe.python, probe.machine, host=host)
    if problem is not None:
        raise BundleError(problem)
    if probe.present:
        return Installed(site, sent, 0)
    missing = (
        (await call(["missing", store, bundle.digest], bundle.manifest_bytes)).decode().split()
    )
    await call(["store", store, bundle.digest], plan(bundle, missing))
    return Installed(site, sent, len(missing))


class _Probe(msgspec.Struct, frozen=True):
    python: str
    machine: str
    present: bool


#: The host's half, stdlib only and valid on old Pythons (it must run far enough
#: to say which version it found). ``python3 -I -c REMOTE_SCRIPT OP STORE DIGEST``:
#:   probe   -> {"python", "machine", "present"} as JSON
#:   missing -> stdin: the manifest (kept as manifests/DIGEST.json when its hash is
#:              DIGEST); stdout: the sha256 of each object the store lacks, one a line
#:   store   -> stdin: a tar of objects named by their sha256; each is verified and
#:              kept, then bundles/DIGEST[:16]/ is built beside and renamed into place
REMOTE_SCRIPT = r"""
import hashlib, json, os, platform, re, shutil, sys, tarfile
op, store, digest = sys.argv[1:4]
HEX = re.compile(r"[0-9a-f]{64}\Z")
if not HEX.match(digest):
    sys.exit("bad digest: " + digest)
bundle = os.path.join(store, "bundles", digest[:16])
kept = os.path.join(store, "manifests", digest + ".json")
def obj(sha):
    return os.path.join(store, "objects", sha[:2], sha)
def fail(msg):
    sys.stderr.write(msg + "\n")
    sys.exit(3)
def put(path, data_iter, want):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = "%s.tmp%d" % (path, os.getpid())
    h = hashlib.sha256()
    with open(tmp, "wb") as f:
        for chunk in data_iter:
            h.update(chunk)
            f.write(chunk)
    if h.hexdigest() != want:
        os.unlink(tmp)
        fail("object %s: its content hashes to %s, refused" % (want, h.hexdigest()))
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
def chunks(f):
    while True:
        b = f.read(1 << 20)
        if not b:
            return
        yield b
if op == "probe":
    v = sys.version_info
    print(json.dumps({"python": "%d.%d" % (v[0], v[1]), "machine": platform.machine(),
                      "present": os.path.isfile(os.path.join(bundle, "manifest.json"))}))
elif op == "missing":
    data = sys.stdin.buffer.read()
    put(kept, [data], digest)
    files = json.loads(data.decode())["files"]
    need = sorted(set(f[2] for f in files if not os.path.isfile(obj(f[2]))))
    sys.stdout.write("".join(s + "\n" for s in need))
elif op == "store":
    if not os.path.isfile(kept):
        fail("no manifest %s in %s: run missing first" % (digest, store))
    with tarfile.open(fileobj=sys.stdin.buffer, mode="r|*") as tar:
        for m in tar:
            if not (m.isreg() and HEX.match(m.name)):
                fail("refused tar member %r: only objects named by their sha256" % m.name)
            put(obj(m.name), chunks(tar.extractfile(m)), m.name)
    with open(kept, "rb") as f:
        raw = f.read()
    files = json.loads(raw.decode())["files"]
    if os.path.isdir(bundle):
        sys.exit(0)
    tmp = "%s.tmp%d" % (bundle, os.getpid())
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for path, mode, sha, size in files:
        parts = path.split("/")
        if path.startswith("/") or ".." in parts or parts[0] not in ("site", "bin"):
            fail("refused path %r in the manifest" % path)
        src, dst = obj(sha), os.path.join(tmp, *parts)
        if not os.path.isfile(src):
            fail("object %s for %s is missing from %s" % (sha, path, store))
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if mode & 0o111:
            shutil.copyfile(src, dst)
            os.chmod(dst, 0o755)
        else:
            os.link(src, dst)
    with open(os.path.join(tmp, "manifest.json"), "wb") as f:
        f.write(raw)
    try:
        os.rename(tmp, bundle)
    except OSError:
        if not os.path.isfile(os.path.join(bundle, "manifest.json")):
            raise
        shutil.rmtree(tmp)
else:
    sys.exit("unknown op: " + op)
"""
