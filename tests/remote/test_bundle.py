"""The bundle a host gets on first contact, and the store that keeps it (issue 26).

No SSH here: each "host" is a temp directory and the host's half (REMOTE_SCRIPT)
runs as a real subprocess of this interpreter, exactly as it will over a channel.
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import importlib.util
import io
import os
import platform
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest

from evergraph.remote import bundle as bundle_mod
from evergraph.remote.bundle import (
    AGENT_LEAVES_OUT,
    COMPRESS_LEVEL,
    REMOTE_SCRIPT,
    Bundle,
    BundleError,
    HashCache,
    Installed,
    Stdin,
    cache_path,
    collect_files,
    install,
    plan,
    python_problem,
    running_python,
)
from evergraph.world.etcd_server import EtcdServer


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class HostFailed(Exception):
    """The host's half exited non-zero (its stderr is the message)."""


async def run_here(argv: Sequence[str], stdin: Stdin) -> bytes:
    """The `Run` of the tests: ``python3 argv`` as a local subprocess."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    if isinstance(stdin, bytes):
        out, err = await proc.communicate(stdin)
    else:
        assert proc.stdin is not None
        assert proc.stdout is not None
        assert proc.stderr is not None
        to_host = proc.stdin

        async def feed() -> None:
            async for chunk in stdin:
                to_host.write(chunk)
                await to_host.drain()
            to_host.close()

        _, out, err = await asyncio.gather(feed(), proc.stdout.read(), proc.stderr.read())
        await proc.wait()
    if proc.returncode != 0:
        raise HostFailed(err.decode().strip())
    return out


def host_op(
    op: str, store: Path, digest: str, stdin: bytes = b""
) -> subprocess.CompletedProcess[bytes]:
    """One call of the host's half, for the tests that talk to it directly."""
    return subprocess.run(
        [sys.executable, "-I", "-c", REMOTE_SCRIPT, op, str(store), digest],
        input=stdin,
        capture_output=True,
        check=False,
    )


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Bundle:
    # its own hash cache: the tests leave the user's ~/.cache alone
    return Bundle.of_running_python(cache=tmp_path_factory.mktemp("cache") / "hashes.json")


def small_bundle(root: Path, files: dict[str, bytes], executable: Sequence[str] = ()) -> Bundle:
    """A bundle of a few made-up files (the store's tests need no 60 MB)."""
    paths: dict[str, Path] = {}
    for rel, content in files.items():
        local = root / rel.replace("/", "__")
        local.write_bytes(content)
        local.chmod(0o755 if rel in executable else 0o644)
        paths[rel] = local
    return Bundle.of_paths((paths, [("demo", "1.0")]))


def test_the_running_bundle_holds_evergraph_and_its_dependencies(running: Bundle) -> None:
    paths = {f.path for f in running.manifest.files}
    assert "site/evergraph/__init__.py" in paths
    assert "site/evergraph/remote/bundle.py" in paths
    assert "site/msgspec/__init__.py" in paths
    assert any(p.startswith("site/msgspec-") and p.endswith(".dist-info/METADATA") for p in paths)
    dists = dict(running.manifest.dists)
    assert {"evergraph", "msgspec", "click", "pynacl", "cffi"} <= set(dists)  # cffi: pynacl's
    assert "pytest" not in dists  # a dev extra, never shipped
    assert (
        running.manifest.python
        == running_python()
        == f"{sys.version_info[0]}.{sys.version_info[1]}"
    )
    assert running.manifest.machine == platform.machine()
    files = {f.path: f for f in running.manifest.files}
    for f in running.manifest.files:
        # bytecode: ours (`precompile`), one per .py, never the installation's own
        if "__pycache__" in f.path or f.path.endswith(".pyc"):
            head, _, name = f.path.rpartition("/__pycache__/")
            stem, tag, ext = name.rsplit(".", 2)
            assert (tag, ext) == (sys.implementation.cache_tag, "pyc"), f.path
            assert f"{head}/{stem}.py" in files, f.path
            data = running.sources[f.sha256].read_bytes()
            assert data[:4] == importlib.util.MAGIC_NUMBER
            assert int.from_bytes(data[4:8], "little") == 0b11, f.path  # checked hash
        assert not f.path.endswith(("/RECORD", "/INSTALLER", "/direct_url.json")), f.path
        assert f.mode in (0o644, 0o755)
        assert len(f.sha256) == 64
        assert f.size >= 0
    assert [f.path for f in running.manifest.files] == sorted(paths)
    sources = [p for p in paths if p.startswith("site/") and p.endswith(".py")]
    assert len([p for p in paths if p.endswith(".pyc")]) == len(sources)  # all compile
    for p in sources:
        head, _, name = p.rpartition("/")
        assert f"{head}/__pycache__/{name[:-3]}.{sys.implementation.cache_tag}.pyc" in files
    # the manifest is canonical JSON whose hash is the digest
    decoded = msgspec.json.decode(running.manifest_bytes, type=type(running.manifest))
    assert decoded == running.manifest
    assert running.dir_name == running.digest[:16]


def test_the_digest_is_stable_across_two_calls(running: Bundle, tmp_path: Path) -> None:
    again = Bundle.of_running_python(cache=tmp_path / "hashes.json")
    assert again.digest == running.digest
    assert again.manifest_bytes == running.manifest_bytes


def test_a_changed_file_changes_the_digest(tmp_path: Path) -> None:
    first = small_bundle(tmp_path, {"site/demo/__init__.py": b"x = 1\n"})
    same = small_bundle(tmp_path, {"site/demo/__init__.py": b"x = 1\n"})
    changed = small_bundle(tmp_path, {"site/demo/__init__.py": b"x = 2\n"})
    assert first.digest == same.digest
    assert changed.digest != first.digest
    chmodded = small_bundle(
        tmp_path, {"site/demo/__init__.py": b"x = 1\n"}, executable=["site/demo/__init__.py"]
    )
    assert chmodded.digest != first.digest


def test_first_contact_installs_an_importable_bundle_and_the_second_sends_only_hashes(
    running: Bundle, tmp_path: Path
) -> None:
    host_a, host_b = tmp_path / "host-a", tmp_path / "host-b"

    started = time.monotonic()
    first = asyncio.run(install(running, run_here, store=str(host_a), host="host-a"))
    took = time.monotonic() - started
    print(
        f"\nfirst contact: {first.sent:,} bytes sent ({first.objects} objects, "
        f"{running.size:,} bytes of content) in {took:.2f} s"
    )
    assert first.objects == len(running.sources)
    assert first.site == f"{host_a}/bundles/{running.dir_name}/site"
    site = Path(first.site)
    assert (site.parent / "manifest.json").read_bytes() == running.manifest_bytes
    assert not list((host_a / "bundles").glob("*.tmp*"))  # built beside, renamed into place

    # without the initiator's site-packages (-S): everything comes from the bundle
    probe = (
        "import evergraph, msgspec, nacl, click, evergraph.cli.main, evergraph.remote.bundle;"
        "print(evergraph.__file__); print(msgspec.__file__); print(nacl.__file__)"
    )
    isolated_env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(site)}
    out = subprocess.run(
        [sys.executable, "-S", "-s", "-c", probe],
        env=isolated_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert all(p.startswith(str(site) + "/") for p in out), out
    version = subprocess.run(
        [
            sys.executable,
            "-S",
            "-s",
            "-c",
            "import importlib.metadata as m; print(m.version('evergraph'))",
        ],
        env=isolated_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert version == dict(running.manifest.dists)["evergraph"]
    # -I ignores PYTHONPATH: the launcher puts the site first itself
    out = subprocess.run(
        [
            sys.executable,
            "-I",
            "-S",
            "-c",
            f"import sys; sys.path.insert(0, {str(site)!r}); {probe}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert all(p.startswith(str(site) + "/") for p in out), out

    # a later run with the same version: the host has it, only the digest travels
    second = asyncio.run(install(running, run_here, store=str(host_a), host="host-a"))
    print(f"second run: {second.sent:,} bytes sent ({100 * second.sent / first.sent:.3f} %)")
    assert second.objects == 0
    assert second.site == first.site
    assert second.sent <= first.sent / 100

    # even the longer way (manifest sent, nothing missing) stays under 1 %
    missing = host_op("missing", host_a, running.digest, running.manifest_bytes)
    assert missing.returncode == 0
    assert missing.stdout == b""
    longer = len(running.manifest_sent) + len(plan(running, []))
    print(f"manifest + empty plan: {longer:,} bytes ({100 * longer / first.sent:.3f} %)")
    assert longer <= first.sent / 100

    # another host starts from nothing
    other = asyncio.run(install(running, run_here, store=str(host_b), host="host-b"))
    assert other.objects == first.objects
    assert other.sent == first.sent


def test_the_plan_is_gzip_and_the_numbers_behind_it(running: Bundle) -> None:
    """The numbers behind `plan` compressing (printed with -s; no timing asserts)."""
    from evergraph.remote.bundle import _tar

    started = time.monotonic()
    plain = _tar(running, running.sources, compress=False)
    plain_s = time.monotonic() - started
    started = time.monotonic()
    gz = plan(running, running.sources)
    gz_s = time.monotonic() - started
    print(
        f"\nfirst-run plan: tar {len(plain):,} bytes in {plain_s:.2f} s; "
        f"gzip -{COMPRESS_LEVEL} {len(gz):,} bytes in {gz_s:.2f} s"
    )
    assert gz[:2] == b"\x1f\x8b"  # what the host's stdlib reads with "r|gz"
    assert len(gz) < len(plain)
    with tarfile.open(fileobj=io.BytesIO(gz), mode="r|gz") as tar:
        assert sorted(m.name for m in tar) == sorted(running.sources)


def test_hosts_missing_the_same_objects_share_one_plan_built_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import evergraph.remote.bundle as bundle_mod

    (tmp_path / "src").mkdir()
    bundle = small_bundle(tmp_path / "src", {"site/demo/a.py": b"a\n", "site/demo/b.py": b"b\n"})
    built: list[tuple[str, ...]] = []
    real_build = bundle_mod.SharedPlan.build

    def counting_build(self: bundle_mod.SharedPlan, b: Bundle, key: tuple[str, ...]) -> None:
        built.append(key)
        real_build(self, b, key)

    monkeypatch.setattr(bundle_mod.SharedPlan, "build", counting_build)
    hosts = [tmp_path / f"host-{i}" for i in range(4)]

    async def first_contact() -> list[Installed]:
        return await asyncio.gather(
            *(install(bundle, run_here, store=str(h), host=h.name) for h in hosts)
        )

    done = asyncio.run(first_contact())
    assert built == [tuple(sorted(bundle.sources))]  # once, for the four hosts
    assert all(d.objects == 2 for d in done)
    assert len({d.sent for d in done}) == 1
    for h in hosts:
        assert (h / "bundles" / bundle.dir_name / "site/demo/b.py").read_bytes() == b"b\n"
    # a host missing another set gets a plan of its own; the same set again is not rebuilt
    sha_a = next(f.sha256 for f in bundle.manifest.files if f.path.endswith("a.py"))

    async def twice() -> tuple[bytes, bytes, bytes]:
        return (
            await bundle.plan_for([sha_a]).read(),
            await bundle.plan_for([sha_a, sha_a]).read(),
            await bundle.plan_for(bundle.sources).read(),
        )

    one, same, everything = asyncio.run(twice())
    assert one == same == plan(bundle, [sha_a])
    assert everything == plan(bundle, bundle.sources)
    assert built == [tuple(sorted(bundle.sources)), (sha_a,)]
    assert bundle.plan_for([sha_a]) is bundle.plan_for([sha_a])
    # an object the bundle does not hold: refused before anything is built
    with pytest.raises(BundleError, match="not in this bundle"):
        bundle.plan_for(["f" * 64])
    assert len(built) == 2


def test_a_plan_read_while_it_is_built_is_the_whole_plan(tmp_path: Path) -> None:
    """Hosts read the plan as it grows (PLAN_CHUNK at a time), from their own start."""
    import evergraph.remote.bundle as bundle_mod

    (tmp_path / "src").mkdir()
    files = {f"site/demo/m{i}.py": os.urandom(100_000) for i in range(8)}  # incompressible
    bundle = small_bundle(tmp_path / "src", files)
    whole = plan(bundle, bundle.sources)
    assert len(whole) > 2 * bundle_mod.PLAN_CHUNK  # more than one piece

    async def readers() -> list[bytes]:
        shared = bundle.plan_for(bundle.sources)
        first = asyncio.create_task(shared.read())  # most likely while it is built
        return [await first, await shared.read()]  # and one after

    assert asyncio.run(readers()) == [whole, whole]
    with tarfile.open(fileobj=io.BytesIO(whole), mode="r|gz") as tar:
        assert sorted(m.name for m in tar) == sorted(bundle.sources)


# --- the initiator's cache of file hashes --------------------------------------------

LATER = 3600 * 10**9  # an hour: a clock past RACY_NS for files written just now


def test_the_hash_cache_spares_rehashing_and_sees_an_in_place_change(tmp_path: Path) -> None:
    cache = tmp_path / "cache" / "bundle-hashes.json"
    f = tmp_path / "mod.py"
    f.write_bytes(b"x = 1\n")

    first = HashCache.load(cache)
    first.now_ns = lambda: time.time_ns() + LATER
    sha1, size, mode = first.hash(f)
    first.save()
    assert (sha1, size, mode) == (sha256_hex(b"x = 1\n"), 6, 0o644)
    assert first.hashed == 1
    assert cache.stat().st_mode & 0o777 == 0o600
    assert cache.parent.stat().st_mode & 0o777 == 0o700

    again = HashCache.load(cache)
    assert again.hash(f) == (sha1, 6, 0o644)
    assert again.hashed == 0  # its stat is unchanged: the kept hash

    # the content changes in place, same size, its mtime put back: ctime moved
    # (a write or utime sets it to now, and nothing can set it back)
    before = os.stat(f)
    with f.open("r+b") as w:
        w.write(b"x = 2\n")
    os.utime(f, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(f)
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (
        before.st_size,
        before.st_mtime_ns,
        before.st_ino,
    )
    changed = HashCache.load(cache)
    assert changed.hash(f)[0] == sha256_hex(b"x = 2\n")
    assert changed.hashed == 1

    # so does a chmod (the mode that travels is taken from the same stat)
    f.chmod(0o755)
    assert HashCache.load(cache).hash(f) == (sha256_hex(b"x = 2\n"), 6, 0o755)


def test_a_file_changed_within_the_racy_window_is_never_kept(tmp_path: Path) -> None:
    """A write in the same clock tick as the stat leaves every stat field as it
    was: a hash taken of a file changed less than RACY_NS ago is used, not kept."""
    cache = tmp_path / "bundle-hashes.json"
    f = tmp_path / "mod.py"
    f.write_bytes(b"x = 1\n")
    fresh = HashCache.load(cache)  # the real clock: f was written just now
    assert fresh.hash(f)[0] == sha256_hex(b"x = 1\n")
    fresh.save()
    assert not cache.exists()  # nothing worth keeping
    # so an in-place change within the same tick (stat identical) is still seen
    st = os.stat(f)
    with f.open("r+b") as w:
        w.write(b"x = 3\n")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert HashCache.load(cache).hash(f)[0] == sha256_hex(b"x = 3\n")


def test_a_hash_cache_not_ours_or_of_another_version_is_ignored(tmp_path: Path) -> None:
    cache = tmp_path / "bundle-hashes.json"
    f = tmp_path / "mod.py"
    f.write_bytes(b"x = 1\n")
    hc = HashCache.load(cache)
    hc.now_ns = lambda: time.time_ns() + LATER
    hc.hash(f)
    hc.save()
    assert HashCache.load(cache).old  # kept

    cache.chmod(0o666)  # writable by others: anyone could have put a lie there
    assert not HashCache.load(cache).old
    cache.chmod(0o600)
    entry = msgspec.json.decode(cache.read_bytes())
    entry["key"] = "0.0.1 " + entry["key"]  # another evergraph's
    cache.write_bytes(msgspec.json.encode(entry))
    assert not HashCache.load(cache).old
    cache.write_bytes(b"{not json")
    assert not HashCache.load(cache).old
    # and a cache that cannot be written costs nothing but the hashing
    blocked = HashCache(tmp_path / "mod.py" / "no" / "cache.json")
    blocked.now_ns = lambda: time.time_ns() + LATER
    blocked.hash(f)
    blocked.save()


def test_a_cached_bundle_is_the_same_bundle(
    tmp_path: Path, running: Bundle, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_path() == tmp_path / "xdg" / "evergraph" / "bundle-hashes.json"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    assert cache_path() == Path.home() / ".cache" / "evergraph" / "bundle-hashes.json"
    cache = tmp_path / "cache.json"
    cold = Bundle.of_running_python(cache=cache)
    warm = Bundle.of_running_python(cache=cache)
    assert cold.manifest_bytes == warm.manifest_bytes == running.manifest_bytes
    assert cache.is_file()


def test_the_store_links_objects_and_copies_executables(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    shared = b"same bytes in two places\n"
    bundle = small_bundle(
        tmp_path / "src",
        {"site/demo/a.py": shared, "site/demo/b.py": shared, "site/demo/tool": b"#!/bin/sh\n"},
        executable=["site/demo/tool"],
    )
    store = tmp_path / "host"
    missing = host_op("missing", store, bundle.digest, bundle.manifest_bytes)
    assert missing.returncode == 0, missing.stderr
    assert len(missing.stdout.split()) == 2  # the shared content is one object
    stored = host_op("store", store, bundle.digest, plan(bundle, missing.stdout.decode().split()))
    assert stored.returncode == 0, stored.stderr
    site = store / "bundles" / bundle.dir_name / "site"
    assert (site / "demo/a.py").read_bytes() == shared
    assert (site / "demo/a.py").stat().st_ino == (site / "demo/b.py").stat().st_ino
    assert (site / "demo/a.py").stat().st_nlink == 3  # the object and its two names
    assert (site / "demo/tool").stat().st_mode & 0o777 == 0o755
    assert (site / "demo/tool").stat().st_nlink == 1  # a copy: its mode is its own
    sha = bundle.manifest.files[0].sha256
    assert (store / "objects" / sha[:2] / sha).is_file()


def test_a_tampered_object_is_refused(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    bundle = small_bundle(tmp_path / "src", {"site/demo/__init__.py": b"x = 1\n"})
    store = tmp_path / "host"
    assert host_op("missing", store, bundle.digest, bundle.manifest_bytes).returncode == 0
    sha = bundle.manifest.files[0].sha256
    forged = io.BytesIO()
    with tarfile.open(fileobj=forged, mode="w") as tar:
        info = tarfile.TarInfo(sha)
        info.size = len(b"x = 666\n")
        tar.addfile(info, io.BytesIO(b"x = 666\n"))
    refused = host_op("store", store, bundle.digest, forged.getvalue())
    assert refused.returncode == 3
    assert f"object {sha}: its content hashes to" in refused.stderr.decode()
    assert not (store / "objects" / sha[:2] / sha).exists()
    assert not list((store / "objects" / sha[:2]).iterdir())  # no temp left behind
    assert not (store / "bundles").exists()


def test_a_tar_member_that_is_not_an_object_is_refused(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    bundle = small_bundle(tmp_path / "src", {"site/demo/__init__.py": b"x = 1\n"})
    store = tmp_path / "host"
    assert host_op("missing", store, bundle.digest, bundle.manifest_bytes).returncode == 0
    evil = io.BytesIO()
    with tarfile.open(fileobj=evil, mode="w") as tar:
        info = tarfile.TarInfo("../../escaped")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"!"))
    refused = host_op("store", store, bundle.digest, evil.getvalue())
    assert refused.returncode == 3
    assert "refused tar member" in refused.stderr.decode()
    assert not (tmp_path / "escaped").exists()


def test_a_manifest_whose_hash_is_not_the_digest_is_refused(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    bundle = small_bundle(tmp_path / "src", {"site/demo/__init__.py": b"x = 1\n"})
    store = tmp_path / "host"
    other = "0" * 64
    refused = host_op("missing", store, other, bundle.manifest_bytes)
    assert refused.returncode == 3
    assert "refused" in refused.stderr.decode()
    assert not (store / "manifests" / f"{other}.json").exists()


def test_a_manifest_path_outside_site_is_refused(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    bundle = small_bundle(tmp_path / "src", {"site/../../outside": b"x\n"})
    store = tmp_path / "host"
    missing = host_op("missing", store, bundle.digest, bundle.manifest_bytes)
    refused = host_op("store", store, bundle.digest, plan(bundle, missing.stdout.decode().split()))
    assert refused.returncode == 3
    assert "refused path 'site/../../outside'" in refused.stderr.decode()
    assert not (tmp_path / "outside").exists()
    assert not (store / "bundles" / bundle.dir_name).exists()


def test_python_problem_names_both_sides_and_what_to_do() -> None:
    here, machine = running_python(), platform.machine()
    assert python_problem(here, machine) is None
    line = python_problem("3.9", machine, host="web1")
    assert line is not None
    assert "\n" not in line
    assert "web1 has python 3.9" in line
    assert f"needs python{here} on {machine}" in line
    assert line.endswith(f"install python{here} on web1")
    other = python_problem(here, "riscv64", host="web2")
    assert other is not None
    assert "riscv64" in other
    assert machine in other


def test_install_stops_at_a_host_with_another_python(running: Bundle) -> None:
    calls: list[str] = []

    async def old_host(argv: Sequence[str], stdin: bytes) -> bytes:
        calls.append(argv[3])
        return b'{"python": "3.9", "machine": "%s", "present": false}' % platform.machine().encode()

    with pytest.raises(BundleError, match=r"web1 has python 3\.9 .*: install python3\.\d+ on web1"):
        asyncio.run(install(running, old_host, store="/nowhere", host="web1"))
    assert calls == ["probe"]  # nothing else was sent


def test_a_finished_plan_is_kept_and_sent_again_without_compressing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import evergraph.remote.bundle as bundle_mod

    (tmp_path / "src").mkdir()
    files = {"site/demo/a.py": b"a\n", "site/demo/b.py": b"b\n"}
    cache = tmp_path / "cache" / "hashes.json"
    paths = {rel: tmp_path / "src" / rel.replace("/", "__") for rel in files}
    for rel, local in paths.items():
        local.write_bytes(files[rel])
    dists = [("demo", "1.0")]
    first = Bundle.of_paths((paths, dists), cache=cache)
    assert first.plan_cache == tmp_path / "cache" / "plans"
    built: list[tuple[str, ...]] = []
    real = bundle_mod._write_tar

    def counting(b: Bundle, missing: Iterable[str], emit: Any, *, compress: bool) -> None:
        built.append(tuple(missing))
        real(b, missing, emit, compress=compress)

    monkeypatch.setattr(bundle_mod, "_write_tar", counting)
    whole = asyncio.run(first.plan_for(first.sources).read())
    assert len(built) == 1
    kept = list((tmp_path / "cache" / "plans").glob("*.tar.gz"))
    assert len(kept) == 1
    assert kept[0].stat().st_mode & 0o777 == 0o600
    assert kept[0].read_bytes() == whole

    # the next run (a new Bundle of the same files): the kept plan, not a new one
    again = Bundle.of_paths((paths, dists), cache=cache)
    assert asyncio.run(again.plan_for(again.sources).read()) == whole
    assert len(built) == 1

    # a damaged plan is not sent: it is built anew (and kept again)
    kept[0].write_bytes(whole[:10] + bytes([whole[10] ^ 1]) + whole[11:])
    damaged = Bundle.of_paths((paths, dists), cache=cache)
    assert asyncio.run(damaged.plan_for(damaged.sources).read()) == whole
    assert len(built) == 2
    assert kept[0].read_bytes() == whole
    # and one that others could have written is not trusted either
    kept[0].chmod(0o666)
    loose = Bundle.of_paths((paths, dists), cache=cache)
    assert asyncio.run(loose.plan_for(loose.sources).read()) == whole
    assert len(built) == 3


# --- what a remote agent gets: the lean bundle, with its bytecode ---------------------


def _tops(paths: Iterable[str]) -> set[str]:
    """The top-level importable names of ``site/`` paths."""
    out = set()
    for p in paths:
        parts = p.split("/")
        if parts[0] == "site" and len(parts) > 1 and not parts[1].endswith(".dist-info"):
            out.add(parts[1].split(".")[0])
    return out


def test_a_remote_agent_bundle_leaves_out_what_no_agent_imports() -> None:
    full_files, full = collect_files()
    lean_files, lean = collect_files(AGENT_LEAVES_OUT)
    left_out = {name for name, _ in full} - {name for name, _ in lean}
    # the rule's names, and what only they require (rich's)
    assert set(AGENT_LEAVES_OUT) <= left_out
    assert left_out - set(AGENT_LEAVES_OUT) == {"pygments", "markdown-it-py", "mdurl"}
    # what a shipped distribution or any kind needs stays (cffi: PyNaCl's, anyio: httpx's)
    kinds = {"dbus-fast", "pyroute2", "docker", "libvirt-python", "python-augeas", "httpx"}
    world = {"aetcd", "grpcio", "protobuf", "pynacl", "cffi", "msgspec", "click"}
    assert kinds | world | {"anyio", "h11", "yaml-rs", "pyyaml"} <= {name for name, _ in lean}
    assert set(lean_files) < set(full_files)
    assert {"asyncssh", "cryptography", "rich", "pygments", "uvicorn", "starlette"} <= (
        _tops(full_files) - _tops(lean_files)
    )
    # the default of a bundle of the running python; remote --install asks for all
    assert Bundle.of_running_python.__kwdefaults__["leave_out"] is AGENT_LEAVES_OUT


def _bytecode(site: Path) -> dict[str, int]:
    """Every .pyc under `site`, with its inode (a rewrite by an import is a new one)."""
    return {
        str(p.relative_to(site)): p.stat().st_ino
        for p in site.rglob("*.pyc")
        if p.parent.name == "__pycache__"
    }


def test_a_remote_agent_converges_several_kinds_from_the_lean_bundle_and_its_bytecode(
    running: Bundle, tmp_path: Path, shm: Path, servers: list[EtcdServer]
) -> None:
    """The agent a remote host runs (remote/session.py's command line, but for the
    wrapper), from the lean bundle as a host stores it and nothing else (-S): it
    converges a graph of several kinds through an etcd World, imports nothing the
    bundle leaves out, and compiles nothing (every .pyc it reads was shipped). The
    SSH end-to-end runs (tests/remote/test_remote.py, test_remote_exports.py) use the
    same bundle (`RemoteRun`'s default) for a file, an exec and exports."""
    installed = asyncio.run(install(running, run_here, store=str(tmp_path / "host")))
    site = Path(installed.site)
    shipped = _bytecode(site)
    assert len(shipped) == sum(f.path.endswith(".pyc") for f in running.manifest.files)
    server = EtcdServer.single(shm / "etcd")
    servers.append(server)
    server.start()
    d = tmp_path / "managed"
    graph = tmp_path / "lean.yaml"
    graph.write_text(
        "graph: lean\n"
        "resources:\n"
        "  file:\n"
        f"  - {{name: dir, path: {d}/}}\n"
        f'  - {{name: conf, path: {d}/app.conf, content: "a = 1\\n"}}\n'
        "  gzip:\n"
        f'  - {{name: {d}/notes.gz, content: "notes\\n"}}\n'
        "  tar:\n"
        f"  - {{name: {d}/conf.tar, inputs: [{d}/app.conf]}}\n"
        "  kv:\n"
        "  - {name: lean-key, value: lean}\n"
        "  exec:\n"
        f'  - {{name: mark, cmd: "touch {d}/ran", creates: {d}/ran}}\n'
        "  noop:\n"
        "  - {name: ready}\n"
        "  print:\n"
        "  - {name: done, msg: lean converged}\n"
    )
    # remote/session.py's AGENT_WRAPPER starts the agent so (without -S: a host's own
    # site-packages stay on the path there; here nothing but the bundle)
    boot = f"import sys; sys.path.insert(0, {str(site)!r})\n"
    boot += "from evergraph.cli.main import main\nmain()"
    agent = [sys.executable, "-I", "-S", "-X", "importtime", "-c", boot, "run", str(graph)]
    agent += [
        "--seeds",
        server.client_url,
        "--hostname",
        "lean",
        "--state-dir",
        str(tmp_path / "s"),
    ]
    agent += ["--converged-timeout", "0", "--converged-exit", "--log-format", "text"]
    r = subprocess.run(agent, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    log = [line for line in r.stderr.splitlines() if not line.startswith("import time:")]
    assert r.returncode == 0, "\n".join(log[-20:])
    assert (d / "app.conf").read_text() == "a = 1\n"
    assert gzip.decompress((d / "notes.gz").read_bytes()) == b"notes\n"
    with tarfile.open(d / "conf.tar") as tar:
        assert [m.name.rsplit("/", 1)[-1] for m in tar] == ["app.conf"]
    assert (d / "ran").exists()
    assert any("lean converged" in line for line in log), log
    imported = {
        line.rsplit("|", 1)[1].strip().split(".")[0]
        for line in r.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }
    assert {"evergraph", "aetcd", "grpc", "nacl", "yaml_rs"} <= imported
    all_files, _ = collect_files()
    left_out = _tops(all_files) - _tops(f.path for f in running.manifest.files)
    assert not imported & left_out
    # every kind's module and library imports from the bundle alone, compiling nothing
    kinds = (
        "import importlib, pkgutil, evergraph.resources as r\n"
        "for m in pkgutil.iter_modules(r.__path__):\n"
        "    importlib.import_module('evergraph.resources.' + m.name)\n"
        "import augeas, dbus_fast.aio, docker, httpx, libvirt, pyroute2, yaml\n"
    )
    subprocess.run(
        [
            sys.executable,
            "-I",
            "-S",
            "-c",
            f"import sys; sys.path.insert(0, {str(site)!r})\n{kinds}",
        ],
        cwd=tmp_path,
        check=True,
        timeout=60,
    )
    assert _bytecode(site) == shipped  # no .pyc written or rewritten on the host


def test_bytecode_is_compiled_once_and_again_only_for_a_changed_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "mod.py").write_text("X = {'a', 'b'}\n")
    (src / "broken.py").write_text("def (:\n")
    (src / "data.txt").write_text("not python\n")
    files = {f"site/demo/{p.name}": p for p in src.iterdir()}
    cache, pycs = tmp_path / "cache" / "hashes.json", tmp_path / "cache" / "pyc"
    tag = sys.implementation.cache_tag
    compiled: list[int] = []
    real = bundle_mod._compile
    monkeypatch.setattr(
        bundle_mod, "_compile", lambda todo: (compiled.append(len(todo)), real(todo))
    )

    def build() -> Bundle:
        return Bundle.of_paths((files, [("demo", "1")]), cache=cache, pyc_cache=pycs)

    first = build()
    paths = {f.path: f for f in first.manifest.files}
    pyc = f"site/demo/__pycache__/mod.{tag}.pyc"
    # a .pyc for what compiles, nothing for what does not (and no error)
    assert set(paths) == {*files, pyc}
    assert compiled == [2]
    data = first.sources[paths[pyc].sha256].read_bytes()
    assert data[8:16] == importlib.util.source_hash((src / "mod.py").read_bytes())
    assert build().manifest_bytes == first.manifest_bytes
    assert compiled == [2]  # never again: not even the one that failed
    (src / "mod.py").write_text("X = 2\n")
    changed = build()
    assert compiled == [2, 1]
    assert {f.path for f in changed.manifest.files} == set(paths)
    assert changed.digest != first.digest
    # a kept file that is not fit (writable by others) is compiled again
    for kept in pycs.rglob("*.pyc"):
        kept.chmod(0o666)
    assert build().digest == changed.digest
    assert compiled == [2, 1, 1]
    # what it holds runs as that source: loaded from the bundle's layout
    installed = asyncio.run(install(changed, run_here, store=str(tmp_path / "host")))
    site = Path(installed.site)
    out = subprocess.run(
        [
            sys.executable,
            "-I",
            "-S",
            "-v",
            "-c",
            f"import sys; sys.path.insert(0, {str(site)!r}); import demo.mod; print(demo.mod.X)",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "2"
    assert f"code object from '{site}/demo/__pycache__/mod.{tag}.pyc'" in out.stderr
    # what is kept beyond the bundle's own is bounded: the oldest goes first
    assert len(list(pycs.rglob("*.pyc"))) == 2  # the first mod.py's and the second's
    monkeypatch.setattr(bundle_mod, "PYC_SPARE", 0)
    (src / "mod.py").write_text("X = 3\n")
    build()
    assert compiled == [2, 1, 1, 1]
    assert len(list(pycs.rglob("*.pyc"))) == 1  # X = 3's only; broken.py's .none stays
    assert len(list(pycs.rglob("*.none"))) == 1
